"""What the proxy passes on of a client's headers and adds to its answers: the request id (configurable
header, echoed, made when absent), W3C trace context to the worker, and CORS (off by default); with the
real `openai` client, over the HTTP protocol and over the ASGI fast path alike."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.http_stream import head_of, header_value
from router.event_plane.embedded_server import EmbeddedNats
from tests.proxy_fleet import MODEL, fleet, idle

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.anyio
@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_the_request_id_is_passed_to_the_worker_and_echoed_and_the_trace_context_propagated(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    async with fleet(nats_server.url, (1,), service={"fast_protocol": fast_protocol}) as f:
        worker = f.apis[1]
        headers = {"X-Request-Id": "client-id-7", "traceparent": TRACEPARENT, "tracestate": "vendor=x"}
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_headers=headers
        )
        assert raw.headers["x-request-id"] == "client-id-7"
        assert worker.last_headers[b"x-request-id"] == b"client-id-7"
        assert worker.last_headers[b"traceparent"] == TRACEPARENT.encode()
        assert worker.last_headers[b"tracestate"] == b"vendor=x"
        # Streamed, without an id: one is made, the worker gets the same, and no trace context is invented.
        stream = await f.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        made = stream.headers["x-request-id"]
        assert len(made) == 32 and worker.last_headers[b"x-request-id"] == made.encode()
        assert b"traceparent" not in worker.last_headers
        assert [chunk async for chunk in stream.parse()]
        # A refusal carries it too; an id that is not visible ASCII is replaced.
        with pytest.raises(openai.BadRequestError) as caught:
            await f.client.completions.create(model=MODEL, prompt=[], extra_headers={"x-request-id": "mine"})
        assert caught.value.response.headers["x-request-id"] == "mine"
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers={"x-request-id": "has space"}
        )
        assert raw.headers["x-request-id"] != "has space" and len(raw.headers["x-request-id"]) == 32
        # As long as the decision API's request ids, and no longer.
        for given, kept in (("i" * 256, True), ("i" * 257, False)):
            raw = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers={"x-request-id": given}
            )
            assert (raw.headers["x-request-id"] == given) is kept
        assert idle(f.router)


MALFORMED_TRACEPARENTS = [
    "garbage",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero parent id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
    TRACEPARENT + "-extra",  # version 00 with a field after its four
    "00-" + "a" * 5000,
]


@pytest.mark.anyio
async def test_a_malformed_traceparent_is_not_passed_on_nor_its_tracestate(nats_server: EmbeddedNats) -> None:
    """W3C Trace Context: a malformed ``traceparent`` is ignored, and the ``tracestate`` beside it with
    it. Both went to the engine as they came (garbage, all-zero ids, 5,000 bytes), the vendor state
    then belonging to no trace."""
    async with fleet(nats_server.url, (1,)) as f:
        worker = f.apis[1]
        for malformed in MALFORMED_TRACEPARENTS:
            headers = {"traceparent": malformed, "tracestate": "vendor=x"}
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers=headers)
            assert b"traceparent" not in worker.last_headers, malformed
            assert b"tracestate" not in worker.last_headers, malformed
        later_version = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"
        await f.client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers={"traceparent": later_version}
        )
        assert worker.last_headers[b"traceparent"] == later_version.encode()  # a later version's fields kept
        assert idle(f.router)


@pytest.mark.anyio
@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_the_request_id_header_is_configurable_and_a_browser_script_may_read_it(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    """Every answer carries the request id; with CORS, it is exposed to the page's script as the
    ``x-kv-router-*`` headers are (it was not: the browser hid it)."""
    origin = "https://app.example.com"
    service = {"fast_protocol": fast_protocol, "cors_allow_origins": [origin]}
    proxy = {"proxy_request_id_header": "X-Correlation-Id"}
    async with fleet(nats_server.url, (1,), service=service, proxy=proxy) as f:
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers={"x-correlation-id": "corr-1", "origin": origin}
        )
        assert raw.headers["x-correlation-id"] == "corr-1"
        assert f.apis[1].last_headers[b"x-correlation-id"] == b"corr-1"
        assert "x-correlation-id" in raw.headers["access-control-expose-headers"].split(", ")
        async with httpx.AsyncClient(base_url=f.url) as http:  # FastAPI's routes, through the middleware
            models = await http.get("/v1/models", headers={"origin": origin})
        assert "x-correlation-id" in models.headers["access-control-expose-headers"].split(", ")


@pytest.mark.anyio
@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_cors_answers_allowed_origins_only_and_is_off_by_default(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    origin = "https://app.example.com"
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    service = {"fast_protocol": fast_protocol, "cors_allow_origins": [origin]}
    async with fleet(nats_server.url, (1,), service=service) as f, httpx.AsyncClient(base_url=f.url) as http:
        preflight = await http.options(
            "/v1/chat/completions",
            headers={"origin": origin, "access-control-request-method": "POST", "access-control-request-headers": "x"},
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
        answer = await http.post("/v1/completions", json=body, headers={"origin": origin})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
        assert "x-kv-router-worker" in answer.headers["access-control-expose-headers"]
        models = await http.get("/v1/models", headers={"origin": origin})
        assert models.headers["access-control-allow-origin"] == origin
        stranger = await http.post("/v1/completions", json=body, headers={"origin": "https://evil.example"})
        assert stranger.status_code == 200 and "access-control-allow-origin" not in stranger.headers
        refused = await http.options(
            "/v1/completions", headers={"origin": "https://evil.example", "access-control-request-method": "POST"}
        )
        assert refused.status_code == 400
    async with fleet(nats_server.url, (1,), service={"fast_protocol": fast_protocol}) as f:
        async with httpx.AsyncClient(base_url=f.url) as http:
            answer = await http.post("/v1/completions", json=body, headers={"origin": origin})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


@pytest.mark.anyio
@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_refusals_before_the_body_is_read_carry_the_request_id_and_the_cors_headers(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    """The 401 for want of the API token and the 413 of a body over the limit are answered before the
    proxy reads the request: a browser script of an allowed origin can still read why (without the
    CORS headers it sees an opaque network error), and the client's request id comes back (a fresh
    one when it sent none), as on every other answer."""
    origin = "https://app.example.com"
    service = {"fast_protocol": fast_protocol, "cors_allow_origins": [origin], "max_body_bytes": 4096}
    security = {"api_token": "s3cret", "protect_decisions": True}
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    large = {**body, "prompt": list(range(1, 2000))}
    token = {"authorization": "Bearer s3cret"}
    async with (
        fleet(nats_server.url, (1,), service=service, security=security) as f,
        httpx.AsyncClient(base_url=f.url) as http,
    ):
        unauthorized = await http.post("/v1/completions", json=body, headers={"origin": origin, "x-request-id": "r-1"})
        too_large = await http.post(
            "/v1/chat/completions", json=large, headers={"origin": origin, "x-request-id": "r-2", **token}
        )
        anonymous = await http.post("/v1/completions", json=large, headers=token)
        stranger = await http.post("/v1/completions", json=large, headers={"origin": "https://evil.example", **token})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "unauthorized"
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "invalid_request_error"
    for refused, request_id in ((unauthorized, "r-1"), (too_large, "r-2")):
        assert refused.headers["access-control-allow-origin"] == origin
        assert refused.headers.get_list("x-request-id") == [request_id]
    assert anonymous.status_code == 413 and len(anonymous.headers.get_list("x-request-id")[0]) > 8
    assert "access-control-allow-origin" not in anonymous.headers
    assert stranger.status_code == 413 and "access-control-allow-origin" not in stranger.headers


NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,12}", fullmatch=True)
VALUES = st.from_regex(r"[!-~]([ -~]{0,30}[!-~])?", fullmatch=True)


@given(st.lists(st.tuples(NAMES, VALUES), max_size=8), NAMES)
def test_a_header_is_read_by_its_name_whatever_its_case_and_its_neighbours(
    headers: list[tuple[str, str]], asked: str
) -> None:
    head = head_of([(name.encode(), value.encode()) for name, value in headers])
    for name in [*(n for n, _ in headers), asked]:
        expected = next((v for n, v in headers if n.lower() == name.lower()), None)
        read = header_value(head, name.lower().encode())
        assert read == (expected.encode() if expected is not None else None)
        assert header_value(head, name.lower().encode(), b"\n" + head.lower()) == read
