"""The proxy tells the router how far each request's output has got (``router_track_output_blocks``),
from the stream it forwards and the usage of a whole answer, with the real `openai` client and mock
workers; whatever way a request ends, nothing of it stays booked."""

from __future__ import annotations

import asyncio
import contextlib
import math

import httpx
import msgspec
import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BLOCK = 64
PROMPT = list(range(1, 2 * BLOCK + 1))  # two full blocks
OTHER = list(range(50_000, 50_000 + BLOCK))  # a prompt nobody holds, to read the loads with
TRACKED = {"router_track_output_blocks": True}


def output_blocks(generated: int) -> int:
    """Blocks the output of ``generated`` tokens opens after `PROMPT` (a block per started 64 tokens)."""
    return math.ceil(generated / BLOCK)


async def potential_decode_blocks(url: str) -> int:
    """``/v1/potential_loads`` for `OTHER`, less `OTHER`'s own block, summed over the ranks: what is booked."""
    async with httpx.AsyncClient(base_url=url) as http:
        loads = (await http.post("/v1/potential_loads", json={"tokens": OTHER})).json()["loads"]
    return sum(int(load["potential_decode_blocks"]) - 1 for load in loads)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_streams_output_moves_its_booking_and_a_disconnect_leaves_nothing(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    service = {"fast_protocol": fast_protocol}
    async with fleet(nats_server.url, (1,), router=TRACKED, service=service) as f:
        assert await potential_decode_blocks(f.url) == 0
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=5000, stream=True
        )
        request_id = raw.headers["x-request-id"]
        received = 0
        async for _chunk in raw.parse():
            received += 1
            if received == 3 * BLOCK + 5:
                break
        # Read in one step of the loop: the proxy has told the router at least what the client got, less
        # the quarter block it may be behind, and at most what the engine has generated.
        [load] = f.router.rank_loads()
        [engine_stream] = f.workers[1]._streams.values()
        assert f.router.booking(request_id) is not None
        recorded = load.active_decode_blocks - 2  # less the prompt's two blocks
        assert output_blocks(received - BLOCK // 4) <= recorded <= output_blocks(engine_stream.tokens)
        assert recorded >= 3  # 181 tokens and more: three output blocks at least
        # The same seen through the decision API, as an operator would.
        assert await potential_decode_blocks(f.url) >= 2 + output_blocks(received - BLOCK // 4)
        await raw.parse().close()
        await eventually(lambda: idle(f.router))
        assert await potential_decode_blocks(f.url) == 0


async def test_an_expected_output_length_decays_the_booking_as_the_stream_reaches_it(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, (1,), router=TRACKED) as f:
        # Dynamo's hint: 64 output tokens expected. Past them the request's exclusive blocks weigh nothing.
        hints = {"nvext": {"agent_hints": {"osl": BLOCK}}}
        stream = await f.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5000, stream=True, extra_body=hints
        )
        received = 0
        async for _chunk in stream:
            received += 1
            # The proxy tells the router every quarter block (16 events), so by 96 received it has told
            # at least 81: past the expected 64, whatever the pieces the events came in.
            if received == BLOCK + BLOCK // 2:
                break
        [load] = f.router.rank_loads()
        assert load.active_requests == 1 and load.active_decode_blocks == 0
        await stream.close()
        await eventually(lambda: idle(f.router))


async def test_a_whole_answers_usage_and_many_streams_leave_no_load_behind_and_are_timed(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, router=TRACKED) as f:
        whole = await f.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=70)
        assert whole.usage is not None and whole.usage.completion_tokens == 70
        assert idle(f.router)

        async def one(i: int) -> str:
            stream = await f.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"{i % 3} " * 100}],
                max_tokens=150,
                stream=True,
                stream_options={"include_usage": True},
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), 60)
        assert all(text.endswith(" w150") for text in texts)
        assert idle(f.router)
        assert await potential_decode_blocks(f.url) == 0
        # The proxy's own share of each streamed request's time to first token (the whole answer has none).
        async with httpx.AsyncClient(base_url=f.url) as http:
            text = (await http.get("/metrics")).text
        assert sample(text, "kv_router_proxy_added_seconds_count") == 12
        added = sample(text, "kv_router_proxy_added_seconds_sum")
        assert added is not None and added > 0


def dying_worker(events: int, die: asyncio.Event) -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that streams ``events`` token events, then drops the connection once ``die`` is set."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + b"".join(sse_chunk(f" w{index}") for index in range(events)))
        await writer.drain()
        await die.wait()
        writer.close()

    return raw_worker(serve)


async def test_a_stream_failing_after_its_output_was_recorded_frees_the_booking(nats_server: EmbeddedNats) -> None:
    die = asyncio.Event()
    async with fleet(nats_server.url, (), router=TRACKED) as f, dying_worker(3 * BLOCK, die) as url:
        dying = WorkerConfig(worker_id=5, block_size=BLOCK, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(dying))).status_code == 201
        stream = await f.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, stream=True)
        received = 0
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            async for _chunk in stream:
                received += 1
                if received == 3 * BLOCK:
                    [load] = f.router.rank_loads()
                    assert load.active_decode_blocks == 2 + 3  # the prompt's blocks and the output's
                    die.set()
        assert received == 3 * BLOCK
        assert idle(f.router)
        async with httpx.AsyncClient(base_url=f.url) as http:
            [load] = (await http.post("/v1/potential_loads", json={"tokens": OTHER})).json()["loads"]
        assert load["potential_decode_blocks"] == 1 and load["active_requests"] == 0
