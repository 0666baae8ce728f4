"""Active sequences: the load the router has booked on each (worker, dp_rank) (§4.5).

Per rank: the prefill tokens still pending, the distinct prompt blocks of its active requests
(``decode_blocks``; a prefix shared by concurrent requests counts once, Dynamo's "assume KV reuse"
model) and the number of active requests. A request is booked by `add`, loses its prefill entry on
`mark_prefill`, and is released by `free` or, once stale, by `expire`.

Output progress: `record_output` tells how many tokens a request has generated; they join its rank's
``context_tokens`` (the context every decode step there reads) at once. Output blocks (Dynamo's
``router_track_output_blocks``, when asked): each time its prompt plus output crosses a block boundary
one more block is counted on its rank. When the request says how long it expects to be (``expected_output_tokens``),
its exclusive blocks (the prompt suffix no other active request on the rank holds, and its output
blocks) are weighted ``max(0, 1 - generated / expected)`` from then on, as Dynamo does at each block
boundary; ``decode_blocks`` is the rank's weighted total, rounded.

Prefill load model (Dynamo's ``router_prefill_load_model``, here ``"linear"``): a rank's prefills run
oldest first, so only the oldest pending one (the anchor) is under way. Given the rate at which a rank
prefills, it is expected to take ``tokens / rate`` seconds, and `decay` counts what is left of it:
``prefill_tokens = booked - anchor + ceil(anchor * clamp(1 - elapsed / expected, 0, 1))``. When the
anchor is marked prefilled the next oldest becomes the anchor, its clock starting at the next `decay`
(every decision reads the load through it).

Each rank refcounts the sequence hashes of its active prompts. A sequence hash fixes its whole prefix
and every booked prompt holds all of its own prefixes, so along any prompt a rank's refcounts never
increase: the blocks a rank holds of a prompt are exactly a prefix of it (`router.booked_blocks`:
bisection in O(log n), or with the accelerator a walk of a trie of prompts), and the ranks holding
any of it are those holding its first block, which an index of first blocks names. Per request, the
work is proportional to the prompt and to the ranks sharing its first block, never to the blocks the
ranks hold (see `prefix_depths`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import NamedTuple

from indexer.slots import WorkerRank
from router.booked_blocks import new_booked_blocks
from router.errors import DuplicateRequestId, UnknownWorker
from router.overlap import round_half_away

__all__ = ["ActiveSequences", "Booking", "RankState"]


class RankState:
    """The booked load of one (worker, dp_rank); read freely, written only by `ActiveSequences`."""

    __slots__ = (
        "anchor_since",
        "booked",
        "booked_prefill_tokens",
        "context_tokens",
        "decayed_blocks",
        "decode_blocks",
        "decoding_inverse_output",
        "decoding_untold",
        "dp_rank",
        "key",
        "output_blocks",
        "prefill_tokens",
        "prefilling",
        "prompt_blocks",
        "requests",
        "worker_id",
    )

    def __init__(self, key: WorkerRank) -> None:
        self.key = key
        self.worker_id, self.dp_rank = key
        # Pending prefill as booked, and as scheduling reads it (the same without a prefill load model).
        self.booked_prefill_tokens = 0
        self.prefill_tokens = 0
        # Requests whose prefill is pending, oldest first, and when the oldest started (load model only).
        self.prefilling: dict[_Request, None] = {}
        self.anchor_since: float | None = None
        # Distinct prompt blocks plus private ones; output blocks; the weight decayed blocks lost.
        self.prompt_blocks = 0
        self.output_blocks = 0
        self.decayed_blocks = 0.0
        # What scheduling reads: round(prompt + output - decayed) (all prompt blocks without output tracking).
        self.decode_blocks = 0
        self.requests = 0
        # The context of the active requests, prompt and tokens generated so far, each counted in full:
        # what every decode step of the rank reads, shared prefixes included (ours; Dynamo has none).
        self.context_tokens = 0
        # Of the requests decoding here (prefill done): the sum of 1 / output length over those that said
        # it (`_inter_token_share`), and how many did not. A prefill stall of t ms adds t / length to a
        # decoding request's mean inter-token latency: short answers are what an ITL bound catches (ours).
        self.decoding_inverse_output = 0.0
        self.decoding_untold = 0
        # Which sequence hashes the active requests on this rank hold, and how many each.
        self.booked = new_booked_blocks()

    def _refresh(self) -> None:
        if self.output_blocks or self.decayed_blocks:
            weighted = self.prompt_blocks + self.output_blocks - self.decayed_blocks
            self.decode_blocks = round_half_away(max(weighted, 0.0))
        else:  # the same, without output tracking: no float to round
            self.decode_blocks = max(self.prompt_blocks, 0)

    def __repr__(self) -> str:
        return (
            f"RankState({self.key}, prefill_tokens={self.prefill_tokens}, "
            f"decode_blocks={self.decode_blocks}, requests={self.requests})"
        )


class Booking(NamedTuple):
    """What one active request books, as replicas exchange it (`router.replicas`): its blocks, its
    prefill, and its prompt and expected output length, which the `latency` policy's decode side reads."""

    key: WorkerRank
    hashes: Sequence[int] | None
    private_blocks: int
    prefill_tokens: int
    context_tokens: int = 0
    expected_output_tokens: int | None = None


def _inter_token_share(expected_output_tokens: int) -> float:
    """The share of a prefill stall one decoding request's mean inter-token latency pays: 1 / its output
    length; 0 for a single token (a disaggregated prefill: no gap between tokens)."""
    return 1.0 / expected_output_tokens if expected_output_tokens > 1 else 0.0


def _start_decoding(request: _Request) -> None:
    rank = request.rank
    expected = request.expected_output_tokens
    if expected:
        rank.decoding_inverse_output += _inter_token_share(expected)
    else:
        rank.decoding_untold += 1


class _Request:
    __slots__ = (
        "context_tokens",
        "decayed_blocks",
        "expected_output_tokens",
        "generated_tokens",
        "hashes",
        "output_blocks",
        "prefill_tokens",
        "private_blocks",
        "rank",
        "started_at",
    )

    def __init__(
        self,
        rank: RankState,
        hashes: Sequence[int] | None,
        private_blocks: int,
        prefill_tokens: int,
        context_tokens: int,
        expected_output_tokens: int | None,
        started_at: float,
    ) -> None:
        self.rank = rank
        self.hashes = hashes
        self.private_blocks = private_blocks
        self.prefill_tokens = prefill_tokens
        self.context_tokens = context_tokens
        self.expected_output_tokens = expected_output_tokens
        self.generated_tokens = 0
        self.output_blocks = 0
        self.decayed_blocks = 0.0
        self.started_at = started_at


def _booking_of(request: _Request) -> Booking:
    # The prompt only: output progress (`record_output`) is this router's own and not exchanged.
    return Booking(
        request.rank.key,
        request.hashes,
        request.private_blocks,
        request.prefill_tokens,
        request.context_tokens,
        request.expected_output_tokens,
    )


class ActiveSequences:
    """Booked requests and the per-rank load they add up to; ``prefill_tokens_per_s`` turns on the
    prefill load model (see the module doc)."""

    def __init__(self, prefill_tokens_per_s: float | None = None) -> None:
        self._prefill_rate = prefill_tokens_per_s
        self._ranks: dict[WorkerRank, RankState] = {}
        # A prompt's first sequence hash -> the ranks holding it.
        self._first_holders: dict[int, set[RankState]] = {}
        # Insertion order is start order (the clock is monotonic).
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        # Those of them that expire (all but the held ones, `hold`), in start order: expiry pops from the front.
        self._expiring: OrderedDict[str, None] = OrderedDict()

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
            self._expiring.pop(request_id, None)
        return dropped

    def rank(self, key: WorkerRank) -> RankState | None:
        return self._ranks.get(key)

    # ------------------------------------------------------------------ request lifecycle
    def __len__(self) -> int:
        return len(self._requests)

    def started_before(self, cutoff: float) -> bool:
        """Whether the oldest request that may expire started before ``cutoff`` (`expire` would free it). O(1)."""
        expiring = self._expiring
        return bool(expiring) and self._requests[next(iter(expiring))].started_at < cutoff

    def hold(self, request_id: str) -> bool:
        """Its booker frees the request on every path: `expire` leaves it. False when it is not active. O(1)."""
        if request_id not in self._requests:
            return False
        self._expiring.pop(request_id, None)
        return True

    def owner(self, request_id: str) -> WorkerRank | None:
        request = self._requests.get(request_id)
        return None if request is None else request.rank.key

    def booking(self, request_id: str) -> Booking | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        return _booking_of(request)

    def bookings(self) -> Iterator[tuple[str, Booking]]:
        """Every active request in start order. O(active requests)."""
        for request_id, request in self._requests.items():
            yield request_id, _booking_of(request)

    def add(
        self,
        request_id: str,
        key: WorkerRank,
        *,
        hashes: Sequence[int] | None,
        private_blocks: int,
        prefill_tokens: int,
        now: float,
        context_tokens: int = 0,
        expected_output_tokens: int | None = None,
        expires: bool = True,
    ) -> None:
        """Book a request: ``hashes`` are shared prompt blocks, ``private_blocks`` blocks nobody
        shares, ``prefill_tokens`` the prefill still to do, ``context_tokens`` its prompt length;
        without ``expires``, held from the start (`hold`). O(len(hashes))."""
        existing = self._requests.get(request_id)
        if existing is not None:
            raise DuplicateRequestId(request_id, *existing.rank.key)
        rank = self._ranks.get(key)
        if rank is None:
            raise UnknownWorker(key[0])
        if hashes:
            held = rank.booked.book(hashes)
            rank.prompt_blocks += len(hashes) - held
            if not held:
                self._first_holders.setdefault(hashes[0], set()).add(rank)
        rank.prompt_blocks += private_blocks
        rank._refresh()
        rank.context_tokens += context_tokens
        rank.requests += 1
        request = _Request(rank, hashes, private_blocks, prefill_tokens, context_tokens, expected_output_tokens, now)
        self._requests[request_id] = request
        if expires:
            self._expiring[request_id] = None
        if not prefill_tokens:
            _start_decoding(request)
        else:
            rank.booked_prefill_tokens += prefill_tokens
            rank.prefill_tokens += prefill_tokens
            if self._prefill_rate is not None:
                if not rank.prefilling:
                    rank.anchor_since = now
                rank.prefilling[request] = None

    def mark_prefill(self, request_id: str) -> bool:
        """The request's prefill is done: its tokens stop counting, its blocks stay. Idempotent."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._end_prefill(request)
        return True

    def _end_prefill(self, request: _Request) -> None:
        rank = request.rank
        if not request.prefill_tokens:
            return
        rank.booked_prefill_tokens -= request.prefill_tokens
        if self._prefill_rate is None:
            rank.prefill_tokens = rank.booked_prefill_tokens
        else:
            if next(iter(rank.prefilling)) is request:
                rank.anchor_since = None  # the next oldest starts now; its clock starts at the next read
            del rank.prefilling[request]
            self._decay_rank(rank, None)
        request.prefill_tokens = 0
        _start_decoding(request)

    def decay(self, now: float) -> None:
        """Bring every rank's ``prefill_tokens`` to ``now`` under the prefill load model (a no-op
        without it). O(ranks)."""
        if self._prefill_rate is None:
            return
        for rank in self._ranks.values():
            if rank.prefilling:
                self._decay_rank(rank, now)

    def _decay_rank(self, rank: RankState, now: float | None) -> None:
        assert self._prefill_rate is not None
        if not rank.prefilling:
            rank.prefill_tokens = rank.booked_prefill_tokens
            return
        if rank.anchor_since is None:
            if now is None:
                rank.prefill_tokens = rank.booked_prefill_tokens
                return
            rank.anchor_since = now
        anchor = next(iter(rank.prefilling)).prefill_tokens
        elapsed = (now if now is not None else rank.anchor_since) - rank.anchor_since
        left = min(max(1.0 - elapsed * self._prefill_rate / anchor, 0.0), 1.0)
        rank.prefill_tokens = rank.booked_prefill_tokens - anchor + math.ceil(anchor * left)

    def record_output(self, request_id: str, generated_tokens: int, block_size: int, *, count_blocks: bool) -> bool:
        """The request has generated ``generated_tokens`` so far: they join its rank's context in
        flight and, with ``count_blocks``, its output blocks count there, its exclusive blocks decayed
        when it said how long it would be (see the module doc). A count below one already told changes
        nothing. False when the id is not active. O(log prompt blocks) at a block boundary, O(1)
        otherwise."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        rank = request.rank
        if generated_tokens > request.generated_tokens:
            rank.context_tokens += generated_tokens - request.generated_tokens
            request.generated_tokens = generated_tokens
        if not count_blocks:
            return True
        isl = request.context_tokens
        # A block opens with the first token beyond the prompt's last block (full or partial).
        blocks = -(-(isl + generated_tokens) // block_size) - -(-isl // block_size)
        if blocks <= request.output_blocks:
            return True  # Dynamo updates the load only when a block boundary is crossed
        rank.output_blocks += blocks - request.output_blocks
        request.output_blocks = blocks
        expected = request.expected_output_tokens
        if expected:
            remaining = max(0.0, 1.0 - generated_tokens / expected)
            decayed = (self._exclusive_prompt_blocks(request) + blocks) * (1.0 - remaining)
            rank.decayed_blocks += decayed - request.decayed_blocks
            request.decayed_blocks = decayed
        rank._refresh()
        return True

    def _exclusive_prompt_blocks(self, request: _Request) -> int:
        """The request's prompt blocks no other active request on its rank holds."""
        hashes = request.hashes
        if not hashes:
            return request.private_blocks
        return len(hashes) - request.rank.booked.shared(hashes) + request.private_blocks

    def free(self, request_id: str) -> bool:
        """Release a request entirely; False when the id is not active."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._expiring.pop(request_id, None)
        self._release(request)
        return True

    def expire(self, cutoff: float) -> list[str]:
        """Free every request started before ``cutoff`` but the held ones; returns their ids. O(expired)."""
        expired = []
        requests, expiring = self._requests, self._expiring
        while expiring:
            request_id = next(iter(expiring))
            request = requests[request_id]
            if request.started_at >= cutoff:
                break
            del expiring[request_id], requests[request_id]
            self._release(request)
            expired.append(request_id)
        return expired

    def _release(self, request: _Request) -> None:
        rank = request.rank
        hashes = request.hashes
        if hashes:
            low = rank.booked.release(hashes)
            rank.prompt_blocks -= len(hashes) - low
            if not low:
                holders = self._first_holders[hashes[0]]
                holders.discard(rank)
                if not holders:
                    del self._first_holders[hashes[0]]
        rank.prompt_blocks -= request.private_blocks
        rank.output_blocks -= request.output_blocks
        self._end_prefill(request)  # a request released before its first token joins the decoders to leave
        expected = request.expected_output_tokens
        if expected:
            decoders_told = rank.decoding_inverse_output - _inter_token_share(expected)
            # No float residue once the last request that told its length has left.
            rank.decoding_inverse_output = decoders_told if rank.requests > 1 else 0.0
        else:
            rank.decoding_untold -= 1
        rank.context_tokens -= request.context_tokens + request.generated_tokens
        rank.requests -= 1
        # No float residue on an idle rank.
        rank.decayed_blocks = rank.decayed_blocks - request.decayed_blocks if rank.requests else 0.0
        rank._refresh()

    # ------------------------------------------------------------------ reads
    def prefix_depths(self, hashes: Sequence[int]) -> dict[RankState, int]:
        """Per rank holding any of it, the longest prefix of ``hashes`` (a prompt's sequence hashes)
        active on it. O(k log n) for n blocks and k ranks holding the first one."""
        holders = self._first_holders.get(hashes[0]) if hashes else None
        if not holders:
            return {}
        return {rank: rank.booked.held(hashes) for rank in holders}

    def _check(self) -> None:
        """Assert every invariant in O(total booked blocks); for tests only."""
        expected_refs: dict[RankState, dict[int, int]] = {rank: {} for rank in self._ranks.values()}
        prefill = dict.fromkeys(self._ranks.values(), 0)
        private = dict.fromkeys(self._ranks.values(), 0)
        output = dict.fromkeys(self._ranks.values(), 0)
        decayed = dict.fromkeys(self._ranks.values(), 0.0)
        requests = dict.fromkeys(self._ranks.values(), 0)
        context = dict.fromkeys(self._ranks.values(), 0)
        inverse_output = dict.fromkeys(self._ranks.values(), 0.0)
        untold = dict.fromkeys(self._ranks.values(), 0)
        previous_start = float("-inf")
        for request in self._requests.values():
            rank = request.rank
            assert self._ranks.get(rank.key) is rank, f"request booked on unknown rank {rank.key}"
            assert request.started_at >= previous_start, "requests are not in start order"
            previous_start = request.started_at
            prefill[rank] += request.prefill_tokens
            private[rank] += request.private_blocks
            requests[rank] += 1
            context[rank] += request.context_tokens + request.generated_tokens
            output[rank] += request.output_blocks
            decayed[rank] += request.decayed_blocks
            if not request.prefill_tokens:  # decoding
                if request.expected_output_tokens:
                    inverse_output[rank] += _inter_token_share(request.expected_output_tokens)
                else:
                    untold[rank] += 1
            refs = expected_refs[rank]
            for block_hash in request.hashes or ():
                refs[block_hash] = refs.get(block_hash, 0) + 1
        for rank in self._ranks.values():
            assert rank.booked.refcounts() == expected_refs[rank], f"{rank}: refcounts differ from the requests'"
            assert rank.booked_prefill_tokens == prefill[rank], f"{rank}: prefill sum {prefill[rank]}"
            assert rank.prefill_tokens <= rank.booked_prefill_tokens, f"{rank}: decayed above booked"
            if self._prefill_rate is None:
                assert rank.prefill_tokens == rank.booked_prefill_tokens, f"{rank}: prefill without a model"
            else:
                pending = [
                    request for request in self._requests.values() if request.rank is rank and request.prefill_tokens
                ]
                assert list(rank.prefilling) == pending, f"{rank}: prefilling requests out of order"
            assert len(rank.booked) == len(expected_refs[rank]), f"{rank}: distinct booked blocks"
            assert rank.prompt_blocks == len(rank.booked) + private[rank], f"{rank}: prompt blocks"
            assert rank.output_blocks == output[rank], f"{rank}: output blocks"
            assert abs(rank.decayed_blocks - decayed[rank]) < 1e-6, f"{rank}: decayed blocks"
            weighted = max(rank.prompt_blocks + rank.output_blocks - rank.decayed_blocks, 0.0)
            assert rank.decode_blocks == round_half_away(weighted), f"{rank}: decode blocks"
            assert rank.requests == requests[rank], f"{rank}: request count {requests[rank]}"
            assert rank.context_tokens == context[rank], f"{rank}: context tokens {context[rank]}"
            assert abs(rank.decoding_inverse_output - inverse_output[rank]) < 1e-9, f"{rank}: decoding 1 / length"
            assert rank.decoding_untold == untold[rank], f"{rank}: decoding requests without a length"
        assert self._expiring.keys() <= self._requests.keys(), "a request that may expire is not active"
        starts = [self._requests[request_id].started_at for request_id in self._expiring]
        assert starts == sorted(starts), "the requests that may expire are not in start order"
        first_holders: dict[int, set[RankState]] = {}
        for request in self._requests.values():
            hashes = request.hashes or ()
            refs = expected_refs[request.rank]
            for parent, child in pairwise(hashes):
                assert refs[child] <= refs[parent], "refcounts must not increase along a prompt"
            if hashes:
                first_holders.setdefault(hashes[0], set()).add(request.rank)
        assert self._first_holders == first_holders, "the first-block index differs from the requests"
