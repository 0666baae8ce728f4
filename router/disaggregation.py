"""Disaggregated prefill and decode: which workers serve each leg, how the decode worker is priced and
when the remote prefill is skipped. Pure functions; `KvRouter` selects and books with them.

The pools need no index or load view of their own: workers are disjoint, the index and the booked
load are kept per worker, so filtering the candidates by role gives each pool exactly its own view (a
prefill worker's KV events and bookings are only ever read when prefill workers are scored).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

import msgspec

from router.config import RouterConfig
from router.types import DisaggregationPath, WorkerConfig

__all__ = [
    "PREFILL_BOOKING_SUFFIX",
    "PendingPrefill",
    "choose_path",
    "decode_config",
    "is_disaggregated",
    "leg_workers",
    "prefill_booking_id",
]

# A remote prefill's booking is the request's id with this suffix (so replicas and listings see it).
PREFILL_BOOKING_SUFFIX = "#prefill"

Leg = Literal["prefill", "decode"]


def is_disaggregated(workers: Iterable[WorkerConfig], *, among_both: bool = False) -> bool:
    """A fleet with any prefill-only or decode-only worker routes every request as two legs; with
    ``among_both`` (`RouterConfig.disagg_among_both_workers`) so does one of two or more workers of
    role both, whose engines then hand KV over between themselves."""
    workers = list(workers)
    return any(worker.role != "both" for worker in workers) or (among_both and len(workers) >= 2)


def leg_workers(workers: Iterable[WorkerConfig], leg: Leg) -> list[WorkerConfig]:
    """The workers that may run ``leg``, in the order given."""
    return [worker for worker in workers if worker.serves(leg)]


def prefill_booking_id(request_id: str) -> str:
    return request_id + PREFILL_BOOKING_SUFFIX


def request_of_prefill_booking(booking_id: str) -> str | None:
    """The request a remote prefill leg's booking belongs to; None for any other booking."""
    return booking_id.removesuffix(PREFILL_BOOKING_SUFFIX) if booking_id.endswith(PREFILL_BOOKING_SUFFIX) else None


def decode_config(config: RouterConfig) -> RouterConfig:
    """The config the decode worker is scored with. With ``disagg_decode_overlap_credit`` the policy is
    unchanged: it prices the prefill the decode worker would do itself (its uncached prompt), which is
    what the local path costs and what a remote prefill's KV saves it from re-sending; without it the
    prefill term and the cache credit are zeroed, leaving the decode load (`dynamo`: blocks and active
    requests; `latency`: the context in flight and the requests it slows)."""
    if config.disagg_decode_overlap_credit:
        return config
    return msgspec.structs.replace(config, prefill_load_scale=0.0, overlap_score_credit=0.0)


class PendingPrefill(NamedTuple):
    """The load both paths would wait on: prefill tokens already pending on the chosen prefill worker
    and on the chosen decode worker, the prompt's uncached tokens on that prefill worker, and the
    requests active on the decode worker (whose decoding a local prefill stalls)."""

    prefill_worker: int
    on_prefill_worker: int
    on_decode_worker: int
    prefill_uncached: int
    decode_requests: int
    # Requests active on the prefill worker when it decodes too (role both): its prefill stalls them.
    prefill_worker_requests: int = 0


def choose_path(
    uncached_tokens: int,
    config: RouterConfig,
    decode_worker: int,
    pending: PendingPrefill | None,
) -> tuple[DisaggregationPath, str]:
    """Remote or local prefill for a prompt with ``uncached_tokens`` missing on the chosen decode
    worker (``pending``: None when no prefill worker can take it), and why (the sentence a receipt
    carries)."""
    threshold_tokens = config.disagg_local_prefill_below_tokens
    if uncached_tokens < threshold_tokens:
        return "local_prefill", (
            f"{uncached_tokens} uncached tokens on decode worker {decode_worker}, below the "
            f"{threshold_tokens}-token threshold: prefilled there"
        )
    if pending is None:
        return "local_prefill", (
            f"{uncached_tokens} uncached tokens on decode worker {decode_worker} but no prefill worker can "
            "take the request: prefilled there"
        )
    limit = config.disagg_prefill_queue_limit_tokens
    local_first = pending.on_decode_worker + uncached_tokens < pending.on_prefill_worker
    if limit is not None and pending.on_prefill_worker > limit and local_first:
        return "local_prefill", (
            f"prefill worker {pending.prefill_worker} has {pending.on_prefill_worker} prefill tokens pending, over the "
            f"{limit}-token queue limit and more than decode worker {decode_worker} would have with this prompt "
            f"({pending.on_decode_worker + uncached_tokens}): prefilled there"
        )
    sooner_below = config.disagg_local_prefill_sooner_below_tokens
    local_wait = config.disagg_local_prefill_cost_factor * (pending.on_decode_worker + uncached_tokens)
    if sooner_below is not None and uncached_tokens < sooner_below and local_wait < pending.on_prefill_worker:
        return "local_prefill", (
            f"{uncached_tokens} uncached tokens on decode worker {decode_worker}, below the {sooner_below}-token "
            f"load-aware threshold, and prefilling there is the shorter wait ({local_wait:g} weighted tokens with "
            f"its {pending.on_decode_worker} pending, against {pending.on_prefill_worker} pending on prefill worker "
            f"{pending.prefill_worker}): prefilled there"
        )
    stall_weight = config.disagg_local_prefill_stall_weight
    if stall_weight is not None:
        return _sooner_path(uncached_tokens, config, stall_weight, decode_worker, pending)
    return "remote_prefill", (
        f"{uncached_tokens} uncached tokens on decode worker {decode_worker}, at or above the "
        f"{threshold_tokens}-token threshold: prefilled remotely"
    )


def _sooner_path(
    uncached_tokens: int, config: RouterConfig, stall_weight: float, decode_worker: int, pending: PendingPrefill
) -> tuple[DisaggregationPath, str]:
    """The path with the sooner estimated first token, in prefill tokens (a tie goes remote: the
    decode batch is not stalled for nothing)."""
    transfer = config.disagg_transfer_cost_per_token * uncached_tokens
    remote_stall_factor = 1 + stall_weight * pending.prefill_worker_requests
    remote_stall = (
        f" x {remote_stall_factor:g} for the {pending.prefill_worker_requests} requests it stalls"
        if pending.prefill_worker_requests
        else ""
    )
    remote = pending.on_prefill_worker + pending.prefill_uncached * remote_stall_factor + transfer
    stall_factor = 1 + stall_weight * pending.decode_requests
    local = pending.on_decode_worker + uncached_tokens * stall_factor
    estimate = (
        f"estimated {local:g} tokens on decode worker {decode_worker} ({pending.on_decode_worker} pending + "
        f"{uncached_tokens} uncached x {stall_factor:g} for the {pending.decode_requests} requests it stalls) "
        f"against {remote:g} on prefill worker {pending.prefill_worker} ({pending.on_prefill_worker} pending + "
        f"{pending.prefill_uncached} uncached{remote_stall} + {transfer:g} for the KV transfer)"
    )
    if local < remote:
        return "local_prefill", f"{estimate}: prefilled on the decode worker, the sooner"
    return "remote_prefill", f"{estimate}: prefilled remotely, the sooner"
