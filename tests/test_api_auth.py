"""The API token (`api.auth`) on every path a request can take: FastAPI's routes and kv-router's HTTP
protocol in-process (`tests/protocol_asgi.py`), and the protocol (`api.http_protocol`) over loopback,
byte for byte against uvicorn's own protocol and FastAPI's routes. A refused request answers 401
with the JSON error body and changes nothing; the token is compared in constant time and never
shows in logs, errors or ``config show``.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.auth import Access, ApiAuth, Unauthorized
from api.config import ProxyConfig, SecurityConfig, ServiceConfig, Settings, load_settings
from api.handlers import HOT_ACCESS
from router.config import RouterConfig
from router.errors import ConfigError
from tests.protocol_asgi import ThroughProtocol
from tests.router_processes import RouterProcess, kv_router_command
from tests.test_api_protocol import Client, post, uvicorn_on_loopback
from tests.test_api_support import BLOCK_SIZE, prompt, stored_event

TOKEN = "s3cret-token_with.chars~"
GOOD = {"authorization": f"Bearer {TOKEN}"}
WRONG = [
    {},
    {"authorization": "Bearer wrong"},
    {"authorization": f"Basic {TOKEN}"},
    {"authorization": TOKEN},
    {"authorization": f"Bearer {TOKEN}x"},
    {"authorization": f"Bearer {TOKEN[:-1]}"},
    {"authorization": "Bearer"},
]


@contextmanager
def app_client(fast_protocol: bool, **security: Any) -> Iterator[TestClient]:
    settings = Settings(
        service=ServiceConfig(fast_protocol=fast_protocol),
        router=RouterConfig(block_size=BLOCK_SIZE),
        security=SecurityConfig(**security),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(ThroughProtocol(app) if fast_protocol else app, base_url="http://127.0.0.1") as client:
        yield client


@pytest.fixture(params=[True, False], ids=["protocol", "asgi"])
def fast_protocol(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _state(client: TestClient) -> tuple[Any, Any, Any]:
    workers = client.get("/v1/workers", headers=GOOD).json()
    for worker in workers["workers"]:
        for stream in worker["event_streams"]:
            stream.pop("last_event_age_s")  # moves with the clock, not with requests
    dump = client.get("/v1/dump", headers=GOOD).json()
    loads = client.post("/v1/potential_loads", json={"tokens": list(range(64))}, headers=GOOD).json()
    return workers, dump, loads


def _assert_unauthorized(reply: Any, fields: frozenset[str] = frozenset({"type", "message"})) -> None:
    assert reply.status_code == 401, reply.text
    assert reply.json()["error"]["type"] == "unauthorized"
    assert set(reply.json()["error"]) == fields
    assert reply.headers["www-authenticate"].startswith("Bearer")
    assert TOKEN not in reply.text


TOKENS = prompt(1, 64)
# (method, path, body) of each route that changes state other than bookings.
ADMIN_CALLS = [
    ("POST", "/v1/events", stored_event(1, TOKENS)),
    ("POST", "/v1/workers", {"worker_id": 9}),
    ("DELETE", "/v1/workers/1", None),
]
DECISION_CALLS = [
    ("POST", "/v1/new", {"tokens": TOKENS, "request_id": "r-new"}),
    ("POST", "/v1/router", {"method": "new", "tokens": TOKENS, "request_id": "r-router"}),
    ("POST", "/v1/router", {"method": "mark_free", "request_id": "booked"}),
    ("POST", "/v1/mark_prefill", {"request_id": "booked"}),
    ("POST", "/v1/mark_free", {"request_id": "booked"}),
    ("POST", "/v1/record_output", {"request_id": "booked", "generated_tokens": 1}),
    ("POST", "/v1/potential_loads", {"tokens": TOKENS}),
    ("POST", "/v1/overlap", {"tokens": TOKENS}),
]
READ_PATHS = [
    "/v1/workers", "/v1/workers/1", "/v1/dump", "/v1/doctor", "/v1/info", "/metrics", "/docs", "/redoc", "/openapi.json"
]  # fmt: skip
READ_CALLS = [("GET", path, None) for path in READ_PATHS]
PROBE_CALLS = [("GET", path, None) for path in ("/healthz", "/readyz", "/health", "/liveness", "/readiness")]


def _call(client: TestClient, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    return client.request(method, path, json=body, headers=headers)


def _seed(client: TestClient) -> None:
    """One worker holding a prefix, and one booked request: something a refused call could change."""
    assert client.post("/v1/workers", json={"worker_id": 1}, headers=GOOD).status_code == 201
    assert client.post("/v1/events", json=stored_event(1, prompt(2, 64)), headers=GOOD).json()["applied"] == 1
    booked = client.post("/v1/new", json={"tokens": prompt(2, 64), "request_id": "booked"}, headers=GOOD)
    assert booked.status_code == 200


@pytest.mark.parametrize("protect_decisions", [False, True])
def test_refused_calls_answer_401_and_change_nothing(fast_protocol: bool, protect_decisions: bool) -> None:
    with app_client(fast_protocol, api_token=TOKEN, protect_decisions=protect_decisions) as client:
        _seed(client)
        before = _state(client)
        guarded = ADMIN_CALLS + (DECISION_CALLS if protect_decisions else [])
        for method, path, body in guarded:
            for headers in WRONG:
                _assert_unauthorized(_call(client, method, path, body, headers))
        assert _state(client) == before
        unauthorized = 'kv_router_requests_total{method="events",outcome="unauthorized"}'
        assert f"{unauthorized} {float(len(WRONG))}" in client.get("/metrics").text
        # Open routes answer without a token; the guarded ones with it.
        for method, path, body in READ_CALLS + PROBE_CALLS + ([] if protect_decisions else DECISION_CALLS):
            assert _call(client, method, path, body, {}).status_code != 401, path
        for method, path, body in guarded:
            assert _call(client, method, path, body, GOOD).status_code != 401, path


def test_bearer_scheme_is_case_insensitive_and_whitespace_tolerant(fast_protocol: bool) -> None:
    with app_client(fast_protocol, api_token=TOKEN) as client:
        for value in (f"bearer {TOKEN}", f"BEARER  {TOKEN} ", f"Bearer {TOKEN}"):
            reply = client.post("/v1/workers", json={"worker_id": 3}, headers={"authorization": value})
            assert reply.status_code in (200, 201), value


def test_reads_and_probes_are_guarded_only_when_configured(fast_protocol: bool) -> None:
    with app_client(fast_protocol, api_token=TOKEN, protect_reads=True) as client:
        for method, path, body in READ_CALLS:
            _assert_unauthorized(_call(client, method, path, body, {}))
        for method, path, body in PROBE_CALLS:
            assert _call(client, method, path, body, {}).status_code == 200
    with app_client(fast_protocol, api_token=TOKEN, protect_probes=True) as client:
        for method, path, body in PROBE_CALLS:
            _assert_unauthorized(_call(client, method, path, body, {}))
        assert client.get("/healthz", headers=GOOD).status_code == 200


def test_every_route_is_guarded_with_everything_protected() -> None:
    """A route added later without the dependency fails here: with every class protected, every
    route of the app (but the public documentation assets) refuses a request without the token."""
    security = {"api_token": TOKEN, "protect_decisions": True, "protect_reads": True, "protect_probes": True}
    with app_client(True, **security) as client:
        routes = list(_api_routes(client.app.routes))  # type: ignore[attr-defined]
        assert len(routes) >= 18
        for route in routes:
            path = route.path.replace("{worker_id}", "1")
            if path == "/docs/oauth2-redirect":  # static page of Swagger UI's OAuth flow, no data
                continue
            for method in route.methods:
                reply = client.request(method, path, json={})
                if method == "HEAD":  # a probe's: the GET's answer without its body
                    assert reply.status_code == 401 and reply.headers["www-authenticate"].startswith("Bearer")
                else:
                    _assert_unauthorized(reply)


def _api_routes(routes: Any) -> Iterator[APIRoute]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):  # an included router (the hot routes)
            yield from _api_routes(route.original_router.routes)


def test_no_token_checks_nothing(fast_protocol: bool) -> None:
    with app_client(fast_protocol) as client:
        for method, path, body in ADMIN_CALLS[:2] + DECISION_CALLS + READ_CALLS + PROBE_CALLS:
            assert _call(client, method, path, body, {}).status_code != 401, path


def test_the_check_itself() -> None:
    auth = ApiAuth(TOKEN, protect_decisions=True)
    assert auth.allows(f"Bearer {TOKEN}".encode()) and auth.allows(f"bearer {TOKEN}")
    assert not any(auth.allows(h.get("authorization")) for h in WRONG)
    assert auth.guards(Access.ADMIN) and auth.guards(Access.DECISION) and not auth.guards(Access.READ)
    with pytest.raises(Unauthorized):
        auth.require(Access.DECISION, None)
    auth.require(Access.READ, None)  # open
    assert TOKEN not in repr(auth)
    assert HOT_ACCESS["/v1/events"] is Access.ADMIN
    assert {HOT_ACCESS[p] for p in HOT_ACCESS if p != "/v1/events"} == {Access.DECISION}
    open_auth = ApiAuth(None, protect_decisions=True)
    assert open_auth.allows(None) and not open_auth.guards(Access.ADMIN)


def test_token_settings(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text(f"  {TOKEN}\n")
    assert load_settings(flags={"api_token_file": str(file)}).security.token() == TOKEN
    assert load_settings(env={"KV_ROUTER_API_TOKEN": TOKEN}).security.token() == TOKEN
    for flags, says in [
        ({"api_token": TOKEN, "api_token_file": str(file)}, "not both"),
        ({"api_token": "two words"}, "visible ASCII"),
        ({"api_token_file": str(tmp_path / "missing")}, "cannot read"),
        ({"ssl_certfile": str(file)}, "needs both"),
        # Asked for protection without a token (a secret not mounted): it ran open, without a word.
        ({"protect_decisions": True}, "protect_decisions: needs an API token"),
        ({"protect_reads": True}, "protect_reads: needs an API token"),
        ({"protect_probes": True}, "protect_probes: needs an API token"),
    ]:
        with pytest.raises(ConfigError, match=says) as caught:
            load_settings(flags=flags)
        assert TOKEN not in str(caught.value) and "two words" not in str(caught.value)
    flags = {"api_token": TOKEN, "nats_url": "nats://h:4222", "nats_password": "pw-secret", "nats_token": "nt-secret"}
    settings = load_settings(flags=flags)
    for secret in (TOKEN, "pw-secret", "nt-secret"):
        assert secret not in repr(settings)


# ---------------------------------------------------------------------- kv-router's HTTP protocol


def _exchange(port: int, requests: list[bytes]) -> list[bytes]:
    client = Client(port)
    try:
        return [client.ask(r) for r in requests]
    finally:
        client.sock.close()


def test_protocol_path_refuses_like_the_asgi_path_byte_for_byte() -> None:
    tokens = prompt(4, 64)
    requests = [
        post("/v1/events", stored_event(1, tokens)),  # no token
        post("/v1/events", stored_event(1, tokens), authorization="Bearer nope"),
        post("/v1/new", {"tokens": tokens, "request_id": "a"}),  # a decision: guarded with protect_decisions
        post("/v1/mark_free", {"request_id": "a"}, authorization=f"basic {TOKEN}"),
        post("/v1/router", {"method": "potential_loads", "tokens": tokens}),
        post("/v1/workers", {"worker_id": 1}, authorization=f"Bearer {TOKEN}"),
        post("/v1/events", stored_event(1, tokens), authorization=f"Bearer {TOKEN}"),
        post("/v1/router", {"method": "new", "tokens": tokens, "request_id": "b"}, authorization=f"Bearer {TOKEN}"),
        post("/v1/overlap", {"tokens": tokens}),
    ]
    answers = {}
    for fast_protocol in (True, False):
        with uvicorn_on_loopback(fast_protocol=fast_protocol, api_token=TOKEN, protect_decisions=True) as port:
            answers[fast_protocol] = _exchange(port, requests)
    assert answers[True] == answers[False]
    statuses = [a.split(b" ", 2)[1] for a in answers[True]]
    assert statuses == [b"401"] * 5 + [b"201", b"200", b"200", b"401"]
    refused = answers[True][0]
    assert b'www-authenticate: Bearer realm="kv-router"' in refused
    assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["type"] == "unauthorized"
    assert b'"overlap_blocks":4' in answers[True][7]  # the event sent with the token was applied, once


def test_token_never_logged_by_a_real_process(tmp_path: Path) -> None:
    """``kv-router serve`` at debug level with access logs: refusals, a good call, a bad setting and
    ``config show`` never print the token."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    flags = ["--no-embedded-nats", "--log-level", "debug", "--access-log", "--log-format", "json",
             "--api-token-file", str(token_file)]  # fmt: skip
    with RouterProcess(tmp_path, *flags, ready_path="/healthz") as service:
        process = service.process
        assert process is not None
        client = Client(service.port)
        for headers in ({"authorization": "Bearer wrong"}, {"authorization": f"Bearer {TOKEN}"}):
            client.ask(post("/v1/events", stored_event(1, prompt(5, 32)), **headers))
            client.ask(post("/v1/workers", {"worker_id": 5}, **headers))
        client.sock.close()
        process.terminate()
        process.wait(30)
    output = service.log().encode()  # stdout and stderr
    assert b'/v1/events HTTP/1.1\\" 401' in output  # the access log saw the refusals
    assert TOKEN.encode() not in output
    secrets = ["--api-token", TOKEN, "--nats-url", "nats://h:1", "--nats-password", "pw-secret"]
    shown = subprocess.run([*kv_router_command(), "config", "show", *secrets], capture_output=True, text=True,
                           timeout=60, check=True)  # fmt: skip
    assert 'api_token = "***"  # flag --api-token' in shown.stdout
    assert TOKEN not in shown.stdout and "pw-secret" not in shown.stdout
    bad = subprocess.run([*kv_router_command(), "serve", "--api-token", TOKEN + " x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and TOKEN not in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_the_openai_proxy_honours_protect_decisions() -> None:
    settings = Settings(
        router=RouterConfig(block_size=BLOCK_SIZE),
        proxy=ProxyConfig(proxy=True),
        security=SecurityConfig(api_token=TOKEN, protect_decisions=True, protect_reads=True),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
    openai_shape = frozenset({"message", "type", "param", "code"})  # the proxy's refusals are OpenAI's
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for headers in WRONG:
                _assert_unauthorized(client.post(path, json=body, headers=headers), openai_shape)
            # With the token the request reaches the proxy, which answers it itself (a completion body
            # is not a chat body: 400; no worker serves "m": 503).
            assert client.post(path, json=body, headers=GOOD).status_code in (400, 503)
        _assert_unauthorized(client.get("/v1/models"), openai_shape)
        assert client.get("/v1/models", headers=GOOD).status_code == 200


def test_the_openapi_document_lists_the_proxy_s_routes_with_their_schemas() -> None:
    settings = Settings(router=RouterConfig(block_size=BLOCK_SIZE), proxy=ProxyConfig(proxy=True))
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        document = client.get("/openapi.json").json()
    paths = document["paths"]
    assert set(paths["/v1/completions"]) == set(paths["/v1/chat/completions"]) == {"post"}
    assert set(paths["/v1/models"]) == {"get"}
    assert {"/v1/new", "/v1/route", "/v1/workers"} <= set(paths)
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatBody"} and "ChatBody" in document["components"]["schemas"]
