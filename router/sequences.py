"""Active sequences: the load the router has booked on each (worker, dp_rank) (§4.5).

Per rank: the prefill tokens still pending, the distinct prompt blocks of its active requests
(``decode_blocks``; a prefix shared by concurrent requests counts once, Dynamo's "assume KV reuse"
model) and the number of active requests. A request is booked by `add`, loses its prefill entry on
`mark_prefill`, and is released by `free` or, once stale, by `expire`.

Shared blocks are tracked in one map for all ranks, ``sequence hash -> {rank: refcount}``, so the
prefix of a new prompt that is already active on each rank is found in one pass over the prompt,
whatever the number of ranks or of blocks they hold (see `prefix_depths`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import pairwise

from router.types import DuplicateRequestId, RankKey, UnknownWorker

__all__ = ["ActiveSequences", "RankState"]


class RankState:
    """The booked load of one (worker, dp_rank); read freely, written only by `ActiveSequences`."""

    __slots__ = ("decode_blocks", "dp_rank", "key", "prefill_tokens", "requests", "worker_id")

    def __init__(self, key: RankKey) -> None:
        self.key = key
        self.worker_id, self.dp_rank = key
        self.prefill_tokens = 0
        self.decode_blocks = 0
        self.requests = 0

    def __repr__(self) -> str:
        return (
            f"RankState({self.key}, prefill_tokens={self.prefill_tokens}, "
            f"decode_blocks={self.decode_blocks}, requests={self.requests})"
        )


class _Request:
    __slots__ = ("hashes", "prefill_tokens", "private_blocks", "rank", "started_at")

    def __init__(
        self,
        rank: RankState,
        hashes: Sequence[int] | None,
        private_blocks: int,
        prefill_tokens: int,
        started_at: float,
    ) -> None:
        self.rank = rank
        self.hashes = hashes
        self.private_blocks = private_blocks
        self.prefill_tokens = prefill_tokens
        self.started_at = started_at


class ActiveSequences:
    """Booked requests and the per-rank load they add up to."""

    def __init__(self) -> None:
        self._ranks: dict[RankKey, RankState] = {}
        self._holders: dict[int, dict[RankState, int]] = {}
        # Insertion order is start order (the clock is monotonic), so expiry pops from the front.
        self._requests: OrderedDict[str, _Request] = OrderedDict()

    # ------------------------------------------------------------------ topology
    def add_rank(self, key: RankKey) -> None:
        if key not in self._ranks:
            self._ranks[key] = RankState(key)

    def remove_rank(self, key: RankKey) -> list[str]:
        """Drop a rank and every request booked on it; returns their ids. O(their blocks)."""
        rank = self._ranks.pop(key, None)
        if rank is None:
            return []
        dropped = [request_id for request_id, request in self._requests.items() if request.rank is rank]
        for request_id in dropped:
            self._release(self._requests.pop(request_id))
        return dropped

    def rank(self, key: RankKey) -> RankState | None:
        return self._ranks.get(key)

    def ranks(self) -> Iterator[RankState]:
        return iter(self._ranks.values())

    # ------------------------------------------------------------------ request lifecycle
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def owner(self, request_id: str) -> RankKey | None:
        request = self._requests.get(request_id)
        return None if request is None else request.rank.key

    def add(
        self,
        request_id: str,
        key: RankKey,
        *,
        hashes: Sequence[int] | None,
        private_blocks: int,
        prefill_tokens: int,
        now: float,
    ) -> None:
        """Book a request: ``hashes`` are shared prompt blocks, ``private_blocks`` blocks nobody
        shares, ``prefill_tokens`` the prefill still to do. O(len(hashes))."""
        existing = self._requests.get(request_id)
        if existing is not None:
            raise DuplicateRequestId(request_id, *existing.rank.key)
        rank = self._ranks.get(key)
        if rank is None:
            raise UnknownWorker(key[0])
        if hashes:
            holders = self._holders
            get = holders.get
            added = 0
            for block_hash in hashes:
                counts = get(block_hash)
                if counts is None:
                    holders[block_hash] = {rank: 1}
                    added += 1
                else:
                    count = counts.get(rank, 0)
                    counts[rank] = count + 1
                    if not count:
                        added += 1
            rank.decode_blocks += added
        rank.decode_blocks += private_blocks
        rank.prefill_tokens += prefill_tokens
        rank.requests += 1
        self._requests[request_id] = _Request(rank, hashes, private_blocks, prefill_tokens, now)

    def mark_prefill(self, request_id: str) -> bool:
        """The request's prefill is done: its tokens stop counting, its blocks stay. Idempotent."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.rank.prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0
        return True

    def free(self, request_id: str) -> bool:
        """Release a request entirely; False when the id is not active."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._release(request)
        return True

    def expire(self, cutoff: float) -> list[str]:
        """Free every request started before ``cutoff``; returns their ids. O(expired)."""
        expired = []
        requests = self._requests
        while requests:
            request_id, request = next(iter(requests.items()))
            if request.started_at >= cutoff:
                break
            del requests[request_id]
            self._release(request)
            expired.append(request_id)
        return expired

    def _release(self, request: _Request) -> None:
        rank = request.rank
        if request.hashes:
            holders = self._holders
            removed = 0
            for block_hash in request.hashes:
                counts = holders[block_hash]
                count = counts[rank]
                if count == 1:
                    del counts[rank]
                    removed += 1
                    if not counts:
                        del holders[block_hash]
                else:
                    counts[rank] = count - 1
            rank.decode_blocks -= removed
        rank.decode_blocks -= request.private_blocks
        rank.prefill_tokens -= request.prefill_tokens
        rank.requests -= 1

    # ------------------------------------------------------------------ reads
    def prefix_depths(self, hashes: Sequence[int]) -> dict[RankState, int]:
        """Per rank, the longest prefix of ``hashes`` (a prompt's sequence hashes) active on it.

        Every booked prompt holds all of its own prefixes and a sequence hash fixes its whole prefix,
        so the ranks holding block i+1 are a subset of those holding block i. A rank set therefore
        stays the same over runs of the prompt, and only the positions where it shrinks are looked
        for, by bisection: O(k log n) lookups for n blocks and k distinct depths, not O(n x ranks).
        """
        get = self._holders.get
        n = len(hashes)
        current = get(hashes[0]) if n else None
        depths: dict[RankState, int] = {}
        if not current:
            return depths
        start = 0
        while True:
            size = len(current)
            low, high = start + 1, n
            while low < high:
                middle = (low + high) // 2
                holders = get(hashes[middle])
                if holders is not None and len(holders) == size:
                    low = middle + 1
                else:
                    high = middle
            following = get(hashes[low]) if low < n else None
            if not following:
                depths.update(dict.fromkeys(current, low))
                return depths
            for rank in current:
                if rank not in following:
                    depths[rank] = low
            current = following
            start = low

    def _check(self) -> None:
        """Assert every invariant in O(total booked blocks); for tests only."""
        expected_holders: dict[int, dict[RankState, int]] = {}
        prefill = dict.fromkeys(self._ranks.values(), 0)
        private = dict.fromkeys(self._ranks.values(), 0)
        requests = dict.fromkeys(self._ranks.values(), 0)
        previous_start = float("-inf")
        for request in self._requests.values():
            rank = request.rank
            assert self._ranks.get(rank.key) is rank, f"request booked on unknown rank {rank.key}"
            assert request.started_at >= previous_start, "requests are not in start order"
            previous_start = request.started_at
            prefill[rank] += request.prefill_tokens
            private[rank] += request.private_blocks
            requests[rank] += 1
            for block_hash in request.hashes or ():
                counts = expected_holders.setdefault(block_hash, {})
                counts[rank] = counts.get(rank, 0) + 1
        assert self._holders == expected_holders, "holder refcounts differ from the booked requests"
        distinct = dict.fromkeys(self._ranks.values(), 0)
        for counts in self._holders.values():
            for rank in counts:
                distinct[rank] += 1
        for rank in self._ranks.values():
            assert rank.prefill_tokens == prefill[rank], f"{rank}: prefill sum {prefill[rank]}"
            assert rank.decode_blocks == distinct[rank] + private[rank], f"{rank}: decode blocks"
            assert rank.requests == requests[rank], f"{rank}: request count {requests[rank]}"
        for request in self._requests.values():
            hashes = request.hashes or ()
            for parent, child in pairwise(hashes):
                assert self._holders[child].keys() <= self._holders[parent].keys(), "holder sets must nest"
