# Types of the bridge's C step built from indexer/_events_native.c (see indexer/events_native.py).
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Buffer

def configure(
    stored_type: type[Any],
    removed_type: type[Any],
    cleared_event: object,
    tiers_by_medium: dict[bytes, Any],
    device_tier: object,
    pack_tokens: Callable[[Buffer], bytes | None],
    block_hashes: Callable[[Buffer, int, int, int], list[int]],
    namespace_seed: Callable[[str], int],
    /,
) -> None: ...
def decode_batch(
    payload: Buffer, block_size: int, seed: int, salts: dict[int, str] | None = None, /
) -> tuple[float, int | None, list[Any], int] | None: ...
def hold_chain(
    held: dict[int, tuple[int | None, int]],
    parent: int | None,
    block_hashes: list[int],
    tokens_hashes: list[int],
    device: bool,
    /,
) -> int: ...
def drop_blocks(held: dict[int, tuple[int | None, int]], block_hashes: Sequence[int], /) -> None: ...
def bridge_batch(
    payload: Buffer,
    block_size: int,
    seed: int,
    default_rank: int,
    next_event_id: Callable[[int], int | None],
    held: dict[tuple[int, Any], dict[int, tuple[int | None, int]]],
    stored_templates: dict[tuple[int, Any], tuple[bytes, bytes, bytes, bytes, int, int, int]],
    removed_templates: dict[tuple[int, Any], list[bytes]],
    row: tuple[bytes, bytes, bytes],
    by_content: dict[tuple[int | None, int], int],
    by_hash: dict[int, int],
    max_recorded: int,
    /,
) -> tuple[int, int, int, int, list[tuple[int, int, int, int | None, int]], list[tuple[int, bytes]]] | None: ...
