"""The configuration doctor: misconfigurations that make a router silently route at zero hit rate.

`ConfigDoctor.check` looks at the router's state (it is cheap, and runs every few seconds) and returns
the problems that hold now, each with the evidence and the time it was first seen; a problem seen for
the first time is logged once as a WARNING. The kinds:

- ``block_size_mismatch``: a worker registered, or an engine heard directly sent events, with a block
  size other than the router's (its blocks can never match a request's).
- ``tokens_hash_mismatch``: directly, for an engine heard over ZMQ (direct mode; the bridge logs it):
  the engine's own block hashes contradict the tokens hashes we compute from the same events'
  ``token_ids`` (`router.engines.hash_check`: it salts with something its events do not carry, or
  our salt varies where its does not). Indirectly, for any worker: prompts routed to it while its
  events fill the index, yet none of those prompts' first blocks ever shows up among its blocks (a
  cache salt, LoRA name or namespace the requests do not carry, or another tokenizer).
- ``events_not_wired``: a worker has been routed requests for ``routed_for_s`` (a minute) and never
  sent one event (its engine's KV events are not enabled or reach no router), or only events under dp
  ranks it is not registered with (an engine run with external data parallelism stamps its own rank:
  the evidence names it and the registration's ranks); workers in approximate mode send none on
  purpose and are skipped.
- ``stream_gapping``: one of a worker's streams lost events ``gap_threshold`` times within
  ``gap_window_s`` (a lossy network, a full queue, a publisher restarting in a loop).
- ``unregistered_worker``: events arrive from a worker the router does not know (they are dropped).
- ``engine_events_silent``: an engine heard directly with its OpenAI URL answers its health probe and
  has been routed requests for ``engine_silent_after_s`` (30 s), yet its event socket delivered
  nothing: vLLM binds its PUB socket only for ``tcp://*:PORT`` (given a host address it connects, and
  nothing flows, with no error on either side).
- ``engine_down``: an engine heard directly (``--engine``) has been down for ``engine_down_after_s``
  (a minute): with a URL, its server does not answer ``/health`` (the evidence names the URL and the
  last probe's error) or has listed no models; without one, an event socket has no connection. Seen
  nowhere else: a worker never registered is in no list.
- ``eagle_mismatch``: an engine heard directly stores blocks keyed by EAGLE bigrams (SGLang with
  speculative decoding) while the router hashes requests without ``--enable-eagle``, or plain ones
  while it hashes with it: no request can match those blocks.
- ``handoff_unservable``: the fleet routes in two legs and a worker of role ``both`` that hands KV over
  with SGLang's ``bootstrap`` shares a model with another worker: its server runs one disaggregation
  mode, yet it would be sent prefill legs, decode legs and requests prefilled locally.

Routed prompts are sampled (one in ``sample_every``, at most ``max_samples`` kept) and looked up
``sample_delay_s`` later, once the engine has had time to prefill them; the decision path pays one
modulo per request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import msgspec

from indexer.slots import WorkerRank
from router.engines.direct import DirectEngine
from router.engines.zmq_stream import ZmqEngineStream
from router.kv_router import KvRouter
from router.types import WorkerConfig

__all__ = ["KINDS", "ConfigDoctor", "Problem", "RegistrationRefusals"]

log = logging.getLogger(__name__)

KINDS = (
    "block_size_mismatch",
    "tokens_hash_mismatch",
    "events_not_wired",
    "stream_gapping",
    "unregistered_worker",
    "engine_events_silent",
    "engine_down",
    "eagle_mismatch",
    "handoff_unservable",
)


class Problem(msgspec.Struct, kw_only=True, frozen=True):
    kind: str
    worker_id: int | None
    evidence: str
    since: float  # unix seconds when first seen


class RegistrationRefusals(Protocol):
    """Where worker registrations are refused (the event plane, through its lifecycle)."""

    @property
    def refused_registrations(self) -> Mapping[int, str]:
        """Worker -> why its latest registration was refused."""
        ...


class _Tally:
    __slots__ = ("checked", "first", "found")

    def __init__(self, first: float) -> None:
        self.checked = 0
        self.found = 0
        self.first = first


class ConfigDoctor:
    def __init__(
        self,
        router: KvRouter,
        *,
        registrations: RegistrationRefusals | None = None,
        engines: Sequence[DirectEngine] = (),
        clock: Callable[[], float] = time.time,
        routed_for_s: float = 60.0,
        gap_window_s: float = 600.0,
        gap_threshold: int = 3,
        sample_every: int = 16,
        max_samples: int = 1024,
        sample_delay_s: float = 30.0,
        hash_mismatch_after: int = 20,
        engine_silent_after_s: float = 30.0,
        engine_down_after_s: float = 60.0,
    ) -> None:
        self.router = router
        self.registrations = registrations
        self.engines = list(engines)
        self._clock = clock
        self._routed_for_s = routed_for_s
        self._gap_window_s = gap_window_s
        self._gap_threshold = gap_threshold
        self._sample_every = sample_every
        self._sample_delay_s = sample_delay_s
        self._hash_mismatch_after = hash_mismatch_after
        self._engine_silent_after_s = engine_silent_after_s
        self._engine_down_after_s = engine_down_after_s
        self._routed = 0
        self._samples: deque[tuple[float, WorkerRank, int]] = deque(maxlen=max_samples)
        self._first_routed: dict[int, float] = {}
        self._tallies: dict[int, _Tally] = {}
        self._gap_history: dict[WorkerRank, deque[tuple[float, int]]] = {}
        self._since: dict[tuple[str, int | None], float] = {}
        self.problems: list[Problem] = []
        router.routed_observers.append(self._on_routed)

    def _on_routed(self, rank: WorkerRank, local_hashes: list[int]) -> None:
        self._first_routed.setdefault(rank[0], self._clock())
        self._routed += 1
        # Only prompts routed to a rank that already sends events can show whether its hashes match.
        sampled = self._routed % self._sample_every == 1 % self._sample_every
        if sampled and local_hashes and self.router.sequencer.heard_from(*rank):
            self._samples.append((self._clock(), rank, local_hashes[0]))

    # ------------------------------------------------------------------ the checks
    def check(self) -> list[Problem]:
        now = self._clock()
        found: dict[tuple[str, int | None], str] = {}
        self._block_sizes(found)
        self._hashes(now, found)
        self._silent_workers(now, found)
        self._gaps(now, found)
        self._silent_engines(now, found)
        self._down_engines(now, found)
        self._eagle(found)
        self._unservable_handoffs(found)
        for worker_id, count in self.router.sequencer.unknown_worker_events.items():
            if count and not self.router.has_worker(worker_id):
                found["unregistered_worker", worker_id] = (
                    f"{count} events from worker {worker_id}, which is not registered (POST /v1/workers, the config "
                    "file or a publisher's registration); they were dropped"
                )
        problems = []
        for key, evidence in found.items():
            since = self._since.get(key)
            if since is None:
                since = self._since[key] = now
                log.warning("configuration problem %s (worker %s): %s", key[0], key[1], evidence)
            problems.append(Problem(kind=key[0], worker_id=key[1], evidence=evidence, since=since))
        for key in [key for key in self._since if key not in found]:
            del self._since[key]
        self.problems = sorted(problems, key=lambda p: (p.kind, p.worker_id or 0))
        return self.problems

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(KINDS, 0)
        for problem in self.problems:
            counts[problem.kind] += 1
        return counts

    def _block_sizes(self, found: dict[tuple[str, int | None], str]) -> None:
        if self.registrations is not None:
            for worker_id, reason in self.registrations.refused_registrations.items():
                found["block_size_mismatch", worker_id] = f"registration refused: {reason}"
        for worker_id, stream in self._engine_streams():
            count = stream.stats["rejected_block_size_mismatch"]
            if count:
                detail = stream.last_rejection.get("block_size_mismatch", "")
                found["block_size_mismatch", worker_id] = (
                    f"{count} stored events from {stream.endpoint} refused: {detail} (set the router's --block-size "
                    "to the engine's)"
                )

    def _hashes(self, now: float, found: dict[tuple[str, int | None], str]) -> None:
        for worker_id, stream in self._engine_streams():
            count = stream.hash_mismatches
            if count:
                found["tokens_hash_mismatch", worker_id] = (
                    f"{count} stored events from {stream.endpoint} contradict our hashing of their token ids; "
                    f"the latest: {stream.last_hash_mismatch}"
                )
        tree = self.router.tree
        samples = self._samples
        while samples and now - samples[0][0] >= self._sample_delay_s:
            _, rank, first_block = samples.popleft()
            tally = self._tallies.get(rank[0])
            if tally is None:
                tally = self._tallies[rank[0]] = _Tally(now)
            tally.checked += 1
            if tree.find_matches([first_block]).scores.get(rank):
                tally.found += 1
        if not any(t.checked >= self._hash_mismatch_after and not t.found for t in self._tallies.values()):
            return
        held: dict[int, int] = {}
        for (worker_id, _), blocks in tree.stats().blocks.items():
            held[worker_id] = held.get(worker_id, 0) + blocks
        for worker_id, tally in self._tallies.items():
            if tally.found:
                tally.checked = tally.found = 0  # matches seen: start counting afresh
            elif tally.checked >= self._hash_mismatch_after and held.get(worker_id, 0):
                found.setdefault(
                    ("tokens_hash_mismatch", worker_id),
                    f"{tally.checked} prompts routed to worker {worker_id}; none of their first blocks appears among "
                    f"the {held[worker_id]} blocks its events stored: the engine hashes tokens with another cache "
                    "salt, LoRA name or namespace than the requests carry (or another tokenizer, or EAGLE windows "
                    "on one side only: --enable-eagle)",
                )

    def _silent_workers(self, now: float, found: dict[tuple[str, int | None], str]) -> None:
        sequencer = self.router.sequencer
        for worker_id, first in list(self._first_routed.items()):
            worker = self.router.worker(worker_id)
            if worker is None:
                del self._first_routed[worker_id]
                continue
            if not self.router.expects_events(worker):
                continue
            if any(sequencer.heard_from(worker_id, rank) for rank in worker.dp_ranks):
                continue
            if now - first < self._routed_for_s:
                continue
            stamped = sorted(
                (rank, count) for (wid, rank), count in sequencer.unknown_dp_rank_events.items() if wid == worker_id
            )
            if stamped:
                ranks = worker.dp_ranks
                found["events_not_wired", worker_id] = (
                    f"routed requests since {now - first:.0f} s ago; its events are stamped with dp rank "
                    f"{', '.join(str(rank) for rank, _ in stamped[:8])} ({sum(c for _, c in stamped)} refused as "
                    f"unknown_dp_rank) while it is registered with ranks {ranks.start}..{ranks.stop - 1}: an engine "
                    "run with external or hybrid data parallelism (vLLM --data-parallel-rank) stamps its own rank; "
                    + (
                        "a bridge registers its ranks from 0 and cannot take them: read this engine in direct mode "
                        f"(--engine) and register it with dp_start_rank {stamped[0][0]} (POST /v1/workers)"
                        if worker.leased
                        else f"register the worker with dp_start_rank {stamped[0][0]} (POST /v1/workers or the "
                        "config file)"
                    )
                )
            else:
                found["events_not_wired", worker_id] = (
                    f"routed requests since {now - first:.0f} s ago but never sent a KV event: enable the engine's KV "
                    "events (vLLM --kv-events-config, then kv-router bridge or --engine-zmq), or register it with "
                    "kv_events: false for approximate mode"
                )

    def _gaps(self, now: float, found: dict[tuple[str, int | None], str]) -> None:
        counts: dict[WorkerRank, int] = dict(self.router.sequencer.gaps_by_stream)
        for worker_id, stream in self._engine_streams():
            key = (worker_id, stream.dp_rank)
            counts[key] = counts.get(key, 0) + stream.stats["gap"]
        for key, count in counts.items():
            # Gaps counted before the doctor first looked are taken as recent.
            history = self._gap_history.setdefault(key, deque([(now, 0)]))
            history.append((now, count))
            while len(history) > 1 and now - history[1][0] >= self._gap_window_s:
                history.popleft()
            recent = count - history[0][1]
            if recent >= self._gap_threshold:
                found["stream_gapping", key[0]] = (
                    f"dp rank {key[1]} lost events {recent} times in the last {self._gap_window_s:.0f} s "
                    "(a lossy link, full queues or a publisher restarting in a loop)"
                )

    def _silent_engines(self, now: float, found: dict[tuple[str, int | None], str]) -> None:
        for engine in self.engines:
            up_at = engine.up_at
            first = self._first_routed.get(engine.worker_id)
            if up_at is None or first is None or engine.messages > engine.messages_at_up:
                continue
            silent = now - max(up_at, first)
            if silent >= self._engine_silent_after_s:
                endpoint = engine.streams[0].endpoint
                port = endpoint.rpartition(":")[2]
                found["engine_events_silent", engine.worker_id] = (
                    f"its engine answers at {engine.url} and was routed requests {silent:.0f} s ago, but its event "
                    f"socket {endpoint} delivered nothing: vLLM binds its KV-event PUB socket only "
                    f"for an endpoint tcp://*:{port} (given a host address it connects, and nothing flows, with no "
                    f'error): start it with --kv-events-config \'{{"endpoint": "tcp://*:{port}", ...}}\'; '
                    f"and check that {endpoint} is the engine's event port, not its replay port"
                )

    def _down_engines(self, now: float, found: dict[tuple[str, int | None], str]) -> None:
        for engine in self.engines:
            trouble = engine.trouble()
            if trouble is not None and now - trouble[0] >= self._engine_down_after_s:
                since, why = trouble
                found["engine_down", engine.worker_id] = f"down for {now - since:.0f} s: {why}"

    def _eagle(self, found: dict[tuple[str, int | None], str]) -> None:
        eagle = self.router.config.enable_eagle
        for engine in self.engines:
            bigrams = sum(stream.stats["eagle_stores"] for stream in engine.streams)
            plain = engine.sink.stores - bigrams
            endpoint = engine.streams[0].endpoint
            if bigrams and not eagle:
                found["eagle_mismatch", engine.worker_id] = (
                    f"{bigrams} stored events from {endpoint} came as EAGLE bigram token ids (SGLang with speculative "
                    "decoding): their blocks span one token more than the router hashes requests; start the router "
                    "with --enable-eagle"
                )
            elif plain > 0 and eagle:
                found["eagle_mismatch", engine.worker_id] = (
                    f"{plain} stored events from {endpoint} came as plain token ids while the router hashes requests "
                    "with EAGLE windows (--enable-eagle): no request matches them; turn --enable-eagle off unless "
                    "every engine keys its cache by bigrams"
                )

    def _engine_streams(self) -> Iterator[tuple[int, ZmqEngineStream]]:
        """Every direct-mode engine's event streams, one per dp rank, with its worker id."""
        for engine in self.engines:
            for stream in engine.streams:
                yield engine.worker_id, stream

    def _unservable_handoffs(self, found: dict[tuple[str, int | None], str]) -> None:
        if not self.router.disaggregated:
            return
        workers = self.router.workers()
        for worker in workers:
            if worker.role != "both" or worker.handoff != "bootstrap":
                continue
            # Alone for its models it is never paired: every request it gets is prefilled there.
            if any(other is not worker and _share_a_model(worker, other) for other in workers):
                found["handoff_unservable", worker.worker_id] = (
                    "role both with the bootstrap hand-off in a fleet routed in two legs: an SGLang server runs one "
                    "disaggregation mode, so it can serve only that mode's leg, yet it would be sent prefill legs, "
                    "decode legs and requests prefilled locally; register it with role prefill or decode, or with "
                    "another hand-off"
                )


def _share_a_model(one: WorkerConfig, other: WorkerConfig) -> bool:
    """Whether a request may go to either (a worker that lists no models serves any)."""
    return not one.models or not other.models or bool(one.models & other.models)
