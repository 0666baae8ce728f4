"""Generated workloads in Mooncake's row format, seeded: for the demo, the tests and `kv-router replay
--workload NAME`.

Every generator returns rows sorted by arrival. Prompts are built from ``trace_block_size``-token
blocks the way the real traces are (see `mocker.tokens`): a conversation's next prompt repeats the
previous one's block ids and extends them, so two prompts share exactly the tokens of their common
context.

- `shared_prefix_rows`: ``groups`` long prefixes (system prompts, documents) shared by requests whose
  group is drawn with popularity ∝ 1 / rank, each adding a question of its own; Poisson arrivals. Like
  SGLang's generated-shared-prefix benchmark, but skewed, so affinity and balance pull against each other.
- ``agentic`` (`agentic_rows`): multi-tenant agents. Each tenant has a long system prompt (tools and
  instructions, 4-16k tokens, popularity ∝ 1 / rank); sessions start as a Poisson process and run a
  few to a dozen turns, each turn sending the whole context so far (the previous prompt, the previous
  answer, a tool result or user message) and generating a tool call or an answer. Contexts grow to
  tens of thousands of tokens; a turn follows the previous one's answer after a think time.
- ``rag`` (`rag_rows`): retrieval-augmented generation. One instruction prefix, then the retrieved
  documents in order of relevance (a popular corpus: the most relevant document of a query is drawn
  with popularity ∝ 1 / rank^1.1, so a few documents are hot), then the question; long answers.
- ``bursty`` (`bursty_rows`): a mix of batch jobs (bursts of a hundred or more requests within a few
  seconds that share a job template, long outputs), chat sessions (short system prompt, growing
  context) and short one-off prompts, over a steady background.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from mocker.trace import Row

__all__ = ["WORKLOADS", "agentic_rows", "bursty_rows", "rag_rows", "shared_prefix_rows"]


def shared_prefix_rows(
    *,
    requests: int = 300,
    groups: int = 24,
    prefix_tokens: int = 4096,
    question_tokens: int = 384,
    output_tokens: int = 64,
    rate_per_s: float = 6.0,
    trace_block_size: int = 512,
    seed: int = 0,
) -> list[Row]:
    rng = random.Random(seed)
    prefix_blocks = -(-prefix_tokens // trace_block_size)
    question_blocks = -(-question_tokens // trace_block_size)
    weights = [1.0 / (rank + 1) for rank in range(groups)]
    next_id = groups * prefix_blocks
    rows: list[Row] = []
    now_ms = 0.0
    for _ in range(requests):
        group = rng.choices(range(groups), weights)[0]
        ids = [group * prefix_blocks + k for k in range(prefix_blocks)]
        # The question starts after the prefix's last (possibly partial) block: fresh blocks of its own.
        ids += range(next_id, next_id + question_blocks)
        next_id += question_blocks
        length = prefix_blocks * trace_block_size + question_tokens
        rows.append((round(now_ms), length, output_tokens, ids))
        now_ms += rng.expovariate(rate_per_s) * 1000.0
    return rows


class _Context:
    """A growing prompt: block ids and a token count; appending fills the partial last block first
    (its tokens extend the block's, see `mocker.tokens`), then takes fresh blocks."""

    __slots__ = ("_blocks", "ids", "tokens")

    def __init__(self, blocks: _Blocks, ids: list[int] | None = None, tokens: int = 0) -> None:
        self._blocks = blocks
        self.ids = list(ids or [])
        self.tokens = tokens

    def extend(self, tokens: int) -> None:
        self.tokens += tokens
        missing = -(-self.tokens // self._blocks.size) - len(self.ids)
        if missing > 0:
            self.ids += self._blocks.fresh(missing)

    def copy(self) -> _Context:
        return _Context(self._blocks, self.ids, self.tokens)

    def row(self, at_ms: float, output_tokens: int) -> Row:
        return (round(at_ms), self.tokens, output_tokens, list(self.ids))


class _Blocks:
    """Hands out block ids never used before."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def fresh(self, count: int) -> list[int]:
        start = self._next
        self._next += count
        return list(range(start, start + count))

    def whole(self, tokens: int) -> _Context:
        """A new context of ``tokens`` tokens in whole blocks (a shared prefix others extend)."""
        context = _Context(self)
        context.extend(-(-tokens // self.size) * self.size)
        return context


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _sorted(rows: list[Row]) -> list[Row]:
    rows.sort(key=lambda row: row[0])
    return rows


def agentic_rows(
    *, sessions: int = 420, rate_per_s: float = 1.6, trace_block_size: int = 512, seed: int = 0
) -> list[Row]:
    """Multi-tenant agentic sessions (see the module doc); about 6 turns per session on average."""
    rng = random.Random(seed)
    blocks = _Blocks(trace_block_size)
    tenants = 24
    system_prompts = [blocks.whole(rng.randrange(4096, 16385, 512)) for _ in range(tenants)]
    weights = _zipf_weights(tenants, 1.0)
    rows: list[Row] = []
    start_ms = 0.0
    for _ in range(sessions):
        start_ms += rng.expovariate(rate_per_s) * 1000.0
        context = system_prompts[rng.choices(range(tenants), weights)[0]].copy()
        context.extend(_lognormal(rng, 600, 0.6, 64, 4096))  # the task
        turns = min(16, 1 + int(rng.expovariate(1 / 5.0)))
        at_ms = start_ms
        for turn in range(turns):
            final = turn == turns - 1
            output = _lognormal(rng, 400 if final else 120, 0.5, 16, 2048)
            rows.append(context.row(at_ms, output))
            # The next turn comes after this answer (about 25 ms a token) and a tool run or think time.
            at_ms += output * 25.0 + rng.expovariate(1 / 3000.0)
            context.extend(output + _lognormal(rng, 900, 0.8, 32, 8192))
    return _sorted(rows)


def rag_rows(*, requests: int = 2400, rate_per_s: float = 5.0, trace_block_size: int = 512, seed: int = 0) -> list[Row]:
    """Retrieval-augmented queries over a corpus with hot documents (see the module doc)."""
    rng = random.Random(seed)
    blocks = _Blocks(trace_block_size)
    instructions = blocks.whole(1024)
    corpus = 400
    documents = [rng.randrange(1024, 6145, 512) for _ in range(corpus)]
    weights = _zipf_weights(corpus, 1.1)
    chains: dict[tuple[int, ...], _Context] = {}
    rows: list[Row] = []
    at_ms = 0.0
    for _ in range(requests):
        at_ms += rng.expovariate(rate_per_s) * 1000.0
        context = instructions.copy()
        retrieved: list[int] = []
        for _ in range(rng.randint(2, 4)):
            document = rng.choices(range(corpus), weights)[0]
            if document not in retrieved:
                retrieved.append(document)
        # The same documents in the same order are the same tokens: one chain per order, extended.
        for depth in range(1, len(retrieved) + 1):
            key = tuple(retrieved[:depth])
            found = chains.get(key)
            if found is None:
                found = chains[key] = context.copy()
                found.extend(documents[key[-1]])
            context = found
        context = context.copy()
        context.extend(_lognormal(rng, 120, 0.6, 16, 1024))
        rows.append(context.row(at_ms, _lognormal(rng, 350, 0.5, 32, 2048)))
    return _sorted(rows)


def bursty_rows(*, duration_s: float = 600.0, trace_block_size: int = 512, seed: int = 0) -> list[Row]:
    """Batch bursts, chat sessions and short prompts (see the module doc)."""
    rng = random.Random(seed)
    blocks = _Blocks(trace_block_size)
    end_ms = duration_s * 1000.0
    rows: list[Row] = []
    # Batch jobs: a template (instructions and examples) and one item per request, all within seconds.
    at_ms = rng.expovariate(1 / 45_000.0)
    while at_ms < end_ms:
        template = blocks.whole(rng.randrange(1024, 6145, 512))
        spread_ms = rng.uniform(500.0, 4000.0)
        for _ in range(rng.randint(60, 220)):
            item = template.copy()
            item.extend(_lognormal(rng, 700, 0.6, 64, 4096))
            rows.append(item.row(at_ms + rng.uniform(0.0, spread_ms), _lognormal(rng, 300, 0.5, 32, 1536)))
        at_ms += rng.expovariate(1 / 60_000.0)
    # Chat sessions: a short system prompt shared by every chat, then turns of growing context.
    chat_system = blocks.whole(512)
    at_ms = 0.0
    while True:
        at_ms += rng.expovariate(0.5) * 1000.0
        if at_ms >= end_ms:
            break
        context = chat_system.copy()
        turn_ms = at_ms
        for _ in range(1 + int(rng.expovariate(1 / 4.0))):
            context.extend(_lognormal(rng, 250, 0.8, 8, 4096))
            output = _lognormal(rng, 250, 0.6, 8, 1536)
            rows.append(context.row(turn_ms, output))
            turn_ms += output * 25.0 + rng.expovariate(1 / 15_000.0)
            context.extend(output)
    # Short one-off prompts.
    at_ms = 0.0
    while True:
        at_ms += rng.expovariate(2.0) * 1000.0
        if at_ms >= end_ms:
            break
        short = _Context(blocks)
        short.extend(_lognormal(rng, 200, 0.7, 8, 2048))
        rows.append(short.row(at_ms, _lognormal(rng, 60, 0.6, 4, 512)))
    return _sorted(rows)


# `kv-router replay --workload NAME --seed N`: each generator called with ``seed`` only.
WORKLOADS: dict[str, Callable[..., list[Row]]] = {
    "agentic": agentic_rows,
    "rag": rag_rows,
    "bursty": bursty_rows,
}
