"""From the index's match to what scheduling uses: per rank, device and lower-tier blocks, the effective
overlap and the cached tokens it implies (§3.5, `scheduling/overlap.rs`).

``effective = device + host_weight * host + disk_weight * (disk + external)`` and
``cached_tokens = round(effective * block_size)``, rounding halves away from zero as Rust does.
"""

from __future__ import annotations

import math

from indexer.events import StorageTier
from indexer.radix_tree import OverlapScores
from indexer.slots import WorkerRank
from router.config import RouterConfig

__all__ = ["NO_OVERLAP", "RankOverlap", "rank_overlaps", "round_half_away"]


class RankOverlap:
    """One rank's cached prefix of a prompt. ``disk_blocks`` counts disk and external extensions."""

    __slots__ = ("cached_tokens", "device_blocks", "disk_blocks", "effective_blocks", "host_blocks")

    def __init__(
        self, device_blocks: int, host_blocks: int, disk_blocks: int, effective_blocks: float, cached_tokens: int
    ) -> None:
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.effective_blocks = effective_blocks
        self.cached_tokens = cached_tokens

    def __repr__(self) -> str:
        return (
            f"RankOverlap(device={self.device_blocks}, host={self.host_blocks}, disk={self.disk_blocks}, "
            f"effective={self.effective_blocks}, cached_tokens={self.cached_tokens})"
        )


NO_OVERLAP = RankOverlap(0, 0, 0, 0.0, 0)


def round_half_away(value: float) -> int:
    """Rust's ``f64::round`` for a non-negative value (Python's ``round`` rounds halves to even)."""
    whole = math.floor(value)
    return whole + (value - whole >= 0.5)


def rank_overlaps(match: OverlapScores, config: RouterConfig) -> dict[WorkerRank, RankOverlap]:
    """Every rank the match mentions (ranks absent from it have `NO_OVERLAP`). O(ranks in the match)."""
    tier_hits = match.tier_hits
    if not tier_hits:
        # The common case, device-only indexes: effective overlap is the device match itself.
        block_size = config.block_size
        return {
            key: RankOverlap(blocks, 0, 0, float(blocks), blocks * block_size) for key, blocks in match.scores.items()
        }
    host = tier_hits.get(StorageTier.HOST_PINNED, {})
    disk = dict(tier_hits.get(StorageTier.DISK, {}))
    for key, hits in tier_hits.get(StorageTier.EXTERNAL, {}).items():
        disk[key] = disk.get(key, 0) + hits
    overlaps = {}
    for key in match.scores.keys() | host.keys() | disk.keys():
        device_blocks = match.scores.get(key, 0)
        host_blocks = host.get(key, 0)
        disk_blocks = disk.get(key, 0)
        effective = (
            device_blocks + config.host_cache_hit_weight * host_blocks + config.disk_cache_hit_weight * disk_blocks
        )
        cached = round_half_away(effective * config.block_size)
        overlaps[key] = RankOverlap(device_blocks, host_blocks, disk_blocks, effective, cached)
    return overlaps
