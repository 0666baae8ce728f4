"""Seeded, engine-like KV-event streams for differential tests and benchmarks.

Each (worker, dp_rank) behaves like a prefix-caching engine: an LRU cache of fixed capacity that
evicts leaves first, stores a prompt's missing suffix in chunked-prefill pieces chained by
``parent_hash``, and reports removals in batches. Prompts come from Zipf-popular shared prefixes
(some under a LoRA), multi-turn sessions that extend their previous prompt, and unique text. Block
hashes are Dynamo sequence hashes of the local hashes, so they are the same on every worker.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from indexer.events import KvCacheEvent, cleared_event, removed_event, stored_event
from indexer.hashing import compute_sequence_hashes

Worker = tuple[int, int]


@dataclass(frozen=True)
class EventOp:
    worker_id: int
    event: KvCacheEvent


@dataclass(frozen=True)
class WorkerOp:
    kind: str  # "remove_worker" | "clear_all_blocks"
    worker_id: int


@dataclass(frozen=True)
class QueryOp:
    local_hashes: list[int]


Op = EventOp | WorkerOp | QueryOp


@dataclass
class _EngineCache:
    capacity: int
    recency: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    parent: dict[int, int | None] = field(default_factory=dict)
    children: dict[int, int] = field(default_factory=dict)
    next_event_id: int = 1

    def event_id(self) -> int:
        self.next_event_id += 1
        return self.next_event_id - 1

    def drop_all(self) -> None:
        self.recency.clear()
        self.parent.clear()
        self.children.clear()

    def evict(self, needed: int, protected: set[int]) -> list[int]:
        """Evict least-recently-used leaves until ``needed`` blocks fit."""
        evicted: list[int] = []
        while len(self.parent) + needed > self.capacity:
            victim = next(
                (h for h in self.recency if not self.children.get(h) and h not in protected),
                None,
            )
            if victim is None:
                break
            del self.recency[victim]
            up = self.parent.pop(victim)
            self.children.pop(victim, None)
            if up is not None:
                self.children[up] -= 1
            evicted.append(victim)
        return evicted

    def insert(self, block_hash: int, parent: int | None) -> None:
        self.parent[block_hash] = parent
        self.recency[block_hash] = None
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def touch(self, chain: list[int]) -> None:
        for block_hash in reversed(chain):  # parents end up more recent than their leaves
            self.recency.move_to_end(block_hash)


def generate(
    seed: int,
    *,
    workers: int = 8,
    dp_size: int = 2,
    requests: int = 4000,
    capacity: int = 1024,
    groups: int = 24,
    query_every: int = 4,
    query_blocks: int = 64,
    rare_ops: bool = True,
) -> Iterator[Op]:
    rng = random.Random(seed)
    worker_ids: list[int] = []
    while len(worker_ids) < workers:
        kind = rng.random()
        candidate = rng.randrange(1, 1000) if kind < 0.25 else rng.getrandbits(63 if kind < 0.5 else 64)
        if candidate not in worker_ids:
            worker_ids.append(candidate)
    ranks = {w: (range(dp_size) if rng.random() < 0.7 else range(1)) for w in worker_ids}
    slots: list[Worker] = [(w, r) for w in worker_ids for r in ranks[w]]
    caches = {slot: _EngineCache(capacity) for slot in slots}

    def random_blocks(n: int) -> list[int]:
        return [rng.getrandbits(64) for _ in range(n)]

    group_prefixes = [random_blocks(rng.randint(2, 40)) for _ in range(groups)]
    group_weights = [1.0 / (i + 1) for i in range(groups)]
    group_home = {g: rng.choice(slots) for g in range(groups)}
    sessions: list[tuple[list[int], Worker]] = []
    known_prompts: list[list[int]] = []

    for index in range(requests):
        roll = rng.random()
        if roll < 0.35 and sessions:
            s = rng.randrange(len(sessions))
            previous, home = sessions[s]
            prompt = previous + random_blocks(rng.randint(1, 6))
            sessions[s] = (prompt, home)
        elif roll < 0.85:
            g = rng.choices(range(groups), group_weights)[0]
            prompt = group_prefixes[g] + random_blocks(rng.randint(0, 24))
            home = group_home[g]
            if rng.random() < 0.2:
                sessions.append((prompt, home))
        else:
            prompt = random_blocks(rng.randint(1, 48))
            home = rng.choice(slots)
        if len(sessions) > 64:
            sessions.pop(0)
        target = home if rng.random() < 0.75 else rng.choice(slots)
        yield from _serve(caches[target], target, prompt, rng)
        known_prompts.append(prompt)
        if len(known_prompts) > 256:
            known_prompts.pop(0)

        if rare_ops and rng.random() < 0.006:
            yield from _rare_op(rng, slots, caches)
        if index % query_every == 0:
            yield QueryOp(_query(rng, known_prompts, random_blocks, query_blocks))


def _serve(cache: _EngineCache, worker: Worker, prompt: list[int], rng: random.Random) -> Iterator[EventOp]:
    worker_id, dp_rank = worker
    chain = compute_sequence_hashes(prompt)
    cached = 0
    while cached < len(chain) and chain[cached] in cache.parent:
        cached += 1
    missing = len(chain) - cached
    evicted = cache.evict(missing, protected=set(chain[:cached]))
    while evicted:
        cut = rng.randint(1, len(evicted))
        yield EventOp(worker_id, removed_event(cache.event_id(), evicted[:cut], dp_rank=dp_rank))
        evicted = evicted[cut:]
    room = cache.capacity - len(cache.parent)
    end = cached + min(missing, max(room, 0))
    start = cached
    while start < end:
        stop = min(end, start + rng.randint(1, 16))
        parent = chain[start - 1] if start else None
        for position in range(start, stop):
            cache.insert(chain[position], chain[position - 1] if position else None)
        blocks = [(chain[p], prompt[p]) for p in range(start, stop)]
        yield EventOp(worker_id, stored_event(cache.event_id(), blocks, parent_hash=parent, dp_rank=dp_rank))
        start = stop
    cache.touch(chain[:end])


def _rare_op(rng: random.Random, slots: list[Worker], caches: dict[Worker, _EngineCache]) -> Iterator[Op]:
    worker_id, dp_rank = rng.choice(slots)
    roll = rng.random()
    if roll < 0.4:
        cache = caches[(worker_id, dp_rank)]
        cache.drop_all()
        yield EventOp(worker_id, cleared_event(cache.event_id(), dp_rank=dp_rank))
        return
    for slot in slots:
        if slot[0] == worker_id:
            caches[slot].drop_all()
    yield WorkerOp("clear_all_blocks" if roll < 0.7 else "remove_worker", worker_id)


def _query(
    rng: random.Random, known: list[list[int]], random_blocks: Callable[[int], list[int]], limit: int
) -> list[int]:
    roll = rng.random()
    if roll < 0.15 or not known:
        return random_blocks(rng.randint(1, limit))
    prompt = rng.choice(known)[:limit]
    if roll < 0.6:
        return prompt
    keep = rng.randint(1, len(prompt))
    return (prompt[:keep] + random_blocks(rng.randint(1, 16)))[:limit]
