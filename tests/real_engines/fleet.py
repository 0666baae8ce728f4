"""kv-router in front of the real engines, as a user runs it: ``kv-router serve --proxy`` as a real
process, in direct mode (``--engine`` per engine) or fed by one ``kv-router bridge`` process per engine
over a real nats-server; the real `openai` client sending a workload through it; and what each
request showed (the router's predicted cached tokens against the engine's reported ones)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from tests.real_engines.engines import BLOCK_SIZE, KV_BLOCKS, MODEL, VllmEngine
from tests.router_processes import RouterProcess, ToolProcess
from tests.waiting import until

__all__ = [
    "Bridge",
    "Call",
    "Outcome",
    "Run",
    "bridge_router",
    "direct_router",
    "drive",
    "ready",
    "workload",
]

MAX_TOKENS = 3
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass(frozen=True)
class Call:
    """One request of a workload: its prompt group (requests of a group share a long prefix), how it is
    asked (``ids``: a completion of token ids; ``text``: a completion of text; ``chat``), and whether
    it streams."""

    index: int
    group: int
    kind: str
    stream: bool
    prefix: list[int] | str
    suffix: list[int] | str
    salt: str | None = None

    def body(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if self.stream else {}
        if self.salt is not None:
            extra["extra_body"] = {"cache_salt": self.salt}
        if self.kind == "chat":
            assert isinstance(self.prefix, str) and isinstance(self.suffix, str)
            messages = [{"role": "system", "content": self.prefix}, {"role": "user", "content": self.suffix}]
            return {"messages": messages, **extra}
        if self.kind == "text":
            assert isinstance(self.prefix, str) and isinstance(self.suffix, str)
            return {"prompt": f"{self.prefix} {self.suffix}", **extra}
        assert isinstance(self.prefix, list) and isinstance(self.suffix, list)
        return {"prompt": [*self.prefix, *self.suffix], **extra}


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


def workload(
    seed: int,
    requests: int,
    groups: int = 16,
    kinds: Sequence[str] = ("ids", "text", "chat"),
    streaming: bool = True,
    salt: str | None = None,
) -> list[Call]:
    """``requests`` calls over ``groups`` prompt groups in a seeded random order, every other one
    streamed (with ``streaming``). Each group's prefix is about ten blocks (16 groups: the whole of one
    engine's cache), each call's suffix its own, so that a prompt is never wholly cached (vLLM then
    recomputes its last token and reports one block less)."""
    rng = random.Random(seed)
    prefixes: list[tuple[str, list[int] | str]] = []
    for group in range(groups):
        kind = kinds[group % len(kinds)]
        if kind == "ids":
            prefixes.append((kind, [rng.randrange(10, 5990) for _ in range(10 * BLOCK_SIZE)]))
        else:
            prefixes.append((kind, _words(rng, 230)))
    calls = []
    for index in range(requests):
        group = rng.randrange(groups)
        kind, prefix = prefixes[group]
        suffix: list[int] | str
        # One to three blocks of its own: with 16 groups, the suffixes make the engines evict.
        suffix = [rng.randrange(10, 5990) for _ in range(rng.randint(40, 100))] if kind == "ids" else _words(rng, 60)
        calls.append(Call(index, group, kind, streaming and index % 2 == 1, prefix, suffix, salt))
    return calls


@dataclass
class Outcome:
    """What one call showed: the worker the router chose and its predicted cached tokens (the proxy's
    headers), the engine's reported ones (``usage.prompt_tokens_details.cached_tokens``)."""

    call: Call
    worker: int
    predicted: int
    cached: int
    prompt_tokens: int
    started: float
    ended: float
    text: str

    @property
    def exact(self) -> bool:
        return self.predicted == self.cached


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        prompt = sum(outcome.prompt_tokens for outcome in self.outcomes)
        return sum(outcome.cached for outcome in self.outcomes) / prompt if prompt else 0.0

    @property
    def agreement(self) -> float:
        return sum(outcome.exact for outcome in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    def misses(self) -> Iterator[tuple[Outcome, str]]:
        """Each call whose prediction differed from the engine's report, with the likely reason."""
        for outcome in self.outcomes:
            if not outcome.exact:
                yield outcome, self.reason(outcome)

    def reason(self, miss: Outcome) -> str:
        same_worker = [
            other
            for other in self.outcomes
            if other is not miss and other.worker == miss.worker and other.started < miss.started < other.ended
        ]
        # Calls started together reach the engine in any order: one started a moment after the miss may
        # be scheduled first and store the prefix the miss then finds.
        alongside = [
            other
            for other in self.outcomes
            if other is not miss
            and other.worker == miss.worker
            and other.started < miss.ended
            and miss.started < other.ended
        ]
        if miss.cached > miss.predicted and any(other.call.group == miss.call.group for other in alongside):
            return "in-flight prefix: a request of the same group ran on the worker at the same time"
        just_before = [
            other
            for other in self.outcomes
            if other.worker == miss.worker
            and other.call.group == miss.call.group
            and 0 <= miss.started - other.ended < 1.0
        ]
        if miss.cached > miss.predicted and just_before:
            return (
                "events in flight: a request of the same group had just ended on the worker, its blocks not yet indexed"
            )
        if miss.cached < miss.predicted and same_worker:
            return "eviction race: the worker evicted blocks for a request in flight after the decision"
        if miss.cached < miss.predicted and any(
            other.worker == miss.worker and 0 <= miss.started - other.ended < 1.0 for other in self.outcomes
        ):
            return "events in flight: a request had just ended on the worker, the blocks it evicted still indexed"
        if miss.cached > miss.predicted and same_worker:
            return "in-flight request: the worker stored blocks the index had not heard of at the decision"
        on_worker = [other for other in self.outcomes if other.worker == miss.worker and other is not miss]
        nearby = sorted((o for o in on_worker if abs(o.started - miss.started) < 2), key=lambda o: o.started)
        seen = ", ".join(
            f"#{o.call.index} group {o.call.group} {o.started - miss.started:+.3f}..{o.ended - miss.started:+.3f} s"
            for o in nearby
        )
        return f"unexplained: nothing else was in flight on the worker (its calls within 2 s: {seen})"

    def report(self, title: str) -> str:
        lines = [
            f"{title}: {len(self.outcomes)} requests, predicted == reported on "
            f"{sum(o.exact for o in self.outcomes)} ({self.agreement:.1%}), hit rate {self.hit_rate:.1%}, "
            f"per worker {self.per_worker()}"
        ]
        for miss, reason in self.misses():
            lines.append(
                f"  miss #{miss.call.index} ({miss.call.kind}{', stream' if miss.call.stream else ''}, group "
                f"{miss.call.group}) on worker {miss.worker}: predicted {miss.predicted}, "
                f"engine {miss.cached}: {reason}"
            )
        lines += [f"  failed: {failure}" for failure in self.failures]
        return "\n".join(lines)

    def per_worker(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for outcome in self.outcomes:
            counts[outcome.worker] = counts.get(outcome.worker, 0) + 1
        return dict(sorted(counts.items()))


async def send(client: openai.AsyncOpenAI, call: Call) -> Outcome:
    """One call through the proxy with the real `openai` client, streamed or not."""
    started = time.monotonic()
    create: Any = (
        client.chat.completions.with_raw_response.create
        if call.kind == "chat"
        else client.completions.with_raw_response.create
    )
    raw = await create(model=MODEL, max_tokens=MAX_TOKENS, stream=call.stream, **call.body())
    usage = None
    text = ""
    if call.stream:
        async for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += (choice.delta.content or "") if call.kind == "chat" else choice.text
    else:
        answer = raw.parse()
        usage = answer.usage
        text = answer.choices[0].message.content if call.kind == "chat" else answer.choices[0].text
    assert usage is not None and usage.prompt_tokens_details is not None, f"no usage details: {usage}"
    return Outcome(
        call=call,
        worker=int(raw.headers["x-kv-router-worker"]),
        predicted=int(raw.headers["x-kv-router-cached-tokens"]),
        cached=usage.prompt_tokens_details.cached_tokens or 0,
        prompt_tokens=usage.prompt_tokens,
        started=started,
        ended=time.monotonic(),
        text=text or "",
    )


async def drive(
    url: str,
    calls: Iterable[Call],
    concurrency: int,
    run: Run | None = None,
    after: Callable[[Outcome], Awaitable[None]] | None = None,
) -> Run:
    """The calls in order, ``concurrency`` at a time, through the proxy at ``url``; a call that fails
    is recorded, never retried by the client (``max_retries=0``: the proxy's retries only). ``run``:
    where the outcomes go as they come (to watch a run in progress); ``after``: awaited after each
    answer (at concurrency 1: until the router has heard what the engines published)."""
    run = run if run is not None else Run()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    pending = iter(calls)

    async def worker() -> None:
        for call in pending:
            try:
                outcome = await send(client, call)
            except openai.APIError as exc:
                run.failures.append(f"#{call.index}: {type(exc).__name__}: {exc}")
                continue
            run.outcomes.append(outcome)
            if after is not None:
                await after(outcome)

    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 600)
    finally:
        await client.close()
    run.outcomes.sort(key=lambda outcome: outcome.call.index)
    return run


def engine_spec(engine: VllmEngine, with_v1: bool) -> str:
    url = engine.url + ("/v1" if with_v1 else "")
    return f"{engine.worker_id}={engine.events},replay={engine.replay},url={url}"


def direct_router(
    log_dir: Path, nats_url: str, engines: Sequence[VllmEngine], *extra: str, policy: str | None = None
) -> RouterProcess:
    """``kv-router serve --proxy`` hearing each engine's events itself: one ``--engine`` per engine
    (events, replay and OpenAI URL; one given with ``/v1``, one without); the default policy unless
    ``policy`` names another."""
    args = ["--proxy", "--block-size", str(BLOCK_SIZE), "--nats-url", nats_url]
    if policy is not None:
        args += ["--policy", policy]
    for position, engine in enumerate(engines):
        args += ["--engine", engine_spec(engine, with_v1=position % 2 == 0)]
    return RouterProcess(log_dir, *args, *extra).start()


class Bridge(ToolProcess):
    """One ``kv-router bridge`` process next to an engine, publishing its events on NATS and registering
    its OpenAI URL (the engine's models asked from its ``/v1/models``); ``flags``: more of its options
    (``--role prefill --handoff ...``)."""

    def __init__(self, log_dir: Path, nats_url: str, engine: VllmEngine, *flags: str) -> None:
        self.engine = engine
        super().__init__(
            log_dir, None,
            "--worker-id", str(engine.worker_id),
            "--zmq-endpoint", engine.events, "--replay-endpoint", engine.replay, "--engine", "vllm",
            "--block-size", str(BLOCK_SIZE), "--total-kv-blocks", str(KV_BLOCKS),
            "--engine-metrics-url", f"{engine.url}/metrics", "--openai-url", engine.url,
            "--nats-url", nats_url, *flags,
            command="bridge",
        )  # fmt: skip


def proxied_workers(router: RouterProcess) -> set[int]:
    """The workers the proxy can send to: registered with an OpenAI URL."""
    workers = router.get("/v1/workers")["workers"]
    return {worker["config"]["worker_id"] for worker in workers if worker["config"].get("url")}


def ready(router: RouterProcess, workers: set[int]) -> RouterProcess:
    """Until the router proxies to ``workers`` and has replayed what their engines published."""

    def listening() -> bool:
        listed = router.get("/v1/workers")["workers"]
        streams = [stream for worker in listed for stream in worker["event_streams"]]
        return proxied_workers(router) == workers and all(
            stream["trusted"] and not stream["resyncing"] for stream in streams
        )

    until(listening, 60)
    return router


def bridge_router(log_dir: Path, nats_url: str, *extra: str) -> RouterProcess:
    """``kv-router serve --proxy`` fed over NATS (by `Bridge` processes)."""
    return RouterProcess(log_dir, "--proxy", "--block-size", str(BLOCK_SIZE), "--nats-url", nats_url, *extra).start()
