"""KV-event wire types, JSON- and msgpack-compatible with NVIDIA Dynamo 1.6.1.

A worker reports ``KvCacheEvent``s; on the wire they travel wrapped in a ``RouterEvent`` that names
the worker and the storage tier::

    {"worker_id": 7, "storage_tier": "device",
     "event": {"event_id": 3, "dp_rank": 0,
               "data": {"stored": {"parent_hash": null,
                                   "blocks": [{"block_hash": 11, "tokens_hash": 12}]}}}}

``data`` is Dynamo's externally tagged enum: ``{"stored": ...}``, ``{"removed": ...}`` or the bare
string ``"cleared"`` (``{"cleared": null}`` is accepted too); its map holds exactly one key, as serde's
does (a second one, null included, or an unknown one is refused). Hashes are u64; engines that send
signed i64 hashes are reinterpreted bitwise. Unknown fields of the structs are ignored.

The structs hold no reference cycles, so they opt out of the cyclic GC (``gc=False``): decoding an
event allocates one object per block, and untracked objects are markedly cheaper to create.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from indexer.errors import UNDECODABLE, EventDecodeError
from indexer.native import ENABLED as NATIVE
from indexer.native import accel, declined

__all__ = [
    "BlockMmInfo",
    "KvCacheEvent",
    "KvCacheEventData",
    "KvRemovedData",
    "KvStoredData",
    "MmObject",
    "RemovedEventEncoder",
    "ResyncBatch",
    "ResyncRequest",
    "ResyncResponse",
    "ResyncTooNew",
    "RouterEvent",
    "StorageTier",
    "StoredBlock",
    "StoredEventEncoder",
    "as_u64",
    "cleared_event",
    "decode_router_events",
    "encode_router_events",
    "join_encoded_events",
    "looks_like_msgpack",
    "removed_event",
    "stored_event",
]

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
_I64_MIN = -(1 << 63)

# msgspec cannot bound integers above i64, so the u64 ceiling is checked in `__post_init__`.
U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# A hash as engines send it: u64, or i64 to be reinterpreted as u64 (see `as_u64`).
WireHash = Annotated[int, msgspec.Meta(ge=_I64_MIN)]


def as_u64(value: int, what: str) -> int:
    """``value`` as u64: negative i64 values are reinterpreted bitwise, others outside u64 rejected."""
    if value > U64_MAX or value < _I64_MIN:
        raise ValueError(f"{what} {value} does not fit in u64")
    return value + (1 << 64) if value < 0 else value


def _check_u64(value: int, what: str) -> None:
    if value > U64_MAX:
        raise ValueError(f"{what} {value} does not fit in u64")


class StorageTier(StrEnum):
    """Where a worker holds a block; lower tiers give partial credit when routing."""

    DEVICE = "device"
    HOST_PINNED = "host_pinned"
    DISK = "disk"
    EXTERNAL = "external"


LOWER_TIERS: tuple[StorageTier, ...] = (StorageTier.HOST_PINNED, StorageTier.DISK, StorageTier.EXTERNAL)


class MmObject(msgspec.Struct, gc=False):
    """One multimodal object of a block; only ``mm_hash`` enters the block hash. ``offsets`` (Dynamo's
    ``Vec<(usize, usize)>``, required there) are its placeholder ranges within the block."""

    mm_hash: U64
    offsets: list[tuple[NonNegative, NonNegative]]

    def __post_init__(self) -> None:
        _check_u64(self.mm_hash, "mm_hash")


class BlockMmInfo(msgspec.Struct, gc=False):
    mm_objects: list[MmObject]


class StoredBlock(msgspec.Struct, gc=False):
    """A stored block: the engine's opaque ``block_hash`` and Dynamo's local ``tokens_hash``."""

    block_hash: WireHash
    tokens_hash: WireHash
    mm_extra_info: BlockMmInfo | None = None


class KvStoredData(msgspec.Struct, gc=False):
    """Blocks stored as a chain under ``parent_hash`` (``None``: under the root)."""

    blocks: list[StoredBlock]
    parent_hash: WireHash | None = None
    start_position: U32 | None = None

    def __post_init__(self) -> None:
        # `h >> 64` is non-zero exactly for negative and oversized values: one cheap test per hash.
        if self.parent_hash is not None and self.parent_hash >> 64:
            self.parent_hash = as_u64(self.parent_hash, "parent_hash")
        if NATIVE and not accel.has_wide_hash(self.blocks):
            return  # the common case, tested in one C call
        for block in self.blocks:
            if block.block_hash >> 64 or block.tokens_hash >> 64:
                block.block_hash = as_u64(block.block_hash, "block_hash")
                block.tokens_hash = as_u64(block.tokens_hash, "tokens_hash")


class KvRemovedData(msgspec.Struct, gc=False):
    block_hashes: list[WireHash]

    def __post_init__(self) -> None:
        hashes = self.block_hashes
        # Two C-level scans instead of one Python test per hash: removals are half of all blocks.
        if hashes and (min(hashes) < 0 or max(hashes) > U64_MAX):
            self.block_hashes = [as_u64(h, "block_hash") for h in hashes]


class KvCacheEventData(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """The tagged map form of an event's data: exactly one of the three keys is present, as in Dynamo's
    externally tagged enum (an absent kind is ``UNSET``: ``"removed": null`` beside ``"stored"`` is a
    second key, refused; read the kinds through `KvCacheEvent.stored` / ``removed``, None when absent)."""

    stored: KvStoredData | msgspec.UnsetType = msgspec.UNSET
    removed: KvRemovedData | msgspec.UnsetType = msgspec.UNSET
    cleared: msgspec.UnsetType | None = msgspec.UNSET

    def __post_init__(self) -> None:
        unset = msgspec.UNSET
        present = (self.stored is not unset) + (self.removed is not unset) + (self.cleared is not unset)
        if present != 1:
            raise ValueError("event data must hold exactly one of 'stored', 'removed' or 'cleared'")


class KvCacheEvent(msgspec.Struct, gc=False):
    """One event of one (worker, dp_rank) stream; ``event_id`` numbers that stream from 1."""

    event_id: U64
    data: Literal["cleared"] | KvCacheEventData
    dp_rank: U32 = 0

    def __post_init__(self) -> None:
        if self.event_id >> 64:  # ge=0 is checked by msgspec; this catches values past u64
            _check_u64(self.event_id, "event_id")
        # One canonical form for "cleared", so consumers test a single thing and re-encoding
        # always produces Dynamo's bare string.
        if not isinstance(self.data, str) and self.data.cleared is not msgspec.UNSET:
            self.data = "cleared"

    @property
    def stored(self) -> KvStoredData | None:
        data = self.data
        return None if isinstance(data, str) or data.stored is msgspec.UNSET else data.stored

    @property
    def removed(self) -> KvRemovedData | None:
        data = self.data
        return None if isinstance(data, str) or data.removed is msgspec.UNSET else data.removed

    @property
    def is_cleared(self) -> bool:
        return isinstance(self.data, str)


class RouterEvent(msgspec.Struct, gc=False):
    """A worker's event as it travels to the router."""

    worker_id: U64
    event: KvCacheEvent
    storage_tier: StorageTier = StorageTier.DEVICE

    def __post_init__(self) -> None:
        if self.worker_id >> 64:
            _check_u64(self.worker_id, "worker_id")


def stored_event(
    event_id: int,
    blocks: Iterable[tuple[int, int]],
    *,
    parent_hash: int | None = None,
    dp_rank: int = 0,
) -> KvCacheEvent:
    """A ``stored`` event from ``(block_hash, tokens_hash)`` pairs."""
    stored = KvStoredData(blocks=[StoredBlock(b, t) for b, t in blocks], parent_hash=parent_hash)
    return KvCacheEvent(event_id=event_id, data=KvCacheEventData(stored=stored), dp_rank=dp_rank)


def removed_event(event_id: int, block_hashes: Iterable[int], *, dp_rank: int = 0) -> KvCacheEvent:
    removed = KvRemovedData(block_hashes=list(block_hashes))
    return KvCacheEvent(event_id=event_id, data=KvCacheEventData(removed=removed), dp_rank=dp_rank)


def cleared_event(event_id: int, *, dp_rank: int = 0) -> KvCacheEvent:
    return KvCacheEvent(event_id=event_id, data="cleared", dp_rank=dp_rank)


_OneOrMany = RouterEvent | list[RouterEvent]
_json_decoder = msgspec.json.Decoder(_OneOrMany)
# What the C decoder of the common JSON form builds: an instance of each wire struct (it copies them
# and sets every field), then the values it shares.
_TEMPLATE_STORED = KvStoredData(blocks=[])
_NATIVE_WIRE_TEMPLATES = (
    RouterEvent(0, KvCacheEvent(0, "cleared")),
    KvCacheEvent(0, "cleared"),
    KvCacheEventData(stored=_TEMPLATE_STORED),
    _TEMPLATE_STORED,
    KvRemovedData(block_hashes=[]),
    StoredBlock(0, 0),
    StorageTier.DEVICE,
    msgspec.UNSET,
    "cleared",
)
# False too when a struct's fields are not the ones the C decoder sets.
_NATIVE_JSON = NATIVE and accel.bind_event_types(*_NATIVE_WIRE_TEMPLATES)
_msgpack_decoder = msgspec.msgpack.Decoder(_OneOrMany)
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def looks_like_msgpack(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a payload of objects is msgpack rather than JSON (which starts with '{', '[' or a space)."""
    for byte in bytes(payload[:16]):
        if byte not in b" \t\r\n":
            return byte not in b"{["
    return False


def decode_router_events(payload: bytes | bytearray | memoryview, *, msgpack: bool | None = False) -> list[RouterEvent]:
    """Decode one ``RouterEvent`` or a list of them from JSON or msgpack bytes (``None``: detect)."""
    if msgpack is None:
        msgpack = looks_like_msgpack(payload)
    if _NATIVE_JSON and not msgpack:
        events = accel.router_events_json(payload)
        if events is not None:
            return events
        declined("indexer._native", "json_event_form")
    decoder = _msgpack_decoder if msgpack else _json_decoder
    try:
        decoded = decoder.decode(payload)
    except UNDECODABLE as exc:
        kind = "msgpack" if msgpack else "JSON"
        raise EventDecodeError(f"invalid RouterEvent {kind}: {exc}") from None
    return decoded if isinstance(decoded, list) else [decoded]


def encode_router_events(events: RouterEvent | list[RouterEvent], *, msgpack: bool = False) -> bytes:
    return (_msgpack_encoder if msgpack else _json_encoder).encode(events)


def join_encoded_events(encoded: list[bytes], *, msgpack: bool = False) -> bytes:
    """One payload from events encoded one by one: the event itself, or the list of them."""
    if len(encoded) == 1:
        return encoded[0]
    if not msgpack:
        return b"[" + b",".join(encoded) + b"]"
    count = len(encoded)
    if count < 16:
        head = bytes((0x90 | count,))
    elif count <= 0xFFFF:
        head = b"\xdc" + count.to_bytes(2, "big")
    else:
        head = b"\xdd" + count.to_bytes(4, "big")
    return head + b"".join(encoded)


# The literal bytes around a stored event's three slots, and which of (event id, parent hash, blocks)
# fills each slot in turn.
_Template = tuple[bytes, bytes, bytes, bytes, int, int, int]
_SLOTS = ("event_id", "parent_hash", "blocks")


class StoredEventEncoder:
    """Stored events of one worker as msgpack bytes, byte for byte what msgspec writes for the
    ``RouterEvent``, without one ``StoredBlock`` object per block: the C accelerator writes the blocks
    array into a template taken from msgspec's own encoding of a probe event, per (dp rank, tier).
    Without the accelerator (or with a hash outside u64) the ``RouterEvent`` is built and encoded."""

    def __init__(self, worker_id: int, *, native: bool = NATIVE) -> None:
        self.worker_id = worker_id
        self.native = native
        # Read by `indexer._events_native.bridge_batch` too, which writes the same bytes in C.
        self.templates: dict[tuple[int, StorageTier], _Template] = {}
        # Probe values msgspec writes in 9 bytes, none of them the worker id: each is found once.
        self._event_mark, self._parent_mark, block_mark, tokens_mark = [
            value for value in range(U64_MAX, U64_MAX - 5, -1) if value != worker_id
        ][:4]
        row = _msgpack_encoder.encode(StoredBlock(block_mark, tokens_mark))
        before, rest = row.split(_msgpack_encoder.encode(block_mark))
        between, after = rest.split(_msgpack_encoder.encode(tokens_mark))
        self.row = (before, between, after)
        self._probe_blocks = [(block_mark, tokens_mark)]
        self._one_block = b"\x91" + row

    def encode(
        self,
        event_id: int,
        dp_rank: int,
        tier: StorageTier,
        parent_hash: int | None,
        block_hashes: list[int],
        tokens_hashes: list[int],
    ) -> bytes:
        rows = None
        if self.native and (parent_hash is None or not parent_hash >> 64) and not event_id >> 64:
            rows = accel.msgpack_rows(block_hashes, tokens_hashes, *self.row)
            if rows is None:
                declined("indexer._native", "wide_hash")
        if rows is None:
            blocks = zip(block_hashes, tokens_hashes, strict=True)
            event = stored_event(event_id, blocks, parent_hash=parent_hash, dp_rank=dp_rank)
            return _msgpack_encoder.encode(RouterEvent(self.worker_id, event, tier))
        template = self.templates.get((dp_rank, tier))
        if template is None:
            template = self.templates[dp_rank, tier] = self._template(dp_rank, tier)
        encode = _msgpack_encoder.encode
        slots = (encode(event_id), encode(parent_hash), rows)
        head, middle, rest, tail, first, second, third = template
        return b"".join((head, slots[first], middle, slots[second], rest, slots[third], tail))

    def _template(self, dp_rank: int, tier: StorageTier) -> _Template:
        """Literal bytes and named slots (four and three), in the order msgspec writes the probe event."""
        probe = RouterEvent(
            self.worker_id,
            stored_event(self._event_mark, self._probe_blocks, parent_hash=self._parent_mark, dp_rank=dp_rank),
            tier,
        )
        data = _msgpack_encoder.encode(probe)
        marks = {
            "event_id": _msgpack_encoder.encode(self._event_mark),
            "parent_hash": _msgpack_encoder.encode(self._parent_mark),
            "blocks": self._one_block,
        }
        (head, middle, rest, tail), (first, second, third) = _split_at_marks(data, marks)
        return head, middle, rest, tail, _SLOTS.index(first), _SLOTS.index(second), _SLOTS.index(third)


class RemovedEventEncoder:
    """Removed events of one worker as msgpack bytes, byte for byte what msgspec writes for the
    ``RouterEvent``, without its four structs: the event id and the hashes (msgspec encodes a list of
    ints in one C call) go into a template taken from a probe event, per (dp rank, tier). The hashes
    must be u64 already (the publisher reinterprets i64 ones first); an event id past u64 takes the
    struct path, which refuses it."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        # Read by `indexer._events_native.bridge_batch` too, which writes the same bytes in C.
        self.templates: dict[tuple[int, StorageTier], list[bytes]] = {}
        marks = [value for value in range(U64_MAX, U64_MAX - 3, -1) if value != worker_id]
        self._event_mark, self._hash_mark = marks[0], marks[1]

    def encode(self, event_id: int, dp_rank: int, tier: StorageTier, block_hashes: list[int]) -> bytes:
        if event_id >> 64:
            event = removed_event(event_id, block_hashes, dp_rank=dp_rank)
            return _msgpack_encoder.encode(RouterEvent(self.worker_id, event, tier))
        template = self.templates.get((dp_rank, tier))
        if template is None:
            template = self.templates[dp_rank, tier] = self._template(dp_rank, tier)
        head, middle, tail = template
        encode = _msgpack_encoder.encode
        return b"".join((head, encode(event_id), middle, encode(block_hashes), tail))

    def _template(self, dp_rank: int, tier: StorageTier) -> list[bytes]:
        event = removed_event(self._event_mark, [self._hash_mark], dp_rank=dp_rank)
        marks = {
            "event_id": _msgpack_encoder.encode(self._event_mark),
            "block_hashes": _msgpack_encoder.encode([self._hash_mark]),
        }
        literals, names = _split_at_marks(_msgpack_encoder.encode(RouterEvent(self.worker_id, event, tier)), marks)
        assert names == ["event_id", "block_hashes"], "msgspec writes the event id before the event's data"
        return literals


def _split_at_marks(data: bytes, marks: dict[str, bytes]) -> tuple[list[bytes], list[str]]:
    """``data`` cut at each mark (each found exactly once): the literal bytes around them, and the marks'
    names in the order they appear."""
    assert all(data.count(mark) == 1 for mark in marks.values()), "a probe value is not unique in the event"
    literals, names = [], []
    end = 0
    for start, name, length in sorted((data.index(mark), name, len(mark)) for name, mark in marks.items()):
        literals.append(data[end:start])
        names.append(name)
        end = start + length
    literals.append(data[end:])
    return literals, names


# ---------------------------------------------------------------------- resync (request/reply)
# A router asks a worker for the events of one rank it missed, or a full dump: Dynamo's
# ``WorkerKvQueryRequest`` / ``WorkerKvQueryResponse`` (externally tagged) plus the dp rank.


class ResyncRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Ask a worker for events ``start_event_id..end_event_id`` of one rank; no start = full dump.
    ``in_parts`` (ours): the asker reads several replies, so one too large for a message may come in
    parts (`ResyncBatch.more`); an asker that reads one would take the first part for the whole."""

    worker_id: U64
    dp_rank: U32 = 0
    start_event_id: U64 | None = None
    end_event_id: U64 | None = None
    in_parts: bool = False


class ResyncBatch(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """``more`` (ours): a part of a reply sent in parts; the next part follows (the last has none)."""

    events: list[RouterEvent]
    last_event_id: NonNegative
    more: bool = False


class ResyncTooNew(msgspec.Struct, kw_only=True, frozen=True):
    requested_start: NonNegative
    requested_end: NonNegative | None
    newest_available: NonNegative


class ResyncResponse(
    msgspec.Struct,
    kw_only=True,
    frozen=True,
    omit_defaults=True,
    rename={"events": "Events", "tree_dump": "TreeDump", "too_new": "TooNew", "error": "Error"},
):
    """Exactly one of: the missing events, a full dump replacing the rank's state, or why not."""

    events: ResyncBatch | None = None
    tree_dump: ResyncBatch | None = None
    too_new: ResyncTooNew | None = None
    error: str | None = None
