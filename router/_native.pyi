# Types of the router's C accelerator built from router/_native.c (see router/native.py).
from collections.abc import Mapping, Sequence
from typing import Any

class BookedBlocks:
    """The C twin of `router.booked_blocks.BookedBlocks` (a trie of prompts with compressed edges)."""

    def __len__(self) -> int: ...
    def book(self, hashes: Sequence[int], /) -> int: ...
    def release(self, hashes: Sequence[int], /) -> int: ...
    def shared(self, hashes: Sequence[int], /) -> int: ...
    def held(self, hashes: Sequence[int], /) -> int: ...
    def refcounts(self) -> dict[int, int]: ...

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

# The latency policy's costs before taint multipliers and the prompt tokens each rank holds
# (router/policies/latency.py's `python_costs_and_held`); None: run the Python code.
def latency_costs(
    ranks: Sequence[Any],
    overlaps: Mapping[Any, Any],
    depths: Mapping[Any, int],
    fills: Mapping[Any, float] | None,
    pass_tokens: Mapping[Any, int],
    isl_tokens: int,
    block_size: int,
    track_prefill_tokens: bool,
    default_output_tokens: int,
    overlap_score_credit: float,
    prefill_load_scale: float,
    extra_miss_weight: float,
    stall_weight: float,
    itl_stall_weight: float,
    decode_weight: float,
    decode_others_weight: float,
    pass_base_tokens: float,
    /,
) -> tuple[list[float], list[int]] | None: ...
def lowest_cost(costs: list[float], /) -> tuple[int, int] | None: ...
