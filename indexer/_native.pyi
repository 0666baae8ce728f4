# Types of the indexer's C accelerator built from indexer/_native.c (see indexer/native.py).
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
def has_wide_hash(blocks: list[Any], /) -> bool: ...

# The tree walks take the tree's nodes (this `Node`, typed as radix_tree's `_Node` there).
def store_chain(
    root: object,
    parent_hash: int | None,
    blocks: list[Any],
    bit: int,
    lookup: dict[int, Any],
    aliases: dict[Any, int],
    disown: Callable[[Any, Any], None],
    state: object,
    /,
) -> tuple[int, int, int] | None: ...
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
def bind_event_types(
    router: type,
    event: type,
    data: type,
    stored: type,
    removed: type,
    block: type,
    device: object,
    unset: object,
    cleared: str,
    /,
) -> None: ...
def router_events_json(payload: Buffer, /) -> list[Any] | None: ...
