# Types of the C accelerator built from indexer/_native.c (see indexer/native.py).
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Buffer

class Node:
    """The C twin of `indexer.radix_tree._Node`."""

    def __init__(
        self, block_hash: int, local_hash: int, parent: Node | None, owners: int, children: object = None
    ) -> None: ...
    @property
    def block_hash(self) -> int: ...
    @property
    def local_hash(self) -> int: ...
    parent: Node | None
    owners: int
    children: Node | dict[int, Node] | None

def xxh3_64(data: Buffer, seed: int = 0, /) -> int: ...
def block_hashes(packed: Buffer, seed: int, stride: int, window: int, /) -> list[int]: ...
def pack_u32(tokens: Sequence[int], /) -> bytes | None: ...
def sequence_hashes(local_hashes: Sequence[int], seed: int, /) -> tuple[int, ...]: ...
def split_json_tokens(body: Buffer, /) -> tuple[bytes, int, int] | None: ...
def has_wide_hash(blocks: list[Any], /) -> bool: ...

# The tree walks take the tree's nodes (this `Node`, typed as radix_tree's `_Node` there).
def store_chain(
    node: object,
    blocks: list[Any],
    bit: int,
    lookup: dict[int, Any],
    aliases: dict[Any, int],
    disown: Callable[[Any, Any], None],
    state: object,
    /,
) -> tuple[int, int, int]: ...
def remove_blocks(
    root: object, lookup: dict[int, Any], aliases: dict[Any, int], hashes: Sequence[int], bit: int, /
) -> tuple[list[int], int, int, int]: ...
def msgpack_u32s(data: Buffer, /) -> bytes | None: ...
def msgpack_rows(
    first: list[int], second: list[int], before: Buffer, between: Buffer, after: Buffer, /
) -> bytes | None: ...
def match_prefix(
    root: object, local_hashes: Sequence[int], keys: list[Any], scores: dict[Any, int], path: list[Any] | None, /
) -> None: ...
def book_blocks(refs: dict[int, int], hashes: Sequence[int], held: int, /) -> None: ...
def release_blocks(refs: dict[int, int], hashes: Sequence[int], shared: int, /) -> None: ...
def held_prefix(refs: dict[int, int], hashes: Sequence[int], /) -> int: ...
def shared_prefix(refs: dict[int, int], hashes: Sequence[int], /) -> int: ...

# The dynamo policy's costs (router/policies/dynamo.py's `python_costs`); None: run the Python code.
def dynamo_costs(
    ranks: Sequence[Any],
    overlaps: dict[Any, Any],
    depths: dict[Any, int],
    isl_tokens: int,
    block_size: int,
    booked_blocks: int,
    track_prefill_tokens: bool,
    overlap_score_credit: float,
    overlap_score_credit_decay: float,
    host_cache_hit_weight: float,
    disk_cache_hit_weight: float,
    prefill_load_scale: float,
    decode_active_request_weight: float,
    taint_multipliers: Sequence[float] | None,
    /,
) -> list[float] | None: ...
def lowest_cost(costs: list[float], /) -> tuple[int, int] | None: ...

# One whole plain POST request (api/http_protocol.py), or its Content-Length while the body is
# incomplete; None: httptools parses it.
def parse_post(
    data: bytes, /
) -> tuple[bytes, bytes, bytes | None, bytes | None, str | None, bytes | None, bytes] | int | None: ...
