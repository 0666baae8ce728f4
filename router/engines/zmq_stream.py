"""One engine PUB socket heard over ZMQ: ordering by the engine's seq, gap repair by replay, restarts.

The engine sends ``[topic, seq (u64 BE), payload]`` per batch, ``seq`` counting from 0 per process
and rank. `ZmqEngineStream` keeps two watermarks (as llm-d-router does): the last seq *applied* and
the last seq seen *live* on the SUB socket.

- A live seq at or below the last live one: the engine restarted (a live stream never repeats). Its
  ranks are cleared through the sink and rebuilt from what follows.
- A live seq above the last live one that a replay brought already: a duplicate if its payload is the
  one replayed (an engine replays the bytes it published), else a new process that counts from 0
  again: a restart. This is what catches the restart of an engine whose whole history this stream
  heard by replay (a stream that joined late, and has seen nothing live since).
- Any other seq at or below the last applied one: a duplicate, dropped.
- At start, with a replay endpoint, the engine's whole buffer is replayed before any live message.
- A seq beyond the next expected one (including the first message of a stream joined late, whose
  expected seq is 0): a gap. With a replay endpoint the missing batches are asked for over a DEALER
  socket (REQ would keep only the first reply) while live messages wait in the queue, then applied
  in seq order; replayed batches the engine no longer holds, or no replay endpoint at all, leave the
  stream's ranks unverified through the sink. The replay is asked from the last applied seq, not the
  first missing one: if the engine's batch under that seq is not the one applied, a new process has
  published past it unheard, and this is a restart (its whole history is then replayed from 0).

A gap is only seen when a later batch arrives: batches lost at the tail (the first batches of a
restarted engine, published before the SUB socket's subscription reached its new PUB socket; or the
last ones before a quiet spell, dropped by a full queue) would stay unseen while the engine is quiet.
After each handshake of the SUB socket (a restarted engine binds a new PUB socket, and the SUB
reconnects), the first batch heard is applied at once, even at the next seq, and a tail check follows
anchored at the batch applied before it: a new process that published as many batches as its
predecessor had before its subscription arrived would otherwise read as the old one going on (and
its own batch would vouch for it). The engine's batch under the anchor's seq tells them apart (not
the same bytes: a restart, which clears what the new process's batch added too).

With a replay endpoint, a *tail check* asks the replay socket for what follows the last applied seq
(from 0 when nothing is applied), through the apply loop (in the stream's order, once the queue is
empty): after every connection of the SUB socket (its monitor's handshake event), once the
subscription has had ``tail_check_delay_s`` to reach the PUB socket; and once per quiet spell,
``quiet_s`` after the last message heard (never while the engine stays idle). The engine's batch
under the last applied seq equal to the one applied: what follows it is applied (one ``gap``, its
batches counted in ``replayed`` and ``tail_recovered``; those heard live meanwhile, queued behind the
check, are left to the queue: not lost), nothing follows: nothing happens. The seq no
longer held, or other bytes under it: a new process, and a restart (cleared, replayed from 0). A
tail check whose replay fails is counted (``tail_check_failed``) and logged rate-limited; it leaves
the stream's trust as it was.

With a ``batch_window_s`` (the bridge's), a stream that has caught up within half a window of its
last batch lets what arrives until the window ends join the next: a busy engine costs one sink batch
(one NATS message) per window instead of one per engine step, an engine stepping about once a window
sends each step at once, and a stream behind never waits.

The SUB reader never blocks the engine: messages go into a queue bounded by count and by bytes (its
payloads) and those that do not fit are dropped and counted (the seq gap they leave is then repaired
like any other). A replay round is
bounded too (`MAX_REPLAY_BATCHES`, `MAX_REPLAY_BYTES`): past either it is abandoned unread, a
rejection (``rejected_oversized_replay``) and a failed replay. A live frame past
`MAX_ENGINE_FRAME_BYTES` costs its connection (libzmq drops it unread): a rejection
(``rejected_oversized``), and the SUB socket connected afresh. Undecodable
payloads are counted by reason and logged rate-limited (once: heard live after a replay took the same
bytes under the same seq, a duplicate); nothing stops the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from indexer.engine_events import (
    EngineDecodeError,
    EngineEvent,
    EngineRemoved,
    EngineStored,
    decode_engine_batch,
    stored_block_size,
)
from router.engines.engine_spec import MAX_ENGINE_FRAME_BYTES, EndpointRefused, is_ipv6_literal
from router.engines.hash_check import TokensHashCheck, evidence
from router.engines.zmq_drain import drain_sub
from router.event_plane.ratelimited_log import RateLimitedLog
from router.supervision import Supervisor

__all__ = ["END_SEQ", "EngineSink", "PayloadApplied", "ZmqEngineStream", "replay_batches"]

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1  # the replay end marker: -1 as a signed 8-byte big-endian integer
DEFAULT_QUEUE_SIZE = 10_000
# The count alone let a queue of frames up to MAX_ENGINE_FRAME_BYTES reach 160 GiB; real batches are a
# few KiB, so this holds the whole count of busy ones.
DEFAULT_QUEUE_BYTES = 256 << 20
# Applying a backlog must not starve the loop it shares (the router's decisions in direct mode).
YIELD_AFTER_S = 0.0005
# Messages the SUB reader takes off the socket per wake-up (one `drain_sub` call) before it lets the
# loop run.
READ_BURST = 256
# A SUB socket's subscription reaches the PUB socket a moment after its handshake: what the engine
# publishes meanwhile is dropped by ZMQ (the slow joiner), so the tail check after a connection waits.
TAIL_CHECK_DELAY_S = 0.2
# A stream that heard nothing for this long after its last message checks its tail once.
QUIET_S = 0.5
# The SUB socket pings the engine's PUB socket this often (ZMTP heartbeats, which libzmq's PUB answers)
# and drops the connection after HEARTBEAT_MISSED intervals without a byte from it, then reconnects: a
# peer gone without a FIN or RST (a crashed host, a partition) is otherwise never noticed, and a
# replacement engine at the same address never heard. The replay DEALER needs none: each round connects
# afresh and has its own deadline.
HEARTBEAT_S = 2.0
HEARTBEAT_MISSED = 3
# After a connection of the SUB socket ends, how long libzmq is given to connect again by itself (it
# retries every 100 ms after a lost connection) before the socket is connected afresh here (it never
# does after a protocol error: a frame past MAXMSGSIZE); doubled after each forced reconnection without
# a handshake since, so that a peer that accepts and drops connections costs no more than libzmq's own
# retries, and reset by a handshake.
RECONNECT_CHECK_S = 0.5
RECONNECT_CHECK_MAX_S = 5.0


class EngineSink(Protocol):
    """Where a stream's decoded events go: the bridge's publisher or the router's own sequencer."""

    def apply(self, dp_rank: int, events: list[EngineEvent]) -> None:
        """Called inside `batch` only."""
        ...

    def batch(self) -> AbstractAsyncContextManager[object]:
        """Everything applied inside goes out together (the bridge: one NATS message, of this stream's
        events only). The stream never holds one open across a replay's wait."""
        ...

    def restarted(self, dp_rank: int) -> Awaitable[None]:
        """The engine restarted: everything it held on ``dp_rank`` is gone."""
        ...

    def unverified(self, dp_rank: int, reason: str) -> None:
        """Events of ``dp_rank`` were lost for good: its state is not known complete until a clear."""
        ...

    def apply_payload(
        self, payload: bytes, block_size: int, cache_namespace: str | None, default_rank: int, check: TokensHashCheck
    ) -> PayloadApplied | None:
        """Decode, check and apply one engine payload whole (the bridge: one C call), or None when the
        stream must decode it and `apply` the events itself."""
        ...

    def holds(self, dp_rank: int, block_hash: int) -> bool:
        """Whether a copy of the block is held on ``dp_rank``, in any tier (its salt is then kept)."""
        ...


class PayloadApplied(msgspec.Struct, gc=False):
    """What a sink that takes a payload whole (the bridge's `PublisherSink.apply_payload`) did with it.
    A Struct made in C, once per engine batch (a NamedTuple's Python ``__new__`` cost ~0.5 µs); it holds
    ints and a list of int tuples, so it is never in a cycle."""

    dp_rank: int
    events: int  # decoded events, every one applied (a store refused is the sink's to count)
    ignored: int
    # (known_hash, block_hash, tokens_hash, parent, known_tokens) of each store the hash check contradicts
    contradictions: list[tuple[int, int, int, int | None, int]]


class ReplayError(Exception):
    pass


class ReplayTooLarge(ReplayError):
    """A replay round that brought more than `MAX_REPLAY_BATCHES` batches or `MAX_REPLAY_BYTES` bytes:
    no engine's buffer, but a runaway peer; abandoned as a failed replay."""


class ReplayHoles(ReplayError):
    """Seqs the engine's buffer does not hold: batches it numbered and never buffered (TensorRT-LLM
    drops a batch on a full queue after taking its seq). ``batches`` is what the buffer holds, in order,
    worth applying; ``resumes`` the first seq after each hole, where what the stream holds stops being
    complete."""

    def __init__(self, message: str, batches: list[tuple[int, bytes]], resumes: list[int]) -> None:
        super().__init__(message)
        self.batches = batches
        self.resumes = resumes


# Rounds of one replay that ask again for batches the engine's ROUTER dropped (`replay_batches`).
REPLAY_ROUNDS = 4
# What one replay round may bring, at most: ten times vLLM's default replay buffer (10,000 steps), of
# busy steps (10 KiB of events each). More would grow the router's memory at a peer's will.
MAX_REPLAY_BATCHES = 100_000
MAX_REPLAY_BYTES = MAX_REPLAY_BATCHES * 10 * 1024
# What one replay round may take, at most, however often replies come (each extends its wait by the
# timeout): a peer dripping a reply a second would hold the apply loop for days. A whole vLLM buffer
# (10,000 batches) replays over loopback in well under a second.
REPLAY_ROUND_LIMIT_S = 30.0


async def _paced(batches: list[tuple[int, bytes]]) -> AsyncIterator[tuple[int, bytes]]:
    """Replayed batches one by one, the loop let run after each slice of ``YIELD_AFTER_S``: a replay
    buffer holds up to 10,000 batches, which applied at once held decisions up for over 100 ms."""
    started = time.perf_counter()
    for batch in batches:
        yield batch
        if time.perf_counter() - started > YIELD_AFTER_S:
            await asyncio.sleep(0)
            started = time.perf_counter()


async def replay_batches(
    context: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    *,
    timeout_s: float = 2.0,
    max_batches: int = MAX_REPLAY_BATCHES,
    max_bytes: int = MAX_REPLAY_BYTES,
    round_limit_s: float = REPLAY_ROUND_LIMIT_S,
) -> list[tuple[int, bytes]]:
    """Ask an engine's replay ROUTER for every buffered batch from ``start``: ``(seq, payload)`` in order,
    with no seq missing between the first and the last.

    Replies are ``[b"", seq, payload]`` (vLLM < 0.26, SGLang) or ``[b"", topic, seq, payload]``
    (vLLM >= 0.26, TRT-LLM): the seq is the second-to-last frame either way. A round ends at the
    ``END_SEQ`` marker. An engine's ROUTER drops replies silently when this end falls behind (ZMQ's
    high-water mark: a long replay to a busy router loses batches in its middle), so a batch missing
    between two that came is asked for again, from the batch before it, up to ``REPLAY_ROUNDS`` rounds;
    that batch must come back the same (else the engine restarted between two rounds). Raises
    `ReplayError` on a timeout, a round still answering after ``round_limit_s``, a malformed reply, a
    batch that changed, or holes left after the last round; `ReplayTooLarge` on a round of more than
    ``max_batches`` batches or ``max_bytes`` bytes of replies (each round is bounded so: a replay holds
    at most `REPLAY_ROUNDS` times as much).
    """
    received: dict[int, bytes] = {}
    # Seqs after which the buffer holds nothing up to the next batch it holds (first after -> that one).
    confirmed: dict[int, int] = {}
    ask = start
    for round_ in range(REPLAY_ROUNDS):
        batches, ended = await _replay_round(context, endpoint, ask, timeout_s, max_batches, max_bytes, round_limit_s)
        if round_ > 0 and (not batches or batches[0] != (ask, received[ask])):
            # Asked from a batch already in hand: another answer is another process (a restart).
            raise ReplayError(f"{endpoint}'s replay of seq {ask} changed between two rounds")
        for seq, payload in batches:
            if received.setdefault(seq, payload) != payload:
                raise ReplayError(f"{endpoint}'s replay of seq {seq} changed between two rounds")
        if len(batches) >= 2 and batches[0][0] == ask and batches[1][0] > ask + 1:
            # The answer's first two replies are never dropped (the ROUTER's queue is empty then): what
            # lies between them is not in the buffer at all.
            _confirm_hole(confirmed, ask, batches[1][0], endpoint)
        seqs = sorted(received)
        hole = _first_hole(seqs, confirmed)
        if hole is None and ended:
            found = [(seq, received[seq]) for seq in seqs]
            if confirmed:
                raise ReplayHoles(f"{endpoint}'s replay buffer lacks seqs after {sorted(confirmed)}", found,
                                  sorted(confirmed.values()))  # fmt: skip
            return found
        # A hole, or the end marker dropped (later batches may have been too): asked again from the
        # batch before, which must come back the same.
        ask = hole - 1 if hole is not None else seqs[-1]
    raise ReplayError(f"batches after seq {ask} still missing from {endpoint}'s replay after {REPLAY_ROUNDS} rounds")


# A hole the buffer keeps is a run of batches the engine dropped, no longer than its queue's worth; a
# wider one is a seq no engine sent (garbage on the wire), not a loss to apply around.
MAX_HOLE_SEQS = 100_000


def _confirm_hole(confirmed: dict[int, int], before: int, after: int, endpoint: str) -> None:
    if after - before - 1 > MAX_HOLE_SEQS:
        raise ReplayError(f"{endpoint}'s replay jumps from seq {before} to {after}")
    confirmed[before] = after


def _first_hole(seqs: list[int], confirmed: dict[int, int]) -> int | None:
    """The first seq missing between the first and the last of ``seqs`` (sorted), if any, but for the
    holes ``confirmed`` (the buffer's own: the seq before them -> the one after)."""
    if not seqs or seqs[-1] - seqs[0] + 1 == len(seqs):
        return None
    for before, after in itertools.pairwise(seqs):
        if after != before + 1 and confirmed.get(before) != after:
            return before + 1
    return None


async def _replay_round(
    context: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    timeout_s: float,
    max_batches: int,
    max_bytes: int,
    round_limit_s: float,
) -> tuple[list[tuple[int, bytes]], bool]:
    """The batches one request brings, and whether its end marker came (a silence after some batches
    is taken as a dropped marker; before any, as no answer: `ReplayError`; so is a round still answering
    after ``round_limit_s``). More than ``max_batches``
    batches or ``max_bytes`` bytes of replies (every frame): `ReplayTooLarge`, the rest left unread."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)  # no bound on the count on this side: fewer replies dropped
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_ENGINE_FRAME_BYTES)
    if is_ipv6_literal(endpoint):  # else libzmq never connects to tcp://[::1]:PORT (an IPv6 pod address)
        socket.setsockopt(zmq.IPV6, 1)
    try:
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:  # an endpoint ZMQ refuses: a failed replay, as an engine that is down
            raise ReplayError(f"ZMQ refuses the replay endpoint {endpoint!r}: {exc}") from None
        await socket.send_multipart([b"", start.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        received_bytes = 0
        deadline = time.monotonic() + timeout_s
        round_deadline = time.monotonic() + round_limit_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await socket.poll(int(remaining * 1000) + 1):
                if batches and time.monotonic() >= round_deadline:
                    raise ReplayError(f"{endpoint}'s replay from seq {start} still answering after {round_limit_s} s")
                if batches:
                    return batches, False
                raise ReplayError(f"no end marker from {endpoint} within {timeout_s} s")
            frames = await socket.recv_multipart()
            if len(frames) < 3 or frames[0] != b"" or len(frames[-2]) != 8:
                raise ReplayError(f"malformed replay reply of {len(frames)} frames from {endpoint}")
            seq = int.from_bytes(frames[-2], "big")
            if seq == END_SEQ:
                return batches, True
            received_bytes += sum(len(frame) for frame in frames)  # a topic frame is memory too
            if len(batches) == max_batches or received_bytes > max_bytes:
                raise ReplayTooLarge(
                    f"{endpoint}'s replay from seq {start} goes past {max_batches} batches or {max_bytes} bytes"
                )
            batches.append((seq, frames[-1]))
            # Each reply extends the deadline (a long replay is slow, not stuck), never past the round's.
            deadline = min(time.monotonic() + timeout_s, round_deadline)
    finally:
        socket.close()


def _close_sub(socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    socket.disable_monitor()
    monitor.close()
    socket.close()


class ZmqEngineStream:
    """One engine endpoint into one sink; ``dp_rank`` is used when batches do not name their rank."""

    def __init__(
        self,
        sink: EngineSink,
        endpoint: str,
        *,
        block_size: int,
        dp_rank: int = 0,
        topic: str = "",
        replay_endpoint: str | None = None,
        cache_namespace: str | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        replay_timeout_s: float = 2.0,
        max_replay_batches: int = MAX_REPLAY_BATCHES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        batch_window_s: float = 0.0,
        context: zmq.asyncio.Context | None = None,
        adopt_block_size: Callable[[int], int] | None = None,
        tail_check_delay_s: float = TAIL_CHECK_DELAY_S,
        quiet_s: float = QUIET_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.sink = sink
        # ``--block-size auto``: told the engine's block size at its first stored event, it answers the
        # block size in force (the engine's, when it decided; another: the engine's stores are refused).
        self._adopt_block_size = adopt_block_size
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.topic = topic.encode()
        self.cache_namespace = cache_namespace
        self._replay_timeout_s = replay_timeout_s
        self._max_replay_batches = max_replay_batches
        self._max_replay_bytes = max_replay_bytes
        self._batch_window_s = batch_window_s
        self._tail_check_delay_s = tail_check_delay_s
        self._quiet_s = quiet_s
        self._heartbeat_ms = max(1, round(heartbeat_s * 1000))
        self._context = context or zmq.asyncio.Context.instance()
        # (seq, payload) as read, at most queue_size of them and queue_bytes of payloads (`_queued_bytes`);
        # `_queued` wakes the apply loop (a deque and an event: an asyncio.Queue cost a future and its
        # bookkeeping per message).
        self._queue: deque[tuple[int, bytes]] = deque()
        self._queue_size = queue_size
        self._queue_bytes = queue_bytes
        self._queued_bytes = 0
        self._queued = asyncio.Event()
        self._background = Supervisor(f"zmq-{endpoint}")
        self._bad_input = RateLimitedLog(log)
        self._last_applied: int | None = None
        self._last_live: int | None = None
        # The bytes applied under `_last_applied` (a reference, no copy): a gap's replay starts there,
        # and an engine that replays other bytes under that seq is a new process.
        self._last_payload: bytes | None = None
        # (seq, hash of the payload) of the batches a replay applied (or rejected), in seq order, above the
        # last live seq: the SUB may still bring them, and only their payloads tell a duplicate from a new
        # process.
        self._replayed: deque[tuple[int, int]] = deque()
        self._hole_ends: set[int] = set()  # the seq after each hole the last replay found in the buffer
        self._ranks: set[int] = {dp_rank}
        # messages, applied, duplicate, dropped_queue_full, gap, replayed, replay_failed,
        # missing_history, restarts, unverified, rebuilds, tail_checks, tail_check_failed,
        # tail_recovered, rejected_<reason>, events, ignored_events, tokens_hash_mismatch; connections
        # (handshakes of the SUB socket with a PUB socket: the first, then one per engine (re)start).
        self.stats: Counter[str] = Counter()
        self.last_rejection: dict[str, str] = {}  # reason -> the latest such rejection, for diagnosis
        # The engine's block hashes against our tokens hashes (the doctor's tokens_hash_mismatch).
        self.hash_check = TokensHashCheck()
        self.last_hash_mismatch: str | None = None
        # Those since the engine's last restart (the doctor's count; the stats counter never goes down).
        self.hash_mismatches = 0
        # The cache salt of each salted block the engine holds (vLLM names it on a request's first
        # block only; the blocks stored under it share it): kept by the decoder.
        self.salts: dict[int, str] = {}
        # A hybrid model's KV-cache groups that are not main attention, learnt from their stores: their
        # removals are ignored (`decode_engine_batch`); kept across restarts (the model's, not the cache's).
        self.side_groups: set[int] = set()
        self._connected: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None = None  # by `start`
        # Unix time since which the SUB socket has had no connection with the engine's PUB socket (None:
        # it has one): from `start` until the first handshake, and from each disconnection to the next.
        self.unconnected_since: float | None = None
        # Set while the subscription has surely reached the engine's PUB socket (a handshake, then the
        # tail-check delay), cleared when the connection drops. Only watched with a replay socket.
        self._joined = asyncio.Event()
        self._rebuild_waiters: list[asyncio.Event] = []
        # Set by the reader whenever it took messages (the quiet watcher's clock); a tail check asked
        # for, which the apply loop runs once its queue is empty.
        self._heard = asyncio.Event()
        self._tail_check_due = False
        # Set at each handshake of the SUB socket: the next live batch, even at the next seq, may be a
        # new process's (behind a new PUB socket). It is applied at once, and a tail check anchored at
        # the batch applied before it (seq and bytes, kept here) asks the engine which process it was.
        self._verify_next = False
        self._reconnect_anchor: tuple[int, bytes | None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect the SUB socket, then hear the engine in the background. An event endpoint ZMQ refuses
        raises `EndpointRefused` with nothing left running: every retry would fail alike."""
        self._connected = self._connect_sub()
        self.unconnected_since = time.time()
        self._background.keep_running("sub", self._read)
        self._background.keep_running("apply", self._apply_loop)
        if self.replay_endpoint is not None:
            self._background.keep_running("quiet", self._watch_quiet)

    async def stop(self) -> None:
        await self._background.stop()

    @property
    def backlog(self) -> int:
        return len(self._queue)

    async def rebuild(self) -> None:
        """Take the engine's state afresh, as a stream that just joined would: its ranks cleared through
        the sink, then rebuilt from its replay buffer (from seq 0) when it has a replay socket, else from
        what comes next (a gap leaves the ranks unverified). Returns once done, in the stream's order.
        For an engine that was out of routing (down) while the stream heard or missed its events."""
        await self.request_rebuild().wait()

    def request_rebuild(self) -> asyncio.Event:
        """`rebuild` without waiting for it (the stream's own sink asks from inside its apply loop);
        the event returned is set once it is done."""
        done = asyncio.Event()
        self._rebuild_waiters.append(done)
        self._queued.set()
        return done

    async def _rebuilt(self) -> None:
        waiters, self._rebuild_waiters = self._rebuild_waiters, []
        try:
            self.stats["rebuilds"] += 1
            for rank in sorted(self._ranks):
                await self.sink.restarted(rank)
            self._last_applied = self._last_live = None
            self._last_payload = None
            self._reconnect_anchor = None
            self._replayed.clear()
            self.hash_check.reset()
            self.salts.clear()
            if self.replay_endpoint is not None:
                await self._bootstrap()
        except BaseException:
            # The sink failed (the bridge's NATS publish in an outage, say): the supervisor restarts the
            # loop, which takes the rebuild again; its callers (an engine's health probe) wait for that.
            self._rebuild_waiters[:0] = waiters
            raise
        for waiter in waiters:
            waiter.set()

    # ------------------------------------------------------------------ reading
    def _connect_sub(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """The SUB socket, connected to the engine, and its monitor. Raises `EndpointRefused`, nothing
        left open, when ZMQ refuses the endpoint."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_ENGINE_FRAME_BYTES)
        if is_ipv6_literal(self.endpoint):  # else libzmq never connects to tcp://[::1]:PORT (an IPv6 pod address)
            socket.setsockopt(zmq.IPV6, 1)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        socket.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_MISSED * self._heartbeat_ms)
        # Made before the connection, so its first handshake is heard too.
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        monitor = socket.get_monitor_socket(events)
        try:
            socket.connect(self.endpoint)
        except zmq.ZMQError as exc:
            _close_sub(socket, monitor)
            raise EndpointRefused(f"ZMQ refuses the event endpoint {self.endpoint!r}: {exc}") from None
        return socket, monitor

    async def _read(self) -> None:
        # The socket `start` connected; a reader restarted after a crash connects a new one.
        connected, self._connected = self._connected, None
        socket, monitor = connected or self._connect_sub()
        # Read without futures: the socket's file descriptor wakes the loop, then everything queued is
        # taken with non-blocking reads (pyzmq's awaitable recv cost a future and a poll per message).
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = cast(int, sync.getsockopt(zmq.FD))
        loop.add_reader(fd, readable.set)
        try:
            async with asyncio.TaskGroup() as group:  # the socket's reader and its monitor's live and die together
                group.create_task(self._take_messages(sync, readable))
                group.create_task(self._watch_connections(socket, monitor))
        finally:
            loop.remove_reader(fd)
            _close_sub(socket, monitor)

    async def _take_messages(self, sync: zmq.Socket[bytes], readable: asyncio.Event) -> None:
        queue, queued, heard, stats = self._queue, self._queued, self._heard, self.stats
        read: list[tuple[int, bytes]] = []
        while True:
            messages, dropped, misshapen = drain_sub(
                sync, READ_BURST, self._queue_size - len(queue), self._queue_bytes - self._queued_bytes, read
            )
            if messages:
                stats["messages"] += messages
                if not heard.is_set():
                    heard.set()
            if read:
                queue.extend(read)
                self._queued_bytes += sum(len(payload) for _, payload in read)
                read.clear()
                if not queued.is_set():
                    queued.set()
            if dropped:
                stats["dropped_queue_full"] += dropped
            for frames in misshapen:
                self._reject("bad_frames", f"expected [topic, seq(8 bytes), payload], got {frames} frames")
            if messages == READ_BURST:
                await asyncio.sleep(0)  # more is queued: let the loop run first
                continue
            readable.clear()
            # The descriptor is edge-triggered: look again before waiting for the next edge.
            if not cast(int, sync.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await readable.wait()

    async def _watch_connections(self, socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Each connection of the SUB socket made again once it ends, and, with a replay endpoint, a tail
        check after each handshake with a PUB socket (its first, and each reconnection: a restarted
        engine's new socket), once the subscription has had time to reach the PUB socket: what the
        engine published before that, ZMQ dropped. The next handshake is heard meanwhile (its first
        batch is to be verified), and its check replaces the pending one.

        A frame past MAXMSGSIZE ends the connection as a protocol error, which the monitor reports as
        any disconnection (pyzmq has no event of its own for it). What tells it apart: libzmq schedules
        a reconnection (``EVENT_CONNECT_RETRIED``, right after the disconnection) for every other end,
        never for a protocol error. A handshaken connection that ended without one, then, is counted
        as a rejection (``rejected_oversized``: the only protocol error a PUB socket's data causes after
        the handshake) once the next handshake shows the connection made here instead."""
        loop = asyncio.get_running_loop()
        check: asyncio.TimerHandle | None = None
        reconnect: asyncio.TimerHandle | None = None
        wait_s = RECONNECT_CHECK_S
        handshaken = False  # the current connection's handshake succeeded
        lost_unretried = False  # a handshaken connection ended and libzmq has not scheduled its retry

        def connect_afresh() -> None:
            nonlocal reconnect, wait_s
            reconnect = None
            wait_s = min(wait_s * 2, RECONNECT_CHECK_MAX_S)
            self.stats["reconnects"] += 1
            with contextlib.suppress(zmq.ZMQError):
                socket.disconnect(self.endpoint)
            socket.connect(self.endpoint)

        try:
            while True:
                event = await cast(Awaitable[dict[str, object]], recv_monitor_message(monitor))
                if event["event"] == zmq.EVENT_CONNECT_RETRIED:
                    lost_unretried = False
                    continue
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    lost_unretried, handshaken = handshaken, False
                    if self.unconnected_since is None:
                        self.unconnected_since = time.time()
                    # The engine went away (a restart's new socket comes with a handshake of its own).
                    self._joined.clear()
                    if check is not None:
                        check.cancel()
                        check = None
                    # libzmq connects again by itself after a lost connection, never after a protocol
                    # error (a frame past MAXMSGSIZE): without a handshake by then, connected afresh here.
                    # Not at once: disconnecting drops what the connection delivered and was not yet read,
                    # and a peer that accepts and drops connections would be asked again without pause.
                    if reconnect is None:
                        reconnect = loop.call_later(wait_s, connect_afresh)
                    continue
                if reconnect is not None:
                    reconnect.cancel()
                    reconnect = None
                wait_s = RECONNECT_CHECK_S
                self.stats["connections"] += 1
                if lost_unretried:
                    self._reject(
                        "oversized",
                        f"a frame past {MAX_ENGINE_FRAME_BYTES} bytes (libzmq dropped the connection with it and "
                        "its batch: connected afresh)",
                    )
                handshaken, lost_unretried = True, False
                self.unconnected_since = None
                if self.replay_endpoint is None:  # nothing to check a connection's first batch against
                    continue
                self._verify_next = True
                if check is not None:
                    check.cancel()
                check = loop.call_later(self._tail_check_delay_s, self._subscription_in_place)
        finally:
            for timer in (check, reconnect):
                if timer is not None:
                    timer.cancel()

    async def _watch_quiet(self) -> None:
        """One tail check per quiet spell, ``quiet_s`` after the last message heard: an idle engine is
        not asked again until it publishes."""
        heard = self._heard
        while True:
            await heard.wait()
            while heard.is_set():
                heard.clear()
                await asyncio.sleep(self._quiet_s)
            self._ask_tail_check()

    def _subscription_in_place(self) -> None:
        self._joined.set()
        self._ask_tail_check()

    async def joined(self, timeout_s: float) -> bool:
        """Wait until the engine's PUB socket surely has our subscription (a handshake of the SUB socket,
        then the tail-check delay, and no disconnection since): from then on ZMQ drops nothing the engine
        publishes, and a replay covers what it published before. False after ``timeout_s`` without it (an
        event socket that does not answer), and at once without a replay socket (its connections are not
        watched)."""
        if self.replay_endpoint is None:
            return False
        try:
            await asyncio.wait_for(self._joined.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _ask_tail_check(self) -> None:
        self._tail_check_due = True
        self._queued.set()

    async def _apply_loop(self) -> None:
        if self.replay_endpoint is not None and self._last_applied is None:
            await self._bootstrap()
        queue, queued = self._queue, self._queued
        sent_at = 0.0
        while True:
            while not queue and not self._rebuild_waiters:
                if self._tail_check_due:  # caught up: nothing heard waits to be applied before it
                    self._tail_check_due = False
                    await self._check_tail()
                    continue
                queued.clear()
                await queued.wait()
            if self._rebuild_waiters:
                await self._rebuilt()
                continue
            if not self._is_next(queue[0][0]):
                # Anything but the next batch (a gap, a restart, the first after a connection): taken
                # outside a batch, which it opens itself where it applies, so a replay's wait never
                # holds back what was applied before it.
                seq, payload = queue.popleft()
                self._queued_bytes -= len(payload)
                await self.take_live(seq, payload)
            else:
                started = time.perf_counter()
                # What is queued already goes out together, within the loop's fairness budget.
                async with self.sink.batch():
                    self._drain(started)
                    # Caught up, but the last message went out less than half a window ago: what arrives
                    # until the window ends goes out with this one (one message per window when busy;
                    # never a wait while a backlog is queued, nor after a quiet spell). A batch later in
                    # the window would wait for little company: an engine stepping about once a window
                    # would pay a timer's wake-up and its delay on every batch and batch nothing.
                    hold = sent_at + self._batch_window_s - time.perf_counter()
                    if hold > self._batch_window_s / 2 and not queue:
                        await asyncio.sleep(hold)
                        self._drain(time.perf_counter())
            sent_at = time.perf_counter()
            if queue:
                await asyncio.sleep(0)

    def _drain(self, started: float) -> None:
        """The queued batches that each follow the last applied one, within the loop's fairness budget;
        the first that does not is left at the head of the queue for `take_live`."""
        queue = self._queue
        while queue and time.perf_counter() - started < YIELD_AFTER_S and self._take_next(*queue[0]):
            self._queued_bytes -= len(queue.popleft()[1])

    # ------------------------------------------------------------------ ordering
    def _is_next(self, seq: int) -> bool:
        """Whether ``seq`` is the batch right after the last one applied, on the same connection (so
        above every live and replayed seq: neither a restart nor a duplicate)."""
        last = self._last_applied
        return last is not None and seq == last + 1 and not self._verify_next

    def _take_next(self, seq: int, payload: bytes) -> bool:
        """`take_live` of the common case (`_is_next`), without a coroutine."""
        if not self._is_next(seq):
            return False
        self._last_live = seq
        if self._replayed:
            self._replayed.clear()
        self._deliver(seq, payload)
        return True

    async def take_live(self, seq: int, payload: bytes) -> None:
        """One message as it came off the SUB socket (public for tests that drive the order)."""
        if self._verify_next:
            self._verify_next = False
            if self._last_applied is not None and self._reconnect_anchor is None:
                self._reconnect_anchor = (self._last_applied, self._last_payload)
                self._ask_tail_check()  # once the queue is empty: this batch is not held up
        if seq == self._last_applied and payload == self._last_payload:
            # The batch applied last, heard again (a new process's batch under this seq would differ: a
            # batch carries its time): not a restart.
            self.stats["duplicate"] += 1
            return
        if seq != self._next_live():
            # Only a batch that decodes may move the live seq: garbage under seq 0 (or 2**64 - 1) would
            # otherwise read as a restart, now (or at the next batch), and clear the engine's ranks.
            try:
                decode_engine_batch(payload, self.block_size)
            except EngineDecodeError as exc:
                if (seq, hash(payload)) in self._replayed:
                    # The engine's own bytes under this seq, which a replay took (and rejected) already.
                    self.stats["duplicate"] += 1
                else:
                    self._reject(exc.reason, f"seq {seq} (out of order, not taken as a restart): {exc.detail}")
                return
        last_live = self._last_live
        self._last_live = seq
        if last_live is not None and seq <= last_live:
            await self._restarted(f"seq {seq} after {last_live} live")
        elif self._replayed_otherwise(seq, payload):
            await self._restarted(f"live seq {seq} is not the batch a replay applied under it")
        last = self._last_applied
        if last is not None and seq <= last:
            self.stats["duplicate"] += 1
            return
        expected = 0 if last is None else last + 1
        if seq > expected:
            self.stats["gap"] += 1
            await self._repair(expected)
            last = self._last_applied
            if last is not None and seq <= last:
                self.stats["duplicate"] += 1  # the replay brought it already
                return
        async with self.sink.batch():
            self._deliver(seq, payload)

    def _next_live(self) -> int | None:
        """The seq the live stream goes on with (None: nothing heard yet)."""
        last = self._last_live if self._last_live is not None else self._last_applied
        return None if last is None else last + 1

    async def _restarted(self, evidence: str) -> None:
        self.stats["restarts"] += 1
        log.warning("engine at %s restarted (%s): clearing its ranks", self.endpoint, evidence)
        for rank in sorted(self._ranks):
            await self.sink.restarted(rank)
        self._last_applied = None
        self._last_payload = None
        self._reconnect_anchor = None
        self._replayed.clear()
        # A new process: what its predecessor's hashes contradicted is history (fixed, perhaps).
        self.hash_check.reset()
        self.salts.clear()
        self.hash_mismatches = 0
        self.last_hash_mismatch = None

    def _replayed_otherwise(self, seq: int, payload: bytes) -> bool:
        """Whether a replay applied another payload under this live ``seq`` (forgetting what the live
        stream has passed)."""
        replayed = self._replayed
        if not replayed:
            return False
        while replayed and replayed[0][0] < seq:
            replayed.popleft()
        if not replayed or replayed[0][0] != seq:
            return False
        return replayed.popleft()[1] != hash(payload)

    def _deliver_replayed(self, seq: int, payload: bytes) -> None:
        if seq in self._hole_ends:
            self._hole_ends.discard(seq)
            self.stats["missing_history"] += 1
            self.mark_unverified(f"the engine's replay buffer lacks the batches before seq {seq} for good")
        self.stats["replayed"] += 1
        self._replayed.append((seq, hash(payload)))
        self._deliver(seq, payload)

    async def _bootstrap(self) -> None:
        """Before the first live message: replay the engine's buffer, so a router (or bridge) that starts
        after its engine learns what the engine cached before, even if the engine is idle now."""
        try:
            batches = await self._replay_from(0)
        except ReplayError as exc:
            log.info("engine at %s did not answer a replay at start (%s); live messages will", self.endpoint, exc)
            return
        if batches and batches[0][0] > 0:
            self.stats["missing_history"] += 1
            self.mark_unverified(f"the engine's replay buffer starts at seq {batches[0][0]}, not 0")
        async for seq, payload in _paced(batches):
            async with self.sink.batch():
                self._deliver_replayed(seq, payload)

    async def _check_tail(self) -> None:
        """What follows the last applied seq (from 0 when none is): asked from that seq, as `_repair`
        asks, so the engine's batch under it tells the same process going on from a new one. After a
        reconnection, asked from the batch applied before the first one heard since: that one may be
        a new process's own, and would vouch for itself."""
        self.stats["tail_checks"] += 1
        anchor, self._reconnect_anchor = self._reconnect_anchor, None
        last, applied = anchor if anchor is not None else (self._last_applied, self._last_payload)
        start = 0 if last is None else last
        try:
            batches = await self._replay_from(start)
        except ReplayError as exc:  # the engine is down, perhaps: the next message or check will tell
            self.stats["tail_check_failed"] += 1
            self._bad_input.warning("tail check failed", f"engine at {self.endpoint}: {exc}")
            if self._reconnect_anchor is None:
                self._reconnect_anchor = anchor  # for the next check (the handshake's, a quiet spell's)
            return
        if last is not None:
            held = batches[0] if batches else None
            if held is not None and held[0] == last and held[1] != applied and not self._decodes(held[1]):
                self.stats["tail_check_failed"] += 1  # no batch: proves nothing of a new process
                self._bad_input.warning("tail check failed", f"engine at {self.endpoint}: seq {last} is garbage")
                if self._reconnect_anchor is None:
                    self._reconnect_anchor = anchor  # for the next check, as after a failed one
                return
            if held is None or held[0] != last or held[1] != applied:
                found = "nothing" if held is None else f"seq {held[0]}" if held[0] != last else "other bytes"
                await self._restarted(f"a tail check found {found} under seq {last}")
                self._last_live = None  # the old process's: the new one's live seqs start lower
                await self._bootstrap()  # a new process may hold nothing yet: no history missing
                return
            del batches[0]
        current = self._last_applied  # past an anchor: what was heard live since the reconnection
        if current is not None:
            batches = [batch for batch in batches if batch[0] > current]
        # What was heard live while the replay was asked waits in the queue, behind this check: it
        # was not lost, and the loop applies it next.
        if self._queue:
            first_live = self._queue[0][0]
            batches = [batch for batch in batches if batch[0] < first_live]
        if not batches:
            return
        self.stats["gap"] += 1
        self.stats["tail_recovered"] += len(batches)
        expected = 0 if current is None else current + 1
        if batches[0][0] > expected:
            self.stats["missing_history"] += 1
            self.mark_unverified(f"the engine's replay buffer goes on at seq {batches[0][0]}, not {expected}")
        async with self.sink.batch():
            async for seq, payload in _paced(batches):
                self._deliver_replayed(seq, payload)

    async def _repair(self, start: int) -> None:
        if self.replay_endpoint is None:
            self.mark_unverified(f"batches from seq {start} were lost and no replay endpoint is configured")
            return
        applied = self._last_payload
        ask_from = start - 1 if applied is not None and start > 0 else start
        try:
            batches = await self._replay_from(ask_from)
        except ReplayError as exc:
            self.stats["replay_failed"] += 1
            self.mark_unverified(f"replay from seq {ask_from} failed: {exc}")
            return
        if batches and batches[0][0] == ask_from < start:
            if batches[0][1] != applied and not self._decodes(batches[0][1]):
                # Garbage, not another process's batch: the replay failed, the index is kept.
                self.stats["replay_failed"] += 1
                self.mark_unverified(f"replay from seq {ask_from} failed: its batch under seq {ask_from} is garbage")
                return
            if batches[0][1] != applied:
                await self._restarted(f"its replay of seq {ask_from} is not the batch applied under it")
                await self._repair(0)
                return
            del batches[0]
        if not batches or batches[0][0] > start:
            self.stats["missing_history"] += 1
            first = batches[0][0] if batches else None
            self.mark_unverified(f"the engine's replay buffer starts at seq {first}, {start} was needed")
        async with self.sink.batch():
            async for seq, payload in _paced(batches):
                last = self._last_applied
                if seq >= start and (last is None or seq > last):
                    self._deliver_replayed(seq, payload)

    async def _replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """The engine's buffer from ``start`` (`replay_batches`). With holes it keeps for good, what it
        holds, each hole's end noted: the ranks are marked unverified as the batch after it is applied,
        not before (a clear replayed ahead of the hole would trust them again) and not for a hole
        below what was already heard (no loss). A replay too large is a rejection too (counted and
        logged as one) before it fails as any replay does."""
        self._hole_ends = set()
        try:
            return await replay_batches(
                self._context,
                self.replay_endpoint or "",
                start,
                timeout_s=self._replay_timeout_s,
                max_batches=self._max_replay_batches,
                max_bytes=self._max_replay_bytes,
            )
        except ReplayHoles as exc:
            self._hole_ends = set(exc.resumes)
            return exc.batches
        except ReplayTooLarge as exc:
            self._reject("oversized_replay", str(exc))
            raise

    def _decodes(self, payload: bytes) -> bool:
        try:
            decode_engine_batch(payload, self.block_size)
        except EngineDecodeError:
            return False
        return True

    def mark_unverified(self, reason: str) -> None:
        self.stats["unverified"] += 1
        log.warning("engine stream %s: %s; its ranks are unverified", self.endpoint, reason)
        for rank in sorted(self._ranks):
            self.sink.unverified(rank, reason)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._last_applied = seq
        self._last_payload = payload
        if self._adopt_block_size is not None:
            engine_block_size = stored_block_size(payload)
            if engine_block_size is not None:
                self.block_size = self._adopt_block_size(engine_block_size)
                self._adopt_block_size = None
        if not self.salts and not self.side_groups:  # `bridge_batch` follows no salt, no side group
            taken = self.sink.apply_payload(
                payload, self.block_size, self.cache_namespace, self.dp_rank, self.hash_check
            )
            if taken is not None:
                self.stats["ignored_events"] += taken.ignored
                self.stats["applied"] += 1
                if taken.events:
                    self._ranks.add(taken.dp_rank)
                    self.stats["events"] += taken.events
                for contradiction in taken.contradictions:
                    self._hash_mismatch(seq, evidence(*contradiction))
                return
        try:
            batch = decode_engine_batch(
                payload,
                self.block_size,
                cache_namespace=self.cache_namespace,
                salts=self.salts,
                side_groups=self.side_groups,
            )
        except EngineDecodeError as exc:
            self._reject(exc.reason, f"seq {seq}: {exc.detail}")
            return
        for error in batch.errors:
            self._reject(error.reason, f"seq {seq}: {error.detail}")
        self.stats["ignored_events"] += batch.ignored
        self.stats["applied"] += 1
        if not batch.events:
            return
        rank = self.dp_rank if batch.dp_rank is None else batch.dp_rank
        self._ranks.add(rank)
        self.stats["events"] += len(batch.events)
        for event in batch.events:
            if isinstance(event, EngineStored):
                self._hash_mismatch(seq, self.hash_check.observe(event))
        if batch.eagle_stores:
            if not self.stats["eagle_stores"]:
                log.info("engine at %s sends EAGLE bigram token ids: requests match its blocks only when the "
                         "router hashes them alike (--enable-eagle)", self.endpoint)  # fmt: skip
            self.stats["eagle_stores"] += batch.eagle_stores
        self.sink.apply(rank, batch.events)
        if self.salts:
            self._forget_salts(rank, batch.events)

    def _forget_salts(self, dp_rank: int, events: list[EngineEvent]) -> None:
        """The salts of the removed blocks of which the sink holds no copy left (vLLM evicts each copy
        of a block alone: a salted continuation under the other copy must still be salted)."""
        salts, holds = self.salts, self.sink.holds
        for event in events:
            if isinstance(event, EngineRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in salts and not holds(dp_rank, block_hash):
                        del salts[block_hash]

    def _hash_mismatch(self, seq: int, found: str | None) -> None:
        if found is not None:
            self.stats["tokens_hash_mismatch"] += 1
            self.hash_mismatches += 1
            self.last_hash_mismatch = found
            self._bad_input.warning("tokens_hash_mismatch", f"from {self.endpoint}, seq {seq}: {found}")

    def _reject(self, reason: str, message: str) -> None:
        self.stats[f"rejected_{reason}"] += 1
        self.last_rejection[reason] = message
        self._bad_input.warning(f"engine event {reason}", f"from {self.endpoint}, {message}")
