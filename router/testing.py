"""Helpers for tests and benchmarks that drive a `KvRouter` without engines.

An engine that caches a prompt reports a ``stored`` event whose blocks carry the engine's block hash
and Dynamo's local hash; engines that hash like Dynamo use the sequence hash as the block hash, which
is what these helpers send, so prefixes shared between prompts are shared in the index too.
"""

from __future__ import annotations

from collections.abc import Sequence

from indexer.events import RouterEvent, StorageTier, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes

__all__ = ["prompt_stored_event"]


def prompt_stored_event(
    worker_id: int,
    tokens: Sequence[int] | bytes,
    block_size: int,
    *,
    event_id: int = 1,
    dp_rank: int = 0,
    blocks: int | None = None,
    storage_tier: StorageTier = StorageTier.DEVICE,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
) -> RouterEvent:
    """A root-anchored ``stored`` event for the first ``blocks`` complete blocks of a prompt (all of
    them by default), as the engine of ``(worker_id, dp_rank)`` would report it."""
    local = compute_block_hashes(tokens, block_size, lora_name=lora_name, cache_namespace=cache_namespace)
    if blocks is not None:
        local = local[:blocks]
    chain = compute_sequence_hashes(local)
    event = stored_event(event_id, zip(chain, local, strict=True), dp_rank=dp_rank)
    return RouterEvent(worker_id=worker_id, event=event, storage_tier=storage_tier)
