"""`MockEngine`: a vLLM-like scheduler over a `BlockPool`, stepped one forward pass at a time.

The engine knows nothing of clocks, NATS or routers: `step(now_ms)` runs one pass starting at
``now_ms`` and returns what it produced and when (`PassResult`); the online worker sleeps through the
pass, the offline simulation jumps over it. Both therefore run exactly this code.

One pass, as vLLM v1 (and Dynamo's mocker) schedules it, with a budget of ``max_num_batched_tokens``:

1. Running sequences in admission order: one still prefilling takes the next chunk of its prompt
   (as much as the budget allows); one generating takes one token. A block allocation that cannot be
   satisfied preempts the most recently admitted sequence (its blocks are released and it goes back to
   the head of the queue to be recomputed), possibly the requesting one itself.
2. Waiting sequences in arrival order, while fewer than ``max_num_seqs`` run and budget remains: the
   longest cached prefix of the prompt is looked up (capped so the last token is always computed, as
   vLLM does), and the sequence is admitted if the pool can hold all its blocks besides the cached ones
   already in use; otherwise the queue waits (head of line).
3. At the end of the pass every sequence whose prefill completed emits its first token and every
   generating sequence its next one; a sequence that reaches its output length releases its blocks.

Block life cycle and KV events follow `mocker.block_pool`. Generated tokens are pseudo-random but
deterministic per request, and their full blocks are hashed and cached like prompt blocks.

Hot path: a pass in which every running sequence is generating (the common case) costs O(1) plus the
sequences that open a new block or finish in it. Generated-token counts are kept lazily against a pass
counter, and a heap holds the pass at which each sequence next needs attention.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from enum import IntEnum

from indexer.hashing import TokenInput, compute_block_hashes, compute_sequence_hashes, pack_tokens
from mocker.block_pool import BlockPool, KvOp
from mocker.config import EngineConfig
from mocker.timing import PassTimer

__all__ = ["CacheStats", "EngineMetrics", "MockEngine", "PassResult", "SeqState", "Sequence"]


class SeqState(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3
    REJECTED = 4


class Sequence:
    """One request inside the engine: its blocks, progress and timestamps (ms)."""

    __slots__ = (
        "_gen0",
        "_rng",
        "_tail",
        "_tick0",
        "arrival_ms",
        "cached_blocks",
        "cached_tokens",
        "computed",
        "due",
        "finished_ms",
        "first_token_ms",
        "hashes",
        "held",
        "kv_loaded",
        "locals",
        "max_tokens",
        "order",
        "partial",
        "preemptions",
        "prompt_blocks",
        "prompt_len",
        "queued",
        "request_id",
        "state",
    )

    def __init__(
        self,
        request_id: str,
        hashes: list[int],
        local_hashes: list[int],
        tail: bytes,
        prompt_len: int,
        max_tokens: int,
        arrival_ms: float,
        rng: random.Random,
        block_size: int,
    ) -> None:
        self.request_id = request_id
        self.hashes = hashes  # sequence hashes of the full blocks known so far (prompt, then output)
        self.locals = local_hashes  # their local (tokens) hashes
        self._tail = tail  # packed tokens of the unfinished last block
        self._rng = rng
        self.prompt_len = prompt_len
        self.prompt_blocks = -(-prompt_len // block_size)
        self.max_tokens = max_tokens
        self.arrival_ms = arrival_ms
        self.state = SeqState.WAITING
        self.computed = 0  # tokens whose KV is computed (cached prefix included)
        self.held = 0  # leading full blocks referenced in the pool
        self.partial = False  # holds a partial block after them
        self._gen0 = 0  # generated tokens as of pass `_tick0` (see MockEngine._generated)
        self._tick0 = 0
        self.due = -1  # pass counter value at which the heap entry of a generating sequence is due
        self.order = 0  # admission order: running order and LIFO preemption
        self.preemptions = 0
        self.queued = False  # a pass left it waiting (no seat, budget or blocks for it)
        # The prompt's KV came from a prefill worker (disaggregation): only its last token is computed
        # at admission. A preemption drops the KV, and the recomputation is local.
        self.kv_loaded = False
        self.cached_tokens = -1  # -1 until first admitted
        self.cached_blocks = 0
        self.first_token_ms = -1.0
        self.finished_ms = -1.0

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.state.name}, prompt={self.prompt_len}, computed={self.computed})"


class CacheStats:
    """Engine-side prefix-cache accounting, counted once per request at its first admission."""

    __slots__ = ("cached_blocks", "cached_tokens", "preemptions", "prompt_blocks", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prompt_blocks = 0
        self.cached_blocks = 0
        self.preemptions = 0


class EngineMetrics:
    """What the engine would export to a metrics scraper (vLLM's num_requests_waiting / running,
    kv_cache_usage), plus the load fields of an ``ActiveLoad``."""

    __slots__ = ("active_blocks", "kv_usage", "prefill_tokens_pending", "running", "waiting")

    def __init__(
        self, waiting: int, running: int, active_blocks: int, kv_usage: float, prefill_tokens_pending: int
    ) -> None:
        self.waiting = waiting
        self.running = running
        self.active_blocks = active_blocks
        self.kv_usage = kv_usage
        self.prefill_tokens_pending = prefill_tokens_pending


class PassResult:
    """One forward pass: when it ends, its prefill work, and the sequences and KV ops it produced.
    ``opened_blocks``: the sequences whose output opened a new block in it (a gateway streaming their
    tokens would tell the router their progress; `MockEngine.generated` says how far)."""

    __slots__ = ("end_ms", "finished", "first_tokens", "opened_blocks", "ops", "prefill_tokens", "start_ms")

    def __init__(self, start_ms: float, end_ms: float) -> None:
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.prefill_tokens = 0
        self.first_tokens: list[Sequence] = []
        self.opened_blocks: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.ops: list[KvOp] = []


class MockEngine:
    """A simulated worker; ``seed`` makes generated tokens (and so output-block hashes) reproducible."""

    def __init__(self, config: EngineConfig, *, seed: int = 0) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks)
        self.timer = PassTimer(config)
        self.stats = CacheStats()
        self._seed = seed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefilling = 0  # running sequences still in prefill
        self._decoding = 0  # running sequences generating tokens
        self._tick = 0  # passes in which every generating sequence produced a token
        self._due: list[tuple[int, int, Sequence]] = []  # (pass counter, order, sequence)
        self._decode_tokens = 0  # summed context length of generating sequences
        self._orders = 0
        self._pass = PassResult(0.0, 0.0)  # the pass being run (preemption may finish a sequence)
        self._preempted_in_pass = False
        # Packed tokens of recent full blocks by block hash, for engines whose events carry token ids
        # (vLLM's ZMQ format); None: not recorded. Bounded by `_block_tokens_limit`, oldest first out.
        self.block_tokens: OrderedDict[int, bytes] | None = None
        self._block_tokens_limit = 0

    def record_block_tokens(self, limit: int) -> None:
        """Keep the tokens of the last ``limit`` full blocks seen (see ``block_tokens``)."""
        self.block_tokens = OrderedDict()
        self._block_tokens_limit = limit

    def _remember_tokens(self, block_hash: int, tokens: bytes) -> None:
        recorded = self.block_tokens
        if recorded is None:
            return
        recorded[block_hash] = tokens
        recorded.move_to_end(block_hash)
        if len(recorded) > self._block_tokens_limit:
            recorded.popitem(last=False)

    # ------------------------------------------------------------------ requests
    def submit(
        self, request_id: str, tokens: TokenInput, max_tokens: int, arrival_ms: float, *, kv_loaded: bool = False
    ) -> Sequence:
        """Queue a request; it is rejected at once if its prompt and output cannot fit in the pool at all
        (`EngineConfig.fits`: admitted, it would preempt itself for ever once its output outgrew the pool).
        ``kv_loaded``: its prompt's KV was transferred from a prefill worker (see `Sequence.kv_loaded`)."""
        packed = pack_tokens(tokens)
        prompt_len = len(packed) // 4
        block_size = self.block_size
        local_hashes = compute_block_hashes(packed, block_size)
        full = len(local_hashes)
        rng = random.Random(f"{self._seed}:{request_id}")
        seq = Sequence(
            request_id,
            compute_sequence_hashes(local_hashes),
            local_hashes,
            bytes(packed[full * block_size * 4 :]),
            prompt_len,
            max(1, max_tokens),
            arrival_ms,
            rng,
            block_size,
        )
        if not self.config.fits(prompt_len, max_tokens):
            seq.state = SeqState.REJECTED
            return seq
        seq.kv_loaded = kv_loaded
        if self.block_tokens is not None:
            stride = block_size * 4
            for i, block_hash in enumerate(seq.hashes):
                self._remember_tokens(block_hash, bytes(packed[i * stride : (i + 1) * stride]))
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, now_ms: float) -> None:
        """Stop a request whose client went away (vLLM's abort): its blocks are released at once."""
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
            seq.state = SeqState.FINISHED
            seq.finished_ms = now_ms
        elif seq.state in (SeqState.PREFILL, SeqState.DECODE):
            if seq.state is SeqState.DECODE:
                self._materialize(seq)
            self._finish(seq, now_ms, PassResult(now_ms, now_ms))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def generated(self, seq: Sequence) -> int:
        if seq.state is SeqState.DECODE:
            return seq._gen0 + self._tick - seq._tick0
        return seq._gen0

    def metrics(self) -> EngineMetrics:
        pool = self.pool
        pending = sum(
            seq.prompt_len + seq._gen0 - seq.computed for seq in self.running if seq.state is SeqState.PREFILL
        )
        pending += sum(seq.prompt_len + seq._gen0 for seq in self.waiting)
        return EngineMetrics(
            len(self.waiting), len(self.running), pool.active_blocks, pool.active_blocks / pool.num_blocks, pending
        )

    def cached_prefix_blocks(self, tokens: TokenInput) -> int:
        """Whole blocks of this prompt the pool holds now (what a KV transfer need not send)."""
        packed = pack_tokens(tokens)
        hashes = compute_sequence_hashes(compute_block_hashes(packed, self.block_size))
        return self.pool.cached_prefix(hashes, len(hashes))[0]

    def reset_prefix_cache(self) -> list[KvOp] | None:
        """Drop every cached block, as vLLM's prefix-cache reset does; returns the ops to publish (a
        `Cleared`), or None when refused because requests are in flight."""
        if self.has_work() or not self.pool.clear_cached():
            return None
        ops, self.pool.ops = self.pool.ops, []
        return ops

    # ------------------------------------------------------------------ one pass
    def step(self, now_ms: float) -> PassResult:
        """Run one forward pass starting at ``now_ms``; call only when `has_work`.

        The pass's state changes (allocations, admissions, preemptions) are applied at once; its tokens,
        completions and KV ops are dated ``end_ms``.
        """
        budget = self.config.max_num_batched_tokens
        fast = self._prefilling == 0 and len(self.running) <= budget
        result = self._pass = PassResult(now_ms, now_ms)
        self._preempted_in_pass = False
        ready: list[Sequence] = []  # sequences that emit a token at the end of the pass, in running order
        new_tokens = attended = 0
        if fast:
            decoders = len(self.running)
            context = self._decode_tokens
            budget -= decoders
        else:
            self._materialize_all()
            decoders = context = 0
            for seq in list(self.running):
                if budget <= 0:
                    break
                if seq.state is SeqState.DECODE:
                    budget -= 1
                    decoders += 1
                    context += seq.prompt_len + seq._gen0
                    ready.append(seq)
                elif seq.state is SeqState.PREFILL:
                    before = seq.computed
                    if self._allocate(seq, min(seq.prompt_len + seq._gen0, before + budget)):
                        chunk = seq.computed - before
                        budget -= chunk
                        new_tokens += chunk
                        attended += chunk * (chunk + 2 * before)
                        if seq.computed == seq.prompt_len + seq._gen0:
                            ready.append(seq)
        fresh: list[Sequence] = []
        if self.waiting and budget > 0 and not self._preempted_in_pass:
            added, pairs = self._admit(budget, fresh)
            new_tokens += added
            attended += pairs
        end = now_ms + self.timer.prefill_ms(new_tokens, attended) + self.timer.decode_ms(decoders, context)
        result.end_ms = end
        result.prefill_tokens = new_tokens
        if fast:
            if self._decoding:
                # Every sequence still generating got its token: advance them all at once.
                self._tick += 1
                self._decode_tokens += self._decoding
                self._run_due(end, result)
        else:
            for seq in ready:
                if seq.state is SeqState.DECODE:
                    seq._gen0 += 1
                    self._decode_tokens += 1
                    self._after_token(seq, end, result)
                elif seq.state is SeqState.PREFILL:
                    self._start_decoding(seq, end, result)
        for seq in fresh:
            if seq.state is SeqState.PREFILL and seq.computed == seq.prompt_len + seq._gen0:
                self._start_decoding(seq, end, result)
        for seq in reversed(self.waiting):  # newest last: stop at the first already marked
            if seq.queued:
                break
            seq.queued = True
        if not fast:
            self._rebuild_due()
        pool = self.pool
        if pool.ops:
            result.ops = pool.ops
            pool.ops = []
        return result

    # ------------------------------------------------------------------ quiet passes
    def quiet_passes(self, now_ms: float) -> list[float]:
        """End times of the passes from ``now_ms`` in which nothing but tokens would happen.

        When every running sequence is generating, nothing waits, and no sequence opens a block or
        finishes for a while, the next passes are fully determined and produce nothing anyone else
        sees: a caller may take several at once with `skip_quiet` (fewer than returned if something
        arrives meanwhile). Returns no times when the next pass is not quiet.
        """
        if self.waiting or self._prefilling or not self._due or len(self.running) > self.config.max_num_batched_tokens:
            return []
        quiet = self._due[0][0] - self._tick - 1
        if quiet < 2:
            return []
        decoders = self._decoding
        context = self._decode_tokens
        decode_ms = self.timer.decode_ms
        ends = []
        end = now_ms
        for _ in range(quiet):
            end += decode_ms(decoders, context)
            context += decoders
            ends.append(end)
        return ends

    def skip_quiet(self, passes: int) -> None:
        """Commit ``passes`` of the quiet passes `quiet_passes` returned."""
        self._tick += passes
        self._decode_tokens += passes * self._decoding

    # ------------------------------------------------------------------ scheduling
    def _admit(self, budget: int, fresh: list[Sequence]) -> tuple[int, int]:
        """Admit waiting sequences (head of line) while seats, budget and blocks allow, appending them
        to ``fresh``; returns the prefill tokens scheduled and their attended pairs."""
        pool = self.pool
        block_size = self.block_size
        max_seqs = self.config.max_num_seqs
        waiting = self.waiting
        stats = self.stats
        new_tokens = attended = 0
        while waiting and len(self.running) < max_seqs and budget > 0 and not self._preempted_in_pass:
            seq = waiting[0]
            length = seq.prompt_len + seq._gen0
            # vLLM always computes the last token (it needs its logits), so at most (length - 1) // bs
            # whole blocks can come from the cache.
            cached, cached_active = pool.cached_prefix(seq.hashes, (length - 1) // block_size)
            if -(-length // block_size) - cached_active > pool.free_for_activation:
                break
            waiting.popleft()
            self._orders += 1
            seq.order = self._orders
            seq.state = SeqState.PREFILL
            seq.computed = cached * block_size
            self.running.append(seq)
            self._prefilling += 1
            local = before = seq.computed
            if seq.kv_loaded and seq._gen0 == 0:
                before = length - 1  # the transferred KV: the last token's logits are still to compute
            if not self._allocate(seq, min(length, before + budget)):
                continue  # preempted itself: back at the head of the queue
            if seq.cached_tokens < 0:
                seq.cached_tokens = local
                seq.cached_blocks = cached
                stats.prompt_tokens += seq.prompt_len
                stats.cached_tokens += local
                stats.prompt_blocks += seq.prompt_blocks
                stats.cached_blocks += cached
            fresh.append(seq)
            chunk = seq.computed - before
            attended += chunk * (chunk + 2 * before)
            budget -= chunk
            new_tokens += chunk
        return new_tokens, attended

    def _allocate(self, seq: Sequence, computed_after: int) -> bool:
        """Hold the blocks covering the first ``computed_after`` tokens (preempting others, most
        recent first, when the pool is short) and mark them computed. False when ``seq`` itself was
        preempted."""
        pool = self.pool
        blocks = -(-computed_after // self.block_size)
        full = min(blocks, len(seq.hashes))
        partial = blocks > full and not seq.partial
        while seq.held < full or partial:
            if pool.acquire(seq.hashes, seq.locals, seq.held, full, partial=partial):
                seq.held = full
                seq.partial = seq.partial or partial
                break
            if self._preempt_last() is seq:
                return False
        seq.computed = computed_after
        return True

    def _preempt_last(self) -> Sequence:
        """Free the blocks of the most recently admitted running sequence (vLLM's policy): it goes
        back to the head of the queue to be recomputed, keeping the tokens it generated."""
        self._preempted_in_pass = True
        victim = self.running[-1]
        if victim.state is SeqState.DECODE:
            self._materialize(victim)
            if victim._gen0 >= victim.max_tokens:
                # Its last token came in this very pass: it finishes rather than waits.
                self._finish(victim, self._pass.end_ms, self._pass)
                return victim
            if victim.partial and len(victim.hashes) < (victim.prompt_len + victim._gen0 - 1) // self.block_size:
                # It filled its block in this pass, and its token opening the next is out, though not
                # yet counted: promote the one, report the other (recomputation holds the new block).
                self._promote_tail(victim)
                self._pass.opened_blocks.append(victim)
            self._decoding -= 1
            self._decode_tokens -= victim.prompt_len + victim._gen0
        else:
            self._prefilling -= 1
        self.running.pop()
        self.pool.release(victim.hashes, victim.held, partial=victim.partial)
        victim.held = 0
        victim.partial = False
        victim.computed = 0
        victim.kv_loaded = False
        victim.state = SeqState.WAITING
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    # ------------------------------------------------------------------ tokens
    def _start_decoding(self, seq: Sequence, end_ms: float, result: PassResult) -> None:
        """Prefill (or recomputation) done: ``seq`` emits a token at the end of the pass and generates."""
        seq.state = SeqState.DECODE
        self._prefilling -= 1
        self._decoding += 1
        seq._gen0 += 1
        seq._tick0 = self._tick
        self._decode_tokens += seq.prompt_len + seq._gen0
        if seq._gen0 == 1:
            seq.first_token_ms = end_ms
            result.first_tokens.append(seq)
        self._after_token(seq, end_ms, result)
        if seq.state is SeqState.DECODE:
            self._push_due(seq)

    def _after_token(self, seq: Sequence, end_ms: float, result: PassResult) -> None:
        """Bookkeeping once a (materialized) token is appended: a new block when it opens one, the
        release when it was the last."""
        length = seq.prompt_len + seq._gen0
        done = seq._gen0 >= seq.max_tokens
        if length % self.block_size == 1 or self.block_size == 1:
            if seq.partial:
                self._promote_tail(seq)
            if not done:
                # The token is out whatever follows: a gateway streaming it sees the block open even
                # when holding it preempts this very sequence (its recomputation holds it then).
                result.opened_blocks.append(seq)
                while not self.pool.acquire_partial():
                    if self._preempt_last() is seq:
                        return
                seq.partial = True
        if done:
            self._finish(seq, end_ms, result)

    def _promote_tail(self, seq: Sequence) -> None:
        """The partial block filled up: hash its tokens; it becomes a full, cacheable block."""
        block_size = self.block_size
        have = len(seq._tail) // 4
        tokens = seq._tail + seq._rng.randbytes(4 * (block_size - have))
        seq._tail = b""
        local = compute_block_hashes(tokens, block_size)[0]
        index = len(seq.hashes)
        parent = seq.hashes[index - 1] if index else None
        block_hash = local if parent is None else compute_sequence_hashes([parent, local])[1]
        seq.hashes.append(block_hash)
        seq.locals.append(local)
        self._remember_tokens(block_hash, tokens)
        self.pool.promote(block_hash, local, parent)
        seq.partial = False
        seq.held = index + 1

    def _finish(self, seq: Sequence, end_ms: float, result: PassResult) -> None:
        self.running.remove(seq)
        if seq.state is SeqState.DECODE:
            self._decoding -= 1
            self._decode_tokens -= seq.prompt_len + seq._gen0
        else:
            self._prefilling -= 1
        self.pool.release(seq.hashes, seq.held, partial=seq.partial)
        seq.held = 0
        seq.partial = False
        seq.state = SeqState.FINISHED
        seq.finished_ms = end_ms
        result.finished.append(seq)

    # ------------------------------------------------------------------ lazy token counts
    def _materialize(self, seq: Sequence) -> None:
        seq._gen0 += self._tick - seq._tick0
        seq._tick0 = self._tick

    def _materialize_all(self) -> None:
        for seq in self.running:
            if seq.state is SeqState.DECODE:
                self._materialize(seq)

    def _push_due(self, seq: Sequence) -> None:
        """Schedule the pass at which ``seq`` next opens a block or finishes."""
        length = seq.prompt_len + seq._gen0
        to_block = (1 - length) % self.block_size or self.block_size
        steps = min(to_block, seq.max_tokens - seq._gen0)
        seq._tick0 = self._tick
        seq.due = self._tick + steps
        heapq.heappush(self._due, (seq.due, seq.order, seq))

    def _rebuild_due(self) -> None:
        self._due = []
        for seq in self.running:
            if seq.state is SeqState.DECODE:
                self._push_due(seq)

    def _run_due(self, end_ms: float, result: PassResult) -> None:
        due = self._due
        tick = self._tick
        while due and due[0][0] <= tick:
            _, _, seq = heapq.heappop(due)
            if seq.state is not SeqState.DECODE or seq.due != tick:
                continue  # preempted or finished since it was scheduled
            self._materialize(seq)
            self._after_token(seq, end_ms, result)
            if seq.state is SeqState.DECODE:
                self._push_due(seq)
