"""The hand-off of a disaggregated request: the proxy runs its prefill leg and its decode leg when the
decision (`router.disaggregation`) says the prompt is prefilled remotely.

Three styles, the prefill worker's ``handoff`` setting (`router.types.HandoffStyle`) deciding:

- ``kv_transfer_params`` (vLLM's NIXL connector and its other v1 connectors, as vLLM's own P/D proxy
  runs them): first the prefill leg, the body with ``kv_transfer_params {"do_remote_decode": true,
  "do_remote_prefill": false, ...}``, ``stream: false``, ``max_tokens: 1`` (``max_output_tokens: 1``
  on the Responses API; ``max_completion_tokens`` and ``n`` 1 when given; ``stream_options``,
  ``min_tokens`` and ``best_of`` dropped); the worker
  answers with the ``kv_transfer_params`` the decode worker needs to pull the KV. Then the decode leg,
  the client's body with those params, whose answer goes to the client.
- ``bootstrap`` (SGLang): ``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (its
  ``bootstrap_port``, else SGLang's default 8998) and a fresh random ``bootstrap_room`` injected
  into the client's body, sent to both workers at once; the two meet at the prefill worker's
  bootstrap server; the decode leg's answer goes to the client, the prefill leg's is read and dropped.
- ``sequential`` (connectors that share KV through a store keyed by the prompt: vLLM's
  ExampleConnector, which writes each prompt's KV to a shared path and loads it in any engine given
  the same prompt): the prefill leg as in ``kv_transfer_params`` but without params (the answer has
  none), read whole; then the decode leg, the client's body unchanged.

Bookings: the prefill leg's (``<id>#prefill``) is freed when that leg's answer is in (its KV has
been computed), or at the decode leg's first token, or with the request (`KvRouter.mark_free` of the
request frees both legs, which the proxy does on every path).

Failures (`PrefillFailed`, raised before the client has had anything): a prefill leg refused, timed
out, answering 5xx, or (``kv_transfer_params``) answering without params a NIXL decode leg can pull
the KV with (`_unusable`); the proxy tells that
worker's circuit breaker and books the request again without it, so the prefill goes to another prefill worker
(or, none left, to the decode worker itself: the decision's ``local_prefill``). In ``bootstrap``
style a prefill leg failing while the decode leg has not answered cancels the decode leg (its
connection closed: the engine aborts it); one failing after the decode leg has begun is counted and
told to its breaker, the KV having arrived. A prefill leg refused with a 4xx is the client's answer:
its worker answered, and the decode worker, never sent the request, is told nothing. A client leaving
cancels the request's task, and with it whichever legs are in flight. The bodies of the two legs are
re-encoded (fields injected), not forwarded byte for byte: only on this path.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec
from prometheus_client import CollectorRegistry, Counter

from api.eager import retrieve
from api.http_stream import Headers, Sink, StreamCall
from api.metrics import PREFIX
from api.proxy.retry import OVERLOADED, Refused, WorkerFailed, overloaded_answer, unanswered
from api.proxy.upstream import Upstream, UpstreamError
from api.proxy.wire import finished_stream, receipt_headers
from router.kv_router import KvRouter
from router.types import DisaggregatedLeg, HandoffStyle, RouteDecision, WorkerConfig

__all__ = ["SGLANG_BOOTSTRAP_PORT", "Forward", "Handoff", "Legs", "PrefillFailed"]

# SGLang's --disaggregation-bootstrap-port default, for a bootstrap-style worker registered without one.
SGLANG_BOOTSTRAP_PORT = 8998

_decode = msgspec.json.decode
_encode = msgspec.json.encode

_RESPONSES = b"/v1/responses"

# The prefill leg's kv_transfer_params, as vLLM's P/D proxy sends them.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Where a decode leg's engine pulls the KV from, beside the block ids (`_unusable`).
_REMOTE_PREFILL_SOURCE = ("remote_engine_id", "remote_host", "remote_port")

# Forwards a body to the decode worker and answers the client (the reply given) with its answer: the
# proxy's one-leg path; raises the proxy's own failure while the client has had nothing.
Forward = Callable[[bytes, StreamCall], Awaitable[str]]


class PrefillFailed(WorkerFailed):
    """The prefill leg failed while the client had nothing: the request may go again without that
    prefill worker (`WorkerFailed`)."""

    role = "prefill worker"


class Legs:
    """One remote prefill: its decision, the two workers, the prefill leg's booking and how they hand the
    KV over."""

    __slots__ = ("decision", "decode", "leg", "prefill", "style")

    def __init__(
        self, decision: RouteDecision, prefill: WorkerConfig, decode: WorkerConfig, leg: DisaggregatedLeg
    ) -> None:
        self.decision = decision
        self.prefill = prefill
        self.decode = decode
        self.leg = leg
        self.style: HandoffStyle = prefill.handoff


class Handoff:
    """The proxy's runner of two-leg requests: its router (for the prefill booking), upstream client
    and counter ``kv_router_proxy_handoffs_total{style,outcome}``."""

    def __init__(
        self,
        router: KvRouter,
        upstream: Upstream,
        registry: CollectorRegistry,
        answered: Callable[[int], None],
        failed: Callable[[int, str], None],
    ) -> None:
        """``answered``: told the id of a prefill worker whose leg was answered (its circuit breaker's
        count of failures starts again, as a decode worker's does); ``failed``: told one whose leg failed
        once nothing could be retried any more (a failure before is the retry's to tell)."""
        self.router = router
        self.upstream = upstream
        self._answered = answered
        self._failed_late = failed
        self._counter = Counter(
            f"{PREFIX}_proxy_handoffs",
            "Remote prefills the proxy ran, by hand-off style (kv_transfer_params, bootstrap, sequential) and "
            "outcome (ok: the decode leg answered; prefill_failed: the prefill leg failed and the request went "
            "again without that worker; prefill_failed_late: in bootstrap style, after the decode leg began; "
            "prefill_overloaded: it answered 429 or 503 (the engine pacing us), and the request went again; "
            "prefill_refused: the prefill worker answered another 4xx, passed to the client, or an answer over "
            "proxy_max_answer_bytes, a 502).",
            ["style", "outcome"],
            registry=registry,
        )

    def legs(self, decision: RouteDecision, workers: dict[int, WorkerConfig]) -> Legs | None:
        """The two legs of ``decision`` when its prompt is prefilled remotely, else None (one leg)."""
        disaggregation = decision.disaggregation
        if disaggregation is None or disaggregation.prefill is None:
            return None
        leg = disaggregation.prefill
        return Legs(decision, workers[leg.worker_id], workers[decision.worker_id], leg)

    async def run(
        self, legs: Legs, path: bytes, body: bytes, headers: bytes, reply: StreamCall, forward: Forward
    ) -> str:
        """Both legs (``headers``: the raw header lines both get); returns the decode leg's outcome.
        Raises `PrefillFailed`, `Refused` (the prefill leg's answer the client's), or what ``forward``
        raises for the decode leg."""
        if legs.style == "bootstrap":
            return await self._bootstrap(legs, path, body, headers, reply, forward)
        try:
            if legs.style == "sequential":
                await self._prefill_leg(legs, path, _prefill_body(path, body, None), headers)
                self._answered(legs.prefill.worker_id)
                decode_body = body
            else:
                decode_body = await self._remote_decode_prefill(legs, path, body, headers)
        except (PrefillFailed, Refused) as exc:
            self._count(legs, _early_outcome(exc))
            raise
        outcome = await forward(decode_body, reply)
        self._count(legs, "ok")  # as in bootstrap style: once the decode leg has an outcome
        return outcome

    # ------------------------------------------------------------------ vLLM: prefill, then decode
    async def _remote_decode_prefill(self, legs: Legs, path: bytes, body: bytes, headers: bytes) -> bytes:
        """The prefill leg of the ``kv_transfer_params`` style; returns the decode leg's body."""
        content = await self._prefill_leg(legs, path, _prefill_body(path, body, _REMOTE_DECODE), headers)
        try:
            params = _decode(content).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        problem = _unusable(params)
        if problem is not None:
            raise PrefillFailed(legs.prefill.worker_id, problem)
        self._answered(legs.prefill.worker_id)
        decode_request = _decode(body)
        decode_request["kv_transfer_params"] = params
        return _encode(decode_request)

    # ------------------------------------------------------------------ SGLang: both at once
    async def _bootstrap(
        self, legs: Legs, path: bytes, body: bytes, headers: bytes, reply: StreamCall, forward: Forward
    ) -> str:
        url = legs.prefill.url
        assert url is not None
        request: dict[str, Any] = _decode(body)
        request["bootstrap_host"] = urlsplit(url).hostname
        request["bootstrap_port"] = legs.prefill.bootstrap_port or SGLANG_BOOTSTRAP_PORT
        request["bootstrap_room"] = secrets.randbits(63)
        both = _encode(request)
        watched = _Watched(reply)
        prefill = asyncio.ensure_future(self._prefill_leg(legs, path, both, headers))
        decode = asyncio.ensure_future(forward(both, watched))
        outcome: str | None = None  # the decode leg's, once it has one
        blamed: PrefillFailed | None = None  # the prefill leg, held to blame for the decode leg's silence
        try:
            try:
                await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and prefill.exception() is not None and not watched.answered:
                    # It would wait for KV that is not coming. Given up first: an answer its connection
                    # brings before the cancellation lands must not reach the client, who gets the
                    # request's next attempt instead.
                    watched.given_up = True
                    decode.cancel()
                    # Its end, not its outcome (read by `retrieve`); a cancellation of our own, the
                    # client leaving meanwhile, goes through: no next attempt for a client gone.
                    await asyncio.wait((decode,))
                    prefill.result()  # raises the PrefillFailed (or the refusal)
                try:
                    outcome = await decode
                except WorkerFailed as failed:
                    if not (failed.silent and not prefill.done() and not watched.answered):
                        raise
                    # The decode engine waits for the KV of a prefill leg that has not answered either:
                    # the prefill worker's fault, as far as can be told. Blamed on the decode worker, every
                    # attempt went back to the same stuck prefill worker while the decode workers' circuits
                    # opened one by one.
                    blamed = PrefillFailed(
                        legs.prefill.worker_id,
                        f"its KV did not reach decode worker {failed.worker_id}, silent for the read timeout",
                    )
                    raise blamed from None
            except asyncio.CancelledError:
                # The client left: abandoned, unless it had its whole answer or the stream's last event
                # (the official client closes right after it), as the one-leg path reads it.
                task = asyncio.current_task()
                if not watched.finished or task is None:
                    raise
                task.uncancel()
                outcome = await decode
            return outcome
        finally:
            # Counted once, however it ended (the client gone too): a prefill leg that failed before the
            # client had anything is the request's next attempt (`_early_outcome`), after it a late one.
            failure = _raised(prefill) or blamed
            if failure is not None:
                self._count(legs, "prefill_failed_late" if watched.answered else _early_outcome(failure))
            elif outcome is not None:
                self._count(legs, "ok")
            if outcome is not None:
                # The decode leg had its KV: a prefill leg still unanswered is not waited for (the
                # request and its bookings end with the client's answer), its connection closed below.
                if failure is None and (outcome == "ok" or prefill.done()):
                    # Its answer in, or the decode leg's whole answer out, which needed its KV. Not a decode
                    # leg's refusal (a 4xx of the same body): that says nothing of the prefill worker,
                    # whose half-open circuit it closed.
                    self._answered(legs.prefill.worker_id)
                elif isinstance(failure, WorkerFailed) and not failure.paced:  # the engine pacing us, a 4xx: no failure
                    self._failed_late(legs.prefill.worker_id, str(failure))
            # Not awaited: the request's end must not wait on them (nor take a late cancellation from
            # its client for its own); a leg cancelled closes its connection as it unwinds.
            for leg in (prefill, decode):
                if not leg.done():
                    leg.cancel()
                leg.add_done_callback(retrieve)

    # ------------------------------------------------------------------ the prefill leg
    async def _prefill_leg(self, legs: Legs, path: bytes, body: bytes, headers: bytes) -> bytes:
        """Send the prefill leg and read its whole answer; its booking is freed once it is in. Raises
        `PrefillFailed`, or `Refused` (a 4xx, or an answer over ``proxy_max_answer_bytes``: the client's)."""
        worker = legs.prefill
        assert worker.url is not None
        if worker.dp_size > 1:
            headers += b"x-data-parallel-rank: " + str(legs.leg.dp_rank).encode() + b"\r\n"
        # Not patient, as a whole answer to the client is: its answer comes once the prompt is computed,
        # so silence past the read timeout is a stuck engine (the request then goes to another prefill
        # worker, or is prefilled locally), not a long generation. Patient, it held requests for
        # proxy_request_timeout_secs (30 min) behind an engine whose HTTP server still answered /health.
        try:
            connection = await self.upstream.open(worker.url, path, body, headers, worker_id=worker.worker_id)
        except UpstreamError as exc:
            raise PrefillFailed(worker.worker_id, str(exc)) from None
        try:
            content = await connection.read()
        except UpstreamError as exc:
            raise unanswered(PrefillFailed, worker.worker_id, exc) from None
        finally:
            connection.release()
        if connection.status in OVERLOADED:  # the engine pacing us: another worker, or later
            answer, wait = overloaded_answer(connection, worker.worker_id, content)
            raise PrefillFailed(worker.worker_id, f"HTTP {connection.status}", answer, wait)
        if 400 <= connection.status < 500:  # the request's fault, not the worker's: the client's answer
            self._answered(worker.worker_id)
            # The decision's receipt, as the decode leg's answer carries it: the client can tell who refused it.
            headers_out = [(b"content-type", connection.content_type or b"application/json")]
            headers_out += receipt_headers(legs.decision)
            raise Refused(connection.status, content, "upstream_status", headers_out)
        if connection.status != 200:
            message = content[:200].decode("utf-8", "replace")
            raise PrefillFailed(worker.worker_id, f"HTTP {connection.status}: {message}")
        if legs.leg.booking_id is not None:
            # Its prompt is computed (credited there until the prefill worker's events tell it): no more
            # prefill load there.
            self.router.mark_prefill(legs.leg.booking_id)
            self.router.mark_free(legs.leg.booking_id)
        return content

    def _count(self, legs: Legs, outcome: str) -> None:
        self._counter.labels(legs.style, outcome).inc()


def _unusable(params: Any) -> str | None:
    """Why a prefill leg's ``kv_transfer_params`` cannot take the decode leg's engine to its KV, or None.
    vLLM's NixlConnector (and MooncakeConnector) pulls the KV of a request with ``do_remote_prefill``
    from ``remote_block_ids`` on ``remote_engine_id`` at ``remote_host``:``remote_port``; without the
    ids it prefills the prompt itself unannounced (or, with tokens to pull and none named, fails it),
    without the rest it refuses it. An empty list is an answer: vLLM's connectors before "send every
    block" name none for a prompt shorter than a block (the decode side computes those few tokens)."""
    if not isinstance(params, dict):
        return "its answer has no kv_transfer_params (is it a P/D engine?)"
    if params.get("do_remote_prefill") is not True:
        return "its kv_transfer_params do not say do_remote_prefill"
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list):
        return "its kv_transfer_params name no remote_block_ids"
    missing = [name for name in _REMOTE_PREFILL_SOURCE if params.get(name) is None]
    if missing:
        return "its kv_transfer_params lack " + ", ".join(missing)
    return None


def _raised(leg: asyncio.Future[Any]) -> BaseException | None:
    """What a leg's task raised, if it has ended so (a cancellation is no failure of the leg's)."""
    return leg.exception() if leg.done() and not leg.cancelled() else None


def _early_outcome(failure: BaseException | None) -> str:
    """How a prefill leg that raised ``failure`` before the client had anything is counted: the
    request goes again (failed, or overloaded: the engine pacing us), or the refusal is the client's.
    Counted once, where the leg's fate is known (in bootstrap style, a failure once the decode leg
    began is ``prefill_failed_late`` alone)."""
    if isinstance(failure, Refused):
        return "prefill_refused"
    if isinstance(failure, PrefillFailed) and failure.answer is not None:
        return "prefill_overloaded"
    return "prefill_failed"


def _prefill_body(path: bytes, body: bytes, kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The client's body as a prefill leg: one token of one choice, not streamed (and the params, when
    given). One choice: an engine prefills ``n`` > 1 as that many requests, each holding its blocks, of
    which the decode leg would pull one set."""
    request = _decode(body)
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    request["stream"] = False
    if path == _RESPONSES:
        request["max_output_tokens"] = 1  # the Responses API's own bound (it has no max_tokens)
    else:
        request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    if "n" in request:
        request["n"] = 1
    request.pop("best_of", None)
    request.pop("stream_options", None)
    request.pop("min_tokens", None)
    return _encode(request)


class _Watched:
    """The client's answer, noting whether any of it went out (the decode leg may then no longer be
    given up for a failing prefill leg)."""

    __slots__ = ("answered", "authorization", "body", "given_up", "head", "reply", "sink", "whole_sent")

    def __init__(self, reply: StreamCall) -> None:
        self.reply = reply
        self.sink: _LastPiece | None = None
        self.body = reply.body
        self.authorization = reply.authorization
        self.head = reply.head
        self.answered = False
        self.whole_sent = False
        self.given_up = False  # the decode leg is being cancelled: what it still brings is dropped

    def is_disconnected(self) -> bool:
        return self.reply.is_disconnected()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        if self.given_up:
            return
        self.answered = True
        await self.reply.whole(status, headers, body)
        self.whole_sent = True

    def begin(self, status: int, headers: Headers) -> Sink:
        if self.given_up:
            return _DROPPED
        self.answered = True
        sink = self.sink = _LastPiece(self.reply.begin(status, headers))
        return sink

    async def end(self, last: bytes = b"") -> None:
        if self.given_up:
            return
        await self.reply.end(last)

    @property
    def finished(self) -> bool:
        """Whether the client has had its whole answer, or the stream's last event."""
        return self.whole_sent or (self.sink is not None and finished_stream(self.sink.last))


class _Dropped:
    """The sink of a decode leg given up: nothing reaches the client."""

    def write(self, data: bytes) -> bool:
        return False

    def when_drained(self, resume: Callable[[], None]) -> None:
        resume()

    def finish(self, data: bytes) -> None:
        return None


_DROPPED = _Dropped()


class _LastPiece:
    """The client's sink, keeping the last piece written to it."""

    __slots__ = ("last", "sink")

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.last = b""

    def write(self, data: bytes) -> bool:
        self.last = data
        return self.sink.write(data)

    def when_drained(self, resume: Callable[[], None]) -> None:
        self.sink.when_drained(resume)

    def finish(self, data: bytes) -> None:
        if data:
            self.last = data
        self.sink.finish(data)
