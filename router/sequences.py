"""Active sequences: the load the router has booked on each (worker, dp_rank) (§4.5).

Per rank: the prefill tokens still pending, the distinct prompt blocks of its active requests
(``decode_blocks``; a prefix shared by concurrent requests counts once, Dynamo's "assume KV reuse"
model) and the number of active requests. A request is booked by `add`, loses its prefill entry on
`mark_prefill`, and is released by `free` or, once stale, by `expire`.

Each rank refcounts the sequence hashes of its active prompts. A sequence hash fixes its whole prefix
and every booked prompt holds all of its own prefixes, so along any prompt a rank's refcounts never
increase: the blocks a rank holds of a prompt are exactly a prefix of it, found by bisection in
O(log n), and the ranks holding any of it are those holding its first block, which an index of first
blocks names. Per request, the work is proportional to the prompt and to the ranks sharing its first
block, never to the blocks the ranks hold (see `prefix_depths`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise

from indexer.slots import WorkerRank
from router.errors import DuplicateRequestId, UnknownWorker

__all__ = ["ActiveSequences", "RankState"]


class RankState:
    """The booked load of one (worker, dp_rank); read freely, written only by `ActiveSequences`."""

    __slots__ = ("decode_blocks", "dp_rank", "key", "prefill_tokens", "refs", "requests", "worker_id")

    def __init__(self, key: WorkerRank) -> None:
        self.key = key
        self.worker_id, self.dp_rank = key
        self.prefill_tokens = 0
        self.decode_blocks = 0
        self.requests = 0
        # Sequence hash -> how many active requests on this rank hold that block.
        self.refs: dict[int, int] = {}

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
        self._ranks: dict[WorkerRank, RankState] = {}
        # A prompt's first sequence hash -> the ranks holding it.
        self._first_holders: dict[int, set[RankState]] = {}
        # Insertion order is start order (the clock is monotonic), so expiry pops from the front.
        self._requests: OrderedDict[str, _Request] = OrderedDict()

    # ------------------------------------------------------------------ topology
    def add_rank(self, key: WorkerRank) -> None:
        if key not in self._ranks:
            self._ranks[key] = RankState(key)

    def remove_rank(self, key: WorkerRank) -> list[str]:
        """Drop a rank and every request booked on it; returns their ids. O(active requests)."""
        rank = self._ranks.pop(key, None)
        if rank is None:
            return []
        dropped = [request_id for request_id, request in self._requests.items() if request.rank is rank]
        for request_id in dropped:
            self._release(self._requests.pop(request_id))
        return dropped

    def rank(self, key: WorkerRank) -> RankState | None:
        return self._ranks.get(key)

    # ------------------------------------------------------------------ request lifecycle
    def __len__(self) -> int:
        return len(self._requests)

    def owner(self, request_id: str) -> WorkerRank | None:
        request = self._requests.get(request_id)
        return None if request is None else request.rank.key

    def add(
        self,
        request_id: str,
        key: WorkerRank,
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
            refs = rank.refs
            held = _held_prefix(refs, hashes)
            for block_hash in hashes[:held]:
                refs[block_hash] += 1
            refs.update(dict.fromkeys(hashes[held:], 1))
            rank.decode_blocks += len(hashes) - held
            if not held:
                self._first_holders.setdefault(hashes[0], set()).add(rank)
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
        hashes = request.hashes
        if hashes:
            refs = rank.refs
            # Refcounts never increase along the prompt, so the blocks only this request holds
            # (refcount 1) are a suffix of it.
            low, high = 0, len(hashes)
            while low < high:
                middle = (low + high) // 2
                if refs[hashes[middle]] > 1:
                    low = middle + 1
                else:
                    high = middle
            for block_hash in hashes[:low]:
                refs[block_hash] -= 1
            for block_hash in hashes[low:]:
                del refs[block_hash]
            rank.decode_blocks -= len(hashes) - low
            if not low:
                holders = self._first_holders[hashes[0]]
                holders.discard(rank)
                if not holders:
                    del self._first_holders[hashes[0]]
        rank.decode_blocks -= request.private_blocks
        rank.prefill_tokens -= request.prefill_tokens
        rank.requests -= 1

    # ------------------------------------------------------------------ reads
    def prefix_depths(self, hashes: Sequence[int]) -> dict[RankState, int]:
        """Per rank holding any of it, the longest prefix of ``hashes`` (a prompt's sequence hashes)
        active on it. O(k log n) for n blocks and k ranks holding the first one."""
        holders = self._first_holders.get(hashes[0]) if hashes else None
        if not holders:
            return {}
        return {rank: _held_prefix(rank.refs, hashes) for rank in holders}

    def _check(self) -> None:
        """Assert every invariant in O(total booked blocks); for tests only."""
        expected_refs: dict[RankState, dict[int, int]] = {rank: {} for rank in self._ranks.values()}
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
            refs = expected_refs[rank]
            for block_hash in request.hashes or ():
                refs[block_hash] = refs.get(block_hash, 0) + 1
        for rank in self._ranks.values():
            assert rank.refs == expected_refs[rank], f"{rank}: refcounts differ from the booked requests"
            assert rank.prefill_tokens == prefill[rank], f"{rank}: prefill sum {prefill[rank]}"
            assert rank.decode_blocks == len(rank.refs) + private[rank], f"{rank}: decode blocks"
            assert rank.requests == requests[rank], f"{rank}: request count {requests[rank]}"
        first_holders: dict[int, set[RankState]] = {}
        for request in self._requests.values():
            hashes = request.hashes or ()
            refs = request.rank.refs
            for parent, child in pairwise(hashes):
                assert refs[child] <= refs[parent], "refcounts must not increase along a prompt"
            if hashes:
                first_holders.setdefault(hashes[0], set()).add(request.rank)
        assert self._first_holders == first_holders, "the first-block index differs from the requests"


def _held_prefix(refs: dict[int, int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` a rank holds: they are a prefix of the prompt (see the module
    docstring), so bisect for its end. O(log n)."""
    low, high = 0, len(hashes)
    while low < high:
        middle = (low + high) // 2
        if hashes[middle] in refs:
            low = middle + 1
        else:
            high = middle
    return low
