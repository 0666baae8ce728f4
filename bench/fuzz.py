"""Long fuzzing runs: millions of mutated requests into the hot routes' handlers and of mutated
payloads into the event decoders, without HTTP in between (the in-CI suite, ``tests/test_fuzz.py``,
also goes through the ASGI fast path and FastAPI's routes).

    nice -n 10 python bench/fuzz.py [--cases 1000000] [--seed 0] [--seeds 2000]

A corpus of ``--seeds`` near-valid inputs is drawn from the same hypothesis strategies as the CI
suite; each case takes one, mutates its bytes (flips, inserts, deletions, truncation, splices of two
seeds) and feeds it to a route's handler (`api.handlers.Handlers`, as every HTTP path calls it), to
``decode_router_events`` + the sequencer, or to the decoders of heartbeats, loads, registrations and
resync replies. A finding is: an exception escaping, a 5xx reply, or a refused request (4xx) that
changed the router's state (workers, per-rank loads, index size, active requests). Prints cases/s,
the count per target, and each distinct finding with the input that caused it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings
from hypothesis.errors import NonInteractiveExampleWarning
from prometheus_client import CollectorRegistry

from api.codec import Call
from api.config import ServiceConfig
from api.eager import Suspended, start
from api.handlers import HOT_PATHS, Handlers
from api.metrics import ApiMetrics
from indexer.errors import EventDecodeError
from indexer.events import ResyncResponse, decode_router_events
from router.config import RouterConfig
from router.event_plane.messages import ActiveLoad, Heartbeat
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.fuzz_inputs import event_payloads, requests, wire_payloads
from tests.test_api_support import prompt, stored_event

_DECODERS: dict[str, Any] = {
    "heartbeat": msgspec.json.Decoder(Heartbeat),
    "load": msgspec.json.Decoder(ActiveLoad),
    "registration": msgspec.json.Decoder(WorkerConfig),
    "resync": msgspec.json.Decoder(ResyncResponse),
}


def corpus(size: int) -> list[tuple[str, bytes, bool]]:
    """(target, payload, msgpack) seeds from the CI suite's strategies."""
    seeds: list[tuple[str, bytes, bool]] = []

    @settings(max_examples=size, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=requests(), event=event_payloads(), kind=wire_payloads("load"), beat=wire_payloads("heartbeat"),
           registration=wire_payloads("registration"), resync=wire_payloads("resync"))  # fmt: skip
    def draw(request: Any, event: bytes, kind: bytes, beat: bytes, registration: bytes, resync: bytes) -> None:
        method, path, body, headers = request
        if path in HOT_PATHS and method == "POST":
            seeds.append((path, body, "msgpack" in headers.get("content-type", "")))
        seeds.append(("events", event, False))
        seeds.extend([("load", kind, False), ("heartbeat", beat, False), ("registration", registration, False),
                      ("resync", resync, False)])  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        draw()
    return seeds


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(6)
        position = rng.randrange(len(buffer) + 1)
        if choice == 0 and buffer:
            buffer[min(position, len(buffer) - 1)] ^= 1 << rng.randrange(8)
        elif choice == 1:
            buffer[position:position] = bytes([rng.choice(b'{}[]",:0123456789-e.ntfalsu\\\x00\xff\xc0\xdc\x91')])
        elif choice == 2 and buffer:
            del buffer[position : position + rng.randint(1, 8)]
        elif choice == 3:
            del buffer[position:]
        elif choice == 4 and other:
            cut = rng.randrange(len(other) + 1)
            buffer[position:] = other[cut:]
        elif choice == 5 and buffer:
            digits = str(rng.choice([0, -1, 1 << 32, 1 << 64, 10**20, (1 << 63) - 1])).encode()
            buffer[position:position] = digits
    return bytes(buffer)


class Target:
    """A router with two workers, a prefix in the index and one booked request, and its handlers."""

    def __init__(self) -> None:
        self.router = KvRouter(RouterConfig(block_size=16), rng=random.Random(0))
        for worker_id in (1, 2):
            self.router.register_worker(WorkerConfig(worker_id=worker_id, total_kv_blocks=100))
        self.router.sequencer.ingest(decode_router_events(msgspec.json.encode(stored_event(1, prompt(1, 64)))))
        service = ServiceConfig(max_prompt_tokens=4096)
        self.handlers = Handlers(self.router, ApiMetrics(CollectorRegistry()), service).routes()

    def fingerprint(self) -> Any:
        router = self.router
        return (tuple(router.workers()), tuple(router.rank_loads()), router.tree.dump_events().__len__())


def run(cases: int, seed: int, seeds: int) -> int:
    rng = random.Random(seed)
    started = time.perf_counter()
    pool = corpus(seeds)
    print(f"corpus: {len(pool)} seeds in {time.perf_counter() - started:.1f} s", flush=True)
    by_target: dict[str, list[tuple[str, bytes, bool]]] = {}
    for entry in pool:
        by_target.setdefault(entry[0], []).append(entry)
    names = sorted(by_target)  # each target as often as any other, whatever its share of the corpus
    target = Target()
    per_target: Counter[str] = Counter()
    findings: dict[str, tuple[str, bytes]] = {}
    began = time.perf_counter()
    for case in range(cases):
        if case % 20_000 == 0 and case:
            target = Target()  # a fresh router now and then: accepted requests pile up bookings
        name, data, msgpack = rng.choice(by_target[rng.choice(names)])
        payload = mutate(rng, data, rng.choice(pool)[1]) if rng.random() < 0.9 else data
        per_target[name] += 1
        try:
            problem = _one(target, name, payload, msgpack)
        except Exception as exc:
            problem = f"{name}: {type(exc).__name__}: {exc}"[:200]
        if problem is not None and problem not in findings:
            findings[problem] = (name, payload)
            print(f"FINDING {problem!r} from {payload[:160]!r}", flush=True)
    elapsed = time.perf_counter() - began
    print(f"{cases} cases in {elapsed:.1f} s: {cases / elapsed:,.0f} cases/s; {len(findings)} findings")
    print("cases per target: " + ", ".join(f"{k} {v}" for k, v in sorted(per_target.items())))
    return 1 if findings else 0


def _one(target: Target, name: str, payload: bytes, msgpack: bool) -> str | None:
    if name in HOT_PATHS:
        before = target.fingerprint()
        outcome = start(target.handlers[name](Call(payload, msgpack=msgpack)))
        if isinstance(outcome, Suspended):  # no queue is configured: a decision never waits
            return f"{name}: decision waited"
        if outcome.status >= 500:
            return f"{name}: {outcome.status} {outcome.body[:120]!r}"
        if outcome.status >= 400 and target.fingerprint() != before:
            return f"{name}: refused with {outcome.status} but changed state"
        return None
    if name == "events":
        try:
            events = decode_router_events(payload, msgpack=None)
        except EventDecodeError:
            return None
        target.router.sequencer.ingest(events)
        return None
    try:
        _DECODERS[name].decode(payload)
    except msgspec.DecodeError:
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=2000, help="corpus size drawn from the hypothesis strategies")
    args = parser.parse_args()
    return run(args.cases, args.seed, args.seeds)


if __name__ == "__main__":
    sys.exit(main())
