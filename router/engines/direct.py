"""Direct mode: the router hears an engine's ZMQ events itself, without NATS or a bridge.

`SequencerSink` numbers each rank's events from 1, as a publisher would, and hands them to the
router's one door (``router.sequencer.ingest``). An engine restart becomes a ``cleared`` barrier per
storage tier the rank used; an unrepairable gap marks the stream untrusted in the sequencer (shown
in ``/v1/workers`` and ``kv_router_worker_stream_trusted``) until the engine clears or restarts.

A worker the router does not know yet is registered with default capacity and a WARNING, so its
first events are not refused; ``POST /v1/workers`` can then give its real settings (the index is kept).
A worker removed (``DELETE /v1/workers``) while its engine publishes is registered again by its next
event, its ranks numbered afresh from 1 and rebuilt from the engine's replay buffer when it has one
(without one, unverified until the engine clears or restarts).
An engine given with its OpenAI URL (``url=``) is registered with it instead, for the proxy, with its
models (after a removal too: its next event registers it so), and follows its engine's health
(`DirectEngine`); while it answers, its ``/metrics`` are scraped for its load (KV usage, waiting and
running requests) and, from vLLM, its KV blocks per rank, which its registration takes when it has no
capacity of its own.

A configured engine that is down is never silent (`DirectEngine.trouble`): with a URL, while its server
does not answer (or has not been routable yet); without one, while an event socket has no connection.
It is a WARNING every `DOWN_WARNING_EVERY_S` while it lasts, the doctor's ``engine_down`` and
``kv_router_engine_up`` 0; an engine without a URL that has sent no event by then is a WARNING, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from indexer.engine_events import (
    EngineCleared,
    EngineEvent,
    EngineOffloaded,
    EngineRemoved,
    EngineStored,
    event_tier,
    resolve_offloaded,
    to_kv_event,
)
from indexer.errors import KvIndexError
from indexer.events import RouterEvent, StorageTier, cleared_event
from indexer.held_blocks import HeldBlocks
from router.engines.engine_metrics import EngineMetricsScraper
from router.engines.engine_spec import EngineSpec, parse_engine_spec
from router.engines.hash_check import TokensHashCheck
from router.engines.openai_server import (
    ENGINE_FAILURES_TO_DOWN,
    ENGINE_HEALTH_TIMEOUT_SECS,
    HealthProbe,
    health_url,
    wait_for_models,
)
from router.engines.zmq_stream import PayloadApplied, ZmqEngineStream
from router.errors import ConfigError, UnknownWorker
from router.event_plane.messages import ActiveLoad
from router.kv_router import KvRouter
from router.supervision import Supervisor
from router.types import WorkerConfig

__all__ = ["AdoptedBlockSize", "DirectEngine", "SequencerSink", "ensure_registered"]

log = logging.getLogger(__name__)

# How long an engine that answers waits for its event socket's subscription before it is routable.
JOIN_TIMEOUT_S = 2.0
# A configured engine that stays down is told in a WARNING this often while it does: once is lost in a
# start-up's log, one per probe would flood it. One without a URL that sent nothing by then, once.
DOWN_WARNING_EVERY_S = 60.0


def ensure_registered(router: KvRouter, worker_id: int, source: str, dp_size: int = 1) -> None:
    """Register a worker first heard from its events, with default capacity and a WARNING."""
    if not router.has_worker(worker_id):
        log.warning(
            "%s events from worker %d, which is not registered: registering it with default capacity "
            "(POST /v1/workers or the config file to set its capacity and taints)",
            source,
            worker_id,
        )
        router.register_worker(
            WorkerConfig(worker_id=worker_id, block_size=router.config.block_size, dp_size=dp_size, leased=False)
        )


class SequencerSink:
    def __init__(self, router: KvRouter, worker_id: int, *, accepting: bool = True, dp_size: int = 1) -> None:
        self.router = router
        self.worker_id = worker_id
        self.dp_size = dp_size
        # False while the engine is known down (direct mode with a URL): its events are dropped.
        self.accepting = accepting
        self.dropped_events = 0
        self.stores = 0  # stored events applied (the doctor sets them against the streams' EAGLE stores)
        # Hashes of token-less lower-tier stores (offloads) naming no device block the rank holds: skipped.
        self.offloaded_unresolved = 0
        self._last_id: dict[int, int] = {}
        self._tiers: dict[int, set[StorageTier]] = {}
        # What the engine holds, for its copies of one block (vLLM stores a hash again for another
        # request): a removal reaches the index only once the last copy goes, as on the bridge.
        self._held = HeldBlocks(worker_id)
        # Told when the worker turns out removed (DELETE /v1/workers) while its engine kept publishing.
        self.on_removed: Callable[[], None] | None = None
        # Registers the worker when its events come while it is not (None: `ensure_registered`'s default).
        self.register: Callable[[], None] | None = None

    def reset(self) -> None:
        """The worker was removed: its streams start again from id 1."""
        self._last_id.clear()
        self._tiers.clear()
        self._held = HeldBlocks(self.worker_id)

    def _ensure_registered(self) -> None:
        if self.router.has_worker(self.worker_id):
            return
        if self._last_id:
            # The sequencer forgot its streams with it: numbered on, they would never be trusted again.
            self.reset()
            if self.on_removed is not None:
                self.on_removed()
        if self.register is None:
            ensure_registered(self.router, self.worker_id, "engine", self.dp_size)
        else:
            self.register()

    def _next_id(self, dp_rank: int) -> int:
        event_id = self._last_id.get(dp_rank, 0) + 1
        self._last_id[dp_rank] = event_id
        return event_id

    def batch(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # each batch reaches the sequencer as it is applied

    def apply(self, dp_rank: int, events: list[EngineEvent]) -> None:
        if not self.accepting:
            self.dropped_events += len(events)
            return
        self._ensure_registered()
        tiers = self._tiers.get(dp_rank)
        if tiers is None:
            tiers = self._tiers[dp_rank] = set()
            self._check_rank(dp_rank)
        batch: list[RouterEvent] = []
        for event in events:
            tier = event_tier(event)
            tiers.add(tier)
            self.stores += isinstance(event, EngineStored)
            if isinstance(event, EngineOffloaded):
                # Resolved against the blocks this sink holds for the engine (the device stores before
                # it in the batch included), as the bridge's publisher does.
                device = self._held.tables.get((dp_rank, StorageTier.DEVICE), {})
                stores, unresolved = resolve_offloaded(event, device.get)
                self.offloaded_unresolved += len(unresolved)
                resolved: list[EngineStored | EngineRemoved | EngineCleared] = list(stores)
            else:
                resolved = [event]
            for one in resolved:
                held = self._hold(dp_rank, one)
                if held is not None:
                    batch.append(RouterEvent(self.worker_id, to_kv_event(held, self._next_id(dp_rank), dp_rank), tier))
        self.router.sequencer.ingest(batch)

    def _check_rank(self, dp_rank: int) -> None:
        """A rank first heard that the worker does not have: every event of it will be refused."""
        worker = self.router.worker(self.worker_id)
        if worker is not None and dp_rank not in worker.dp_ranks:
            log.warning(
                "engine events of worker %d are stamped with dp rank %d, but it is registered with ranks %d..%d: they "
                "are refused (unknown_dp_rank). An engine run with external or hybrid data parallelism (vLLM "
                "--data-parallel-rank) stamps its own rank: register the worker with dp_start_rank %d (POST "
                "/v1/workers or the config file)",
                self.worker_id,
                dp_rank,
                worker.dp_ranks.start,
                worker.dp_ranks.stop - 1,
                dp_rank,
            )

    def _hold(
        self, dp_rank: int, event: EngineStored | EngineRemoved | EngineCleared
    ) -> EngineStored | EngineRemoved | EngineCleared | None:
        """``event`` as the index must hear it, the engine's copies counted: a removal of copies while
        another is held is dropped (None), or leaves out their hashes."""
        if type(event) is EngineStored:
            with contextlib.suppress(KvIndexError):  # the index refuses it alike, and counts it
                self._held.store(dp_rank, event.tier, event.parent_hash, event.block_hashes, event.tokens_hashes)
        elif type(event) is EngineRemoved:
            forwarded = self._held.remove(dp_rank, event.tier, event.block_hashes)
            if event.block_hashes and not forwarded:
                return None
            if forwarded is not event.block_hashes:
                return EngineRemoved(forwarded, event.tier)
        else:
            self._held.clear(dp_rank, StorageTier.DEVICE)
        return event

    async def restarted(self, dp_rank: int) -> None:
        if not self.accepting:
            return
        self._ensure_registered()
        tiers = self._tiers.get(dp_rank) or {StorageTier.DEVICE}
        for tier in self._held.tiers(dp_rank):
            self._held.clear(dp_rank, tier)
        self.router.sequencer.ingest(
            RouterEvent(self.worker_id, cleared_event(self._next_id(dp_rank), dp_rank=dp_rank), tier)
            for tier in sorted(tiers | {StorageTier.DEVICE})
        )

    def unverified(self, dp_rank: int, reason: str) -> None:
        if not self.accepting:
            return
        self.router.sequencer.mark_untrusted(self.worker_id, dp_rank)

    def apply_payload(
        self, payload: bytes, block_size: int, cache_namespace: str | None, default_rank: int, check: TokensHashCheck
    ) -> PayloadApplied | None:
        return None  # the stream decodes each batch and `apply`s its events

    def holds(self, dp_rank: int, block_hash: int) -> bool:
        return self._held.holds(dp_rank, block_hash)


class AdoptedBlockSize:
    """``--block-size auto``: the first engine's stored event decides the router's block size; an
    engine that names another is refused loudly (an ERROR, then its stores counted and reported as
    ``block_size_mismatch``)."""

    def __init__(self, router: KvRouter) -> None:
        self.router = router
        self.decided_by: str | None = None

    def for_engine(self, endpoint: str) -> Callable[[int], int]:
        def adopt(engine_block_size: int) -> int:
            if self.decided_by is None:
                try:
                    self.router.adopt_block_size(engine_block_size)
                except ConfigError as exc:  # undecided: the next engine's first store tries again
                    log.error("--block-size auto: the engine at %s uses %d: %s", endpoint, engine_block_size, exc)
                else:
                    self.decided_by = endpoint
                    log.info("--block-size auto: the engine at %s decided %d", endpoint, engine_block_size)
            elif engine_block_size != self.router.config.block_size:
                log.error(
                    "--block-size auto: the engine at %s uses %d tokens per block, the engine at %s %d: its blocks are "
                    "refused (start every engine with one --block-size)",
                    endpoint,
                    engine_block_size,
                    self.decided_by,
                    self.router.config.block_size,
                )
            return self.router.config.block_size

        return adopt


class DirectEngine:
    """One ``--engine`` source feeding the router's sequencer.

    With a ``url`` the engine's OpenAI server is probed (``/health`` every ``health_interval_s``, each
    answer within ``health_timeout_s``): the
    worker is registered (with its URL and the models its ``/v1/models`` lists) when the server first
    answers, removed (its blocks, streams and requests) when it fails three probes in a row or refuses a
    connection (`ENGINE_FAILURES_TO_DOWN`), and registered again,
    empty, when it answers again; its events are then taken afresh (replayed from the engine's buffer
    when it has a replay socket). Events heard while the engine is down are dropped and counted.
    """

    def __init__(
        self,
        router: KvRouter,
        spec: EngineSpec | str,
        *,
        topic: str = "",
        health_interval_s: float = 1.0,
        health_timeout_s: float = ENGINE_HEALTH_TIMEOUT_SECS,
        block_sizes: AdoptedBlockSize | None = None,
    ) -> None:
        self.spec = parse_engine_spec(spec) if isinstance(spec, str) else spec
        self.router = router
        self.worker_id = self.spec.worker_id
        self.url = self.spec.url
        self.sink = SequencerSink(router, self.worker_id, accepting=self.url is None, dp_size=self.spec.dp_size)
        self.sink.on_removed = self._removed
        if self.url is not None:
            # Removed (DELETE /v1/workers) while its engine answers: the engine is still given with --engine
            # and passes its probe, which tells only transitions, so nothing else would register it again.
            # Registered bare (no URL, no models) it would be routable by the decision API yet never sent a
            # proxied request; kept out, it would wait for its engine to fail. It comes back whole.
            self.sink.register = self._registered_again
        # One stream per dp rank (vLLM: a publisher per rank, on consecutive ports).
        self.streams = [
            ZmqEngineStream(
                self.sink,
                endpoint,
                block_size=router.config.block_size,
                dp_rank=rank,
                replay_endpoint=replay,
                topic=topic,
                adopt_block_size=None if block_sizes is None else block_sizes.for_engine(endpoint),
            )
            for rank, endpoint, replay in self.spec.rank_endpoints()
        ]
        self.health = (
            None
            if self.url is None
            else HealthProbe(
                health_url(self.url),
                on_up=self._up,
                on_down=self._down,
                interval_s=health_interval_s,
                timeout_s=health_timeout_s,
                failures_to_down=ENGINE_FAILURES_TO_DOWN,
                down_when_refused=True,
            )
        )
        self.models: tuple[str, ...] | None = self.spec.models
        # The engine's /metrics while it answers: its load, and its KV blocks when it states them.
        self.scraper: EngineMetricsScraper | None = None
        self._metrics_interval_s = health_interval_s
        # Unix time of the health answer that made it routable (None: down, or no URL), and how many
        # messages its event socket had delivered then (the doctor's engine_events_silent).
        self.up_at: float | None = None
        self.messages_at_up = 0
        # Unix time since which its engine has not been routable (with a URL: from `start`, and from
        # each fall); None while it is.
        self._down_since: float | None = None
        self._registration: WorkerConfig | None = None  # the worker's last registration
        self._background = Supervisor(f"engine-{self.worker_id}")

    @property
    def messages(self) -> int:
        """Messages its event sockets have delivered, every rank's."""
        return sum(stream.stats["messages"] for stream in self.streams)

    async def start(self) -> None:
        for stream in self.streams:
            await stream.start()
        if self.health is not None:
            self._down_since = time.time()
            self.router.health.set_engine_probed(self.worker_id, True)  # the proxy's checks leave it alone
            self.health.start()
        self._background.keep_running("watch", self._watch)

    async def stop(self) -> None:
        await self._background.stop()
        if self.health is not None:
            await self.health.stop()
            self.router.health.set_engine_probed(self.worker_id, False)
        await self._stop_scraping()
        for stream in self.streams:
            await stream.stop()

    async def _up(self) -> None:
        assert self.url is not None
        models = self.spec.models
        if models is None:
            models = tuple(await wait_for_models(self.url))
        self.models = models
        # Routable only once the engine's PUB socket has our subscription: until then ZMQ drops what it
        # publishes, and a prompt routed there would leave no trace its repeat could be matched by.
        joined = await asyncio.gather(*(stream.joined(JOIN_TIMEOUT_S) for stream in self.streams))
        if not all(joined) and self.spec.replay is not None:
            # The doctor tells a socket that never delivers (engine_events_silent).
            log.info(
                "engine of worker %d answers at %s; its event socket %s has not connected within %g s: routable now",
                self.worker_id,
                self.url,
                ", ".join(stream.endpoint for stream, took in zip(self.streams, joined, strict=True) if not took),
                JOIN_TIMEOUT_S,
            )
        # Settings given over HTTP before the engine went down (capacity, taints) are kept.
        base = self.router.worker(self.worker_id) or self._registration or WorkerConfig(worker_id=self.worker_id)
        self.sink.reset()
        self._register(base)
        self.sink.accepting = True
        self.up_at = time.time()
        self._down_since = None
        self.messages_at_up = self.messages
        log.info("engine of worker %d answers at %s: routable", self.worker_id, self.url)
        await self._stop_scraping()
        self.scraper = EngineMetricsScraper(
            self.url + "/metrics",
            self,
            worker_id=self.worker_id,
            engine="auto",
            total_kv_blocks=None,
            interval_s=self._metrics_interval_s,
        )
        self.scraper.start()
        for stream in self.streams:  # what the engine holds now, from its replay buffer (or what comes next)
            await stream.rebuild()

    def _register(self, base: WorkerConfig) -> None:
        """The worker as its answering engine is registered: ``base``'s settings with the engine's URL and
        models, and the KV blocks its ``/metrics`` stated when ``base`` gives no capacity."""
        assert self.url is not None and self.models is not None
        stated = self.scraper.total_kv_blocks if self.scraper is not None else None
        registration = msgspec.structs.replace(
            base,
            block_size=self.router.config.block_size,
            dp_size=self.spec.dp_size,
            leased=False,
            url=self.url,
            models=frozenset(self.models),
            total_kv_blocks=base.total_kv_blocks if base.total_kv_blocks is not None else stated,
        )
        self.router.register_worker(registration)
        self.router.health.set_health(self.worker_id, True)  # /v1/workers: its health check passing

    def _registered_again(self) -> None:
        """Its events came while it is not registered, its engine answering: it was removed over HTTP, and
        what was given there went with it."""
        log.warning(
            "worker %d was removed while its engine at %s answers and publishes: registered again, with its URL "
            "and models (to keep it out of routing, stop hearing the engine: drop its --engine)",
            self.worker_id,
            self.url,
        )
        self._register(WorkerConfig(worker_id=self.worker_id))

    def _removed(self) -> None:
        """Removed while its engine kept publishing: what the engine holds is taken afresh from its
        replay buffers, as when it comes back up; without one it is unknown until the engine clears."""
        for stream in self.streams:
            if stream.replay_endpoint is not None:
                stream.request_rebuild()
            else:
                stream.mark_unverified("its worker was removed while the engine kept its blocks")

    async def _down(self, problem: str) -> None:
        self.sink.accepting = False
        if self.up_at is not None:
            self._down_since = time.time()
        self.up_at = None
        await self._stop_scraping()
        known = self.router.worker(self.worker_id)
        if known is None:
            log.info("engine of worker %d at %s does not answer yet (%s)", self.worker_id, self.url, problem)
            return
        self._registration = known
        log.warning(
            "engine of worker %d at %s stopped answering (%s): out of routing, its blocks dropped",
            self.worker_id,
            self.url,
            problem,
        )
        with contextlib.suppress(UnknownWorker):
            self.router.remove_worker(self.worker_id, "engine_unhealthy")

    def trouble(self) -> tuple[float, str] | None:
        """Since when (Unix time) and why its engine is down now, or None: with a URL, not routable
        (its server does not answer, or has not listed its models yet); without one, an event socket
        with no connection (nothing listens there)."""
        if self.health is not None:
            if self._down_since is None:
                return None
            problem = self.health.last_problem
            if problem is None:
                answer = "has not been probed yet" if self.health.healthy is None else "answers, yet lists no models"
                return self._down_since, f"its OpenAI server at {self.url} {answer}"
            hint = " (nothing at /health: is url= the engine's OpenAI server?)" if problem == "HTTP 404" else ""
            return self._down_since, f"its OpenAI server at {self.url} does not answer /health: {problem}{hint}"
        unconnected = [(s.unconnected_since, s.endpoint) for s in self.streams if s.unconnected_since is not None]
        if not unconnected:
            return None
        since = min(since for since, _ in unconnected)
        endpoints = ", ".join(endpoint for _, endpoint in unconnected)
        return since, (
            f"its event socket {endpoints} has no connection: nothing listens there (is the engine running, "
            "its KV events on, bound to that port: vLLM --kv-events-config endpoint tcp://*:PORT?)"
        )

    async def _watch(self) -> None:
        """A WARNING every `DOWN_WARNING_EVERY_S` while the engine is down; without a URL, one if it has
        sent nothing by then (a socket that connects yet hears nothing: KV events off, another topic)."""
        told_silent = self.url is not None  # with a URL, the doctor's engine_events_silent tells it
        while True:
            await asyncio.sleep(DOWN_WARNING_EVERY_S)
            trouble = self.trouble()
            if trouble is not None:
                since, why = trouble
                if time.time() - since >= DOWN_WARNING_EVERY_S:
                    log.warning("engine of worker %d down for %.0f s: %s", self.worker_id, time.time() - since, why)
            elif not told_silent and self.messages == 0:
                told_silent = True
                log.warning(
                    "no KV event heard from the engine of worker %d at %s in %g s, though its socket is connected: "
                    "an idle engine sends none, but one without KV events (vLLM --kv-events-config) or publishing "
                    "under another topic (--engine-zmq-topic) never will",
                    self.worker_id,
                    ", ".join(stream.endpoint for stream in self.streams),
                    DOWN_WARNING_EVERY_S,
                )

    # ------------------------------------------------------------------ the scraper's sink
    async def publish_load(self, load: ActiveLoad) -> None:
        """The engine's own load on a rank: its KV usage (the busy thresholds) and its request counts."""
        try:
            self.router.update_engine_load(
                self.worker_id, load.dp_rank, load.kv_used_blocks, load.num_requests_waiting, load.num_requests_running
            )
        except (UnknownWorker, KeyError, ValueError) as exc:  # out of routing meanwhile, or a rank it lacks
            log.debug("engine load of worker %d not applied: %s", self.worker_id, exc)

    async def capacity_learned(self, kv_blocks: int) -> None:
        """The engine stated its KV blocks: its registration takes them unless it has a capacity already
        (given over HTTP, or learned before a restart)."""
        known = self.router.worker(self.worker_id)
        if known is None or known.total_kv_blocks is not None:
            return
        self.router.register_worker(msgspec.structs.replace(known, total_kv_blocks=kv_blocks))

    async def _stop_scraping(self) -> None:
        scraper, self.scraper = self.scraper, None
        if scraper is not None:
            await scraper.stop()
