"""The bridge's one-call C path (`indexer._events_native.bridge_batch`) against its Python path.

A stream of engine batches goes through `ZmqEngineStream` into `PublisherSink` twice: once with the
sink's whole-payload C step, once with the stream decoding, checking and applying each batch in
Python. Afterwards everything a router or an operator can see must be equal byte for byte: the NATS
messages the publisher sent (read back from a real nats-server), each rank's numbering and resync ring,
what the publisher holds (its full-dump answer), the stream's and the sink's counters, the hash
check's records and evidence. The batches chain over a small pool of hashes (parents held and not,
removals of held and unknown blocks, the same hash with other tokens), over two ranks and tiers,
with clears, the odd forms of tests/test_events_native.py that C declines, every vector of
shared/vectors, and refused stores in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.event_plane.publisher as publisher_module
from indexer.events import StorageTier, decode_router_events
from router.engines.bridge import PublisherSink
from router.engines.zmq_stream import ZmqEngineStream
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.types import WorkerConfig
from tests.test_events_native import BLOCK, engine_event
from tests.waiting import eventually

pytestmark = pytest.mark.both_paths

# The C path runs whatever KV_ROUTER_NO_NATIVE says: the test switches it on for one of the two runs.
events_native = pytest.importorskip("indexer._events_native", reason="the bridge's C step is not built")
pytest.importorskip("indexer._native", reason="the bridge's C step needs the indexer's accelerator")

WORKER = 9
TAKEN: list[bool] = []  # per batch of the last native run, whether the C path took it
encode = msgspec.msgpack.encode
POOL = st.integers(0, 12)
TOKENS = st.sampled_from([0, 1, 2**17, 2**32 - 1])


@st.composite
def chained_event(draw: st.DrawFn) -> Any:
    """Plain events over a small pool of hashes, so parents are held or not and removals hit or miss."""
    kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "removed", "cleared", "odd"]))
    medium = draw(st.sampled_from(["GPU", "GPU", "GPU", "CPU", None]))
    if kind == "odd":
        return draw(engine_event())
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    hashes = draw(st.lists(POOL, max_size=4, unique=True))
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    parent = draw(st.one_of(st.none(), POOL.filter(lambda value: value not in hashes)))
    tokens = draw(st.lists(TOKENS, min_size=len(hashes) * BLOCK, max_size=len(hashes) * BLOCK))
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


BATCH = st.builds(
    lambda events, rank: encode([1.5, events, rank]),
    st.lists(chained_event(), max_size=5),
    st.sampled_from([0, 0, 1, None]),
)


async def _run(url: str, payloads: list[bytes], *, native: bool) -> tuple[Any, ...]:
    nc = await connect(NatsOptions(url))
    namespace = f"native-{native}"
    received: list[bytes] = []
    taken: list[bool] = []  # per batch, whether the C path took it

    async def on_message(message: Any) -> None:
        received.append(message.data)

    subscription = await nc.subscribe(f"kv.{namespace}.events.{WORKER}", cb=on_message)
    try:
        publisher = KvEventPublisher(nc, WorkerConfig(worker_id=WORKER, block_size=BLOCK), namespace=namespace)
        publisher._encoder.native = native  # the templates C writes into are made on the native path
        sink = PublisherSink(publisher)
        apply_payload = sink.apply_payload

        def counted(*args: Any) -> Any:
            applied = apply_payload(*args) if native else None  # None: the stream's Python path
            taken.append(applied is not None)
            return applied

        sink.apply_payload = counted  # type: ignore[method-assign]
        stream = ZmqEngineStream(sink, "tcp://127.0.0.1:1", block_size=BLOCK, dp_rank=0)
        for seq, payload in enumerate(payloads):
            async with sink.batch():
                await stream.take_live(seq, payload)
        await nc.publish(f"kv.{namespace}.events.{WORKER}", b"end")
        await nc.flush()
        await eventually(lambda: bool(received) and received[-1] == b"end", 30, "the end marker arrives")
        assert received.pop() == b"end"
    finally:
        await subscription.unsubscribe()
        await nc.close()
    TAKEN.extend(taken)
    ranks = {rank: (log.last_event_id, list(log.ring)) for rank, log in publisher._ranks.items()}
    check = stream.hash_check
    return (
        received,
        ranks,
        publisher.dump_events(),
        {key: dict(held) for key, held in publisher._held.tables.items()},
        {key: dict(copies) for key, copies in publisher._held._copies.items()},
        dict(stream.stats),
        dict(sink.stats),
        dict(check.by_content),
        dict(check.by_hash),
        stream.last_hash_mismatch,
        dict(stream.last_rejection),
    )


def _both(url: str, payloads: list[bytes], monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Both runs compared; per batch, whether C took it."""
    monkeypatch.setattr(publisher_module, "EVENTS_NATIVE", True)
    TAKEN.clear()
    fast = asyncio.run(_run(url, payloads, native=True))
    taken = list(TAKEN)
    python = asyncio.run(_run(url, payloads, native=False))
    assert fast == python
    return taken


@pytest.fixture(scope="module")
def server() -> Any:
    with EmbeddedNats() as running:
        yield running


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(BATCH, min_size=1, max_size=12))
def test_the_c_path_publishes_and_holds_what_the_python_path_does(
    payloads: list[bytes], server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    _both(server.url, payloads, monkeypatch)


def _stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


def test_a_refused_store_mid_batch_and_a_contradicted_hash_come_out_alike(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = list(range(BLOCK))
    payloads = [
        encode([1.0, [_stored([1, 2], None, block * 2)], 0]),
        encode([1.0, [_stored([11, 12], None, [5] * 2 * BLOCK)], 0]),  # the templates made: C's
        # a store under a parent never held between two that apply: refused, the rest still sent
        encode([1.0, [_stored([3], 2, block), _stored([5], 99, block), {"type": "BlockRemoved", "block_hashes": [1]}]]),
        # the same engine hash with other tokens, and other hashes for the same tokens under the root
        encode([1.0, [_stored([3], 2, [7] * BLOCK), _stored([8], None, block * 1)], 0]),
    ]
    # The first batch makes the stored template, the third the removed one (Python); C takes the rest.
    assert _both(server.url, payloads, monkeypatch) == [False, True, False, True]
    fast = asyncio.run(_run(server.url, payloads, native=True))
    stats, sink_stats, mismatch = fast[5], fast[6], fast[9]
    assert sink_stats == {"rejected_parent_block_not_found": 1}
    assert stats["tokens_hash_mismatch"] == 2
    assert mismatch is not None and "under the root apart" in mismatch


def test_a_block_stored_twice_is_removed_from_the_routers_with_its_last_copy_on_both_paths(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM stores one prefix twice for two requests computing it at once, and evicts each copy with
    its own removal: routers hear the removal of the last copy only, whichever path takes the batch."""
    block = list(range(BLOCK))
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    payloads = [
        encode([1.0, [_stored([1, 2], None, block * 2)], 0]),
        encode([1.0, [_stored([5], None, [9] * BLOCK), _stored([1, 2], None, block * 2)], 0]),  # C, then a copy
        encode([1.0, [_stored([3], 2, block), removed], 0]),  # a copy of 2 goes: 2 and 3 stay
        encode([1.0, [removed, {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}], 0]),
    ]
    taken = _both(server.url, payloads, monkeypatch)
    assert taken[1] and not taken[2]  # held in copies: the Python path, which counts them
    fast = asyncio.run(_run(server.url, payloads, native=True))
    events = [event for message in fast[0] for event in decode_router_events(message, msgpack=None)]
    removals = [event.event.removed.block_hashes for event in events if event.event.removed is not None]
    assert removals == [[2], [3]]  # the first removal of 2 was a copy's: not heard
    assert set(fast[3][0, StorageTier.DEVICE]) == {1, 5}
    assert fast[4] == {(0, StorageTier.DEVICE): {1: 1}}  # block 1's second copy; 2's both gone


def test_every_vector_goes_through_both_paths_alike(
    shared_dir: Path, server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    vectors = json.loads((shared_dir / "vectors" / "vllm_kv_events.json").read_text())["vectors"]
    payloads = [bytes.fromhex(vector["payload_hex"]) for vector in vectors]
    # Each vector again without its clear (a clear is always Python's), in the same envelope and forms.
    unclear = []
    for payload in payloads:
        envelope = msgspec.msgpack.decode(payload)
        envelope[1] = [
            event
            for event in envelope[1]
            if "AllBlocksCleared" not in (event if isinstance(event, list) else [event.get("type")])
        ]
        unclear.append(encode(envelope))
    taken = _both(server.url, payloads + unclear, monkeypatch)
    # The LoRA vector's salt is Python's; the others run in C once the first round made the templates.
    in_c = [vector["name"] != "vllm_current_map_events_bytes_hashes" for vector in vectors]
    assert taken == [False] * len(payloads) + in_c


def test_state_not_of_the_shape_the_publisher_keeps_is_a_type_error_and_changes_nothing() -> None:
    """What a rank and tier hold not a dict (read with the dict macros: undefined), or a stored
    template whose slots are no 0-2 (an unchecked conversion: a SystemError) is a TypeError, raised
    before anything is held."""
    key = (0, StorageTier.DEVICE)
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * BLOCK,
             "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    payload = encode([1.5, [event], 0])
    removed = {key: (b"a", b"b", b"c")}

    def bridge(held: dict[Any, Any], slots: tuple[Any, ...]) -> Any:
        stored = {key: (b"a", b"b", b"c", b"d", *slots)}
        row = (b"x", b"y", b"z")
        return events_native.bridge_batch(
            payload, BLOCK, 1337, 0, lambda rank: 5, held, stored, removed, row, {}, {}, 9
        )

    with pytest.raises(TypeError, match="what a rank and tier hold is not a dict"):
        bridge({key: ["not", "a dict"]}, (0, 1, 2))
    for slots in [(0, 1, None), (0, 1, 3), (0, -1, 2), (0, 1, 2**70), (0, 1, True)]:
        held: dict[Any, Any] = {}
        with pytest.raises(TypeError, match="an encoder template is not its literals and slots"):
            bridge(held, slots)
        assert held == {}
    held = {}
    rank, applied, events, ignored, _, numbered = bridge(held, (0, 1, 2))
    assert (rank, applied, events, ignored, [number for number, _ in numbered]) == (0, 1, 1, 0, [5])
    assert list(held) == [key]
