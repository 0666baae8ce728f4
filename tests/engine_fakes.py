"""A fake vLLM engine for the ZMQ tests: random KV activity as vLLM encodes it, and the truth it implies.

`FakeEngine` publishes through the real `VllmZmqPublisher` (PUB + replay ROUTER on loopback) and
keeps, beside it, the index that the events it produced since its last start imply: what a router
that heard every one of them must hold. The set-ups the engine tests share live here too: loopback
endpoints, `direct_mode` (a fake engine heard by a router's `DirectEngine`), and `SideLoop` (an
event loop in a thread, where engines and bridges live as separate processes would).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec
import uvicorn

from indexer.engine_events import (
    EngineCleared,
    EngineEvent,
    EngineOffloaded,
    EngineRemoved,
    EngineStored,
    decode_engine_batch,
    event_tier,
    resolve_offloaded,
    to_kv_event,
)
from indexer.errors import KvIndexError
from indexer.events import RouterEvent, StorageTier
from indexer.radix_tree import RadixTree
from mocker.zmq_engine import VllmZmqPublisher
from router.engines.direct import DirectEngine
from router.event_plane.embedded_server import free_port
from router.kv_router import KvRouter
from tests.waiting import eventually

BLOCK = 4
T = TypeVar("T")
# vLLM 0.32.0's (CPU build) cache config on its /metrics, as the real-engine lane's engines serve it
# (--block-size 32 --num-gpu-blocks-override 160), captured 2026-12-04.
VLLM_CACHE_CONFIG_INFO = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",cache_hit_alig'
    'nment_tokens="None",effective_attention_block_size="32",enable_mamba_shared_prefix_checkpoint="False'
    '",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_at'
    'tention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency'
    '="2.5",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="5120",kv_offloading_backend="native"'
    ',kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype'
    '="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cp'
    'u_blocks="None",num_gpu_blocks="160",num_gpu_blocks_override="160",prefix_cache_retention_interval="'
    '0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_si'
    'ze_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_repl'
    'ayssm="False",user_specified_block_size="True"} 1.0'
)

encode = msgspec.msgpack.encode


def offloaded_batch(device_hashes: list[int], tokens: list[int], offloaded_hashes: list[int]) -> bytes:
    """One vLLM batch: a device store of ``device_hashes`` over ``tokens``, then the token-less CPU store
    of ``offloaded_hashes`` its OffloadingConnector publishes (block size 0, no parent)."""
    device = {
        "type": "BlockStored", "block_hashes": device_hashes, "parent_block_hash": None, "token_ids": tokens,
        "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
    }  # fmt: skip
    offload = {
        "type": "BlockStored", "block_hashes": offloaded_hashes, "parent_block_hash": None, "token_ids": [],
        "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None,
    }  # fmt: skip
    return encode([1.0, [device, offload], 0])


def canonical(events: list[RouterEvent]) -> list[tuple[int, int, str, int | None, int, int]]:
    """Dump events as a sorted list of (worker, dp_rank, tier, parent, block_hash, tokens_hash) edges."""
    edges = []
    for routed in events:
        stored = routed.event.stored
        assert stored is not None
        parent = stored.parent_hash
        for block in stored.blocks:
            edges.append(
                (routed.worker_id, routed.event.dp_rank, str(routed.storage_tier), parent, block.block_hash,
                 block.tokens_hash)
            )  # fmt: skip
            parent = block.block_hash
    return sorted(edges, key=repr)


def _mirror_device(device: dict[int, tuple[int | None, int]], event: EngineEvent) -> None:
    """Keep ``device`` (block hash -> parent hash, tokens hash) as the engine's device tier after ``event``."""
    if isinstance(event, EngineCleared):
        device.clear()
    elif isinstance(event, EngineStored) and event.tier is StorageTier.DEVICE:
        parent = event.parent_hash
        for block_hash, tokens_hash in zip(event.block_hashes, event.tokens_hashes, strict=True):
            device[block_hash] = (parent, tokens_hash)
            parent = block_hash
    elif isinstance(event, EngineRemoved) and event.tier is StorageTier.DEVICE:
        for block_hash in event.block_hashes:
            device.pop(block_hash, None)


class FakeEngine:
    def __init__(self, worker_id: int, endpoint: str, replay_endpoint: str | None, *, seed: int = 0,
                 dp_rank: int = 0, topic_in_replay: bool = True, array_form: bool = False) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.array_form = array_form
        self.publisher = VllmZmqPublisher(endpoint, replay_endpoint=replay_endpoint, topic="kv@fake@model",
                                          topic_in_replay=topic_in_replay)  # fmt: skip
        self.rng = random.Random(seed)
        self.truth = RadixTree()
        # Per rank, the device blocks the engine holds: block hash -> (parent hash, tokens hash).
        self._truth_device: dict[int, dict[int, tuple[int | None, int]]] = {}
        self._event_id = 0
        self._held: list[int] = []  # block hashes, leaves last
        self._children: dict[int, int] = {}

    async def start(self) -> None:
        await self.publisher.start()

    async def stop(self) -> None:
        await self.publisher.stop()

    def restart(self) -> None:
        """A new engine process: empty cache; the next batch is seq 0 again."""
        self.truth = RadixTree()
        self._truth_device.clear()
        self._held.clear()
        self._children.clear()
        self.publisher.next_seq = 0
        self.publisher.forget_before(1 << 64)

    def _apply_truth(self, payload: bytes) -> None:
        batch = decode_engine_batch(payload, BLOCK)
        rank = self.dp_rank if batch.dp_rank is None else batch.dp_rank
        for decoded in batch.events:
            # An offload names blocks held on the device: the router resolves it the same way.
            device = self._truth_device.setdefault(rank, {})
            if isinstance(decoded, EngineOffloaded):
                events = resolve_offloaded(decoded, device.get)[0]
            else:
                events = [decoded]
                _mirror_device(device, decoded)
            for event in events:
                self._event_id += 1
                with contextlib.suppress(KvIndexError):  # the router refuses the same event the same way
                    self.truth.apply_router_event(
                        RouterEvent(self.worker_id, to_kv_event(event, self._event_id, rank), event_tier(event))
                    )

    def _hash(self) -> int | bytes:
        if self.rng.random() < 0.2:
            return self.rng.randbytes(32)  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
        return self.rng.getrandbits(64)

    def random_events(self) -> list[Any]:
        events: list[Any] = []
        for _ in range(self.rng.randint(1, 3)):
            leaves = [h for h in self._held if self._children.get(h, 0) == 0]
            if leaves and self.rng.random() < 0.3:
                victim = self.rng.choice(leaves)
                self._held.remove(victim)
                events.append(self._removed([victim]))
                continue
            parent = self.rng.choice(self._held) if self._held and self.rng.random() < 0.7 else None
            wire = [self._hash() for _ in range(self.rng.randint(1, 4))]
            events.append(self._stored(parent, wire))
        return events

    def _fold(self, value: int | bytes) -> int:
        return value if isinstance(value, int) else int.from_bytes(value[-8:], "big")

    def _stored(self, parent: int | None, wire: list[int | bytes]) -> Any:
        folded = [self._fold(h) for h in wire]
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        for upper in folded[:-1]:
            self._children[upper] = self._children.get(upper, 0) + 1
        self._held.extend(folded)
        tokens = [self.rng.randrange(1 << 32) for _ in range(BLOCK * len(wire))]
        if self.array_form:
            return ["BlockStored", wire, parent, tokens, BLOCK, None, "GPU", None, None, 0, "full_attention", None]
        return {"type": "BlockStored", "block_hashes": wire, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip

    def _removed(self, hashes: list[int]) -> Any:
        for block_hash in hashes:
            self._children.pop(block_hash, None)
        # A parent keeps its child count: it is never picked as a leaf again, which only narrows the choice.
        if self.array_form:
            return ["BlockRemoved", hashes, "GPU", 0]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

    def cleared(self) -> Any:
        self._held.clear()
        self._children.clear()
        return ["AllBlocksCleared"] if self.array_form else {"type": "AllBlocksCleared"}

    async def send(self, events: list[Any], *, publish: bool = True) -> int:
        payload = encode([1700000000.5, events, self.dp_rank])
        self._apply_truth(payload)
        return await self.publisher.send(payload, publish=publish)

    async def send_raw(self, payload: bytes, *, publish: bool = True) -> int:
        """Exact bytes (a vector, or garbage); the truth follows whatever of it decodes."""
        with contextlib.suppress(ValueError):
            self._apply_truth(payload)
        return await self.publisher.send(payload, publish=publish)

    async def step(self, *, publish: bool = True) -> int:
        return await self.send(self.random_events(), publish=publish)

    def dump(self) -> list[tuple[int, int, str, int | None, int, int]]:
        return canonical(self.truth.dump_events())


def loopback_endpoints(replay: bool) -> tuple[str, str | None]:
    """A PUB endpoint and, with ``replay``, a replay endpoint, on free loopback ports."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return endpoint, (f"tcp://127.0.0.1:{free_port()}" if replay else None)


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free now (a dp engine's layout)."""
    while True:
        first = free_port()
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()


def engine_spec(worker_id: int, endpoint: str, replay: str | None) -> str:
    """The ``--engine-zmq`` value of one engine."""
    return f"{worker_id}={endpoint}" + (f",replay={replay}" if replay else "")


@contextlib.asynccontextmanager
async def direct_mode(
    router: KvRouter, worker_id: int, *, replay: bool = True, seed: int = 0, history: int = 0, **engine: Any
) -> AsyncIterator[tuple[FakeEngine, DirectEngine]]:
    """A fake engine on loopback and ``router`` hearing it in direct mode; both stopped on the way out.
    The engine publishes ``history`` batches before the router subscribes (a router that joins late)."""
    endpoint, replay_endpoint = loopback_endpoints(replay)
    fake = FakeEngine(worker_id, endpoint, replay_endpoint, seed=seed, **engine)
    await fake.start()
    try:
        for _ in range(history):
            await fake.step()
        direct = DirectEngine(router, engine_spec(worker_id, endpoint, replay_endpoint))
        await direct.start()
        try:
            yield fake, direct
        finally:
            await direct.stop()
    finally:
        await fake.stop()


class SideLoop:
    """An event loop in a thread, where the engine and the bridge live, as separate processes would."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class EngineHttp:
    """An engine's OpenAI server as the router probes it (``/health``, ``/v1/models``, ``/metrics``) and the proxy
    uses it (``/v1/completions``: ``completion_text``, whatever the prompt, whole or, asked for a stream, as
    one event), served by a real uvicorn on a loopback port; ``healthy`` switches its health answer
    (``failing_checks``: that many 503s first, then as ``healthy`` says; ``health_delay_s``: each answered
    that late, a loaded engine's server), ``stop`` stops it (refused);
    ``asked`` counts the requests by path. Its ``/metrics`` are vLLM's: ``running`` requests, ``kv_usage``
    and, with ``kv_blocks``, the cache config stating them."""

    def __init__(
        self,
        models: tuple[str, ...] = ("tiny-model",),
        port: int | None = None,
        *,
        kv_blocks: int | None = None,
        kv_usage: float = 0.0,
        running: int = 0,
    ) -> None:
        self.models = models
        self.port = port or free_port()
        self.healthy = True
        self.failing_checks = 0
        self.health_delay_s = 0.0
        self.kv_blocks = kv_blocks
        self.kv_usage = kv_usage
        self.running = running
        self.completion_text = " w1"
        self.asked: Counter[str] = Counter()
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.asked[path] += 1
        status, body = 404, b"{}"
        if path == "/health":
            await asyncio.sleep(self.health_delay_s)
            failing = self.failing_checks > 0
            if failing:
                self.failing_checks -= 1
            status, body = (200, b"") if self.healthy and not failing else (503, b"")
        elif path == "/metrics":
            status, body = (200, self.metrics().encode()) if self.healthy else (503, b"")
        elif path == "/v1/models":
            status, body = 200, msgspec.json.encode({"object": "list", "data": [{"id": m} for m in self.models]})
        elif path == "/v1/completions":
            request = b""
            while True:
                message = await receive()
                request += message.get("body", b"")
                if not message.get("more_body"):
                    break
            choice = {"index": 0, "text": self.completion_text, "finish_reason": "length", "logprobs": None}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            body = msgspec.json.encode(
                {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": self.models[0],
                 "choices": [choice], "usage": usage}
            )  # fmt: skip
            if msgspec.json.decode(request).get("stream"):
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"data: %b\n\n" % body, "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
            status = 200
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def metrics(self) -> str:
        """What vLLM 0.32 serves on ``/metrics``, abridged (its cache config line as the lane's engines print it)."""
        lines = [
            f'vllm:num_requests_running{{engine="0",model_name="{self.models[0]}"}} {self.running}.0',
            f'vllm:num_requests_waiting{{engine="0",model_name="{self.models[0]}"}} 0.0',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.models[0]}"}} {self.kv_usage}',
        ]
        if self.kv_blocks is not None:
            lines.append(VLLM_CACHE_CONFIG_INFO.replace('num_gpu_blocks="160"', f'num_gpu_blocks="{self.kv_blocks}"'))
        return "\n".join(lines) + "\n"

    async def start(self) -> EngineHttp:
        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve())
        server, serving = self._server, self._serving
        await eventually(lambda: server.started or serving.done(), 20, "the engine's HTTP server starts")
        assert not serving.done(), "the engine's HTTP server did not start"
        return self

    async def stop(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = self._serving = None
