"""What the proxy reads of a client's headers besides its credentials, and what it adds to the answer.

* Request id: the header ``proxy_request_id_header`` (``X-Request-Id``) as the client sent it (at
  most 256 visible ASCII characters, the decision API's `api.wire.RequestId`), else the booking's id;
  sent to the worker under the same name and echoed on every answer, refusals included. The booking
  itself always has a fresh id (two clients may send the same one).
* W3C trace context: ``traceparent`` (and ``tracestate``) passed to the worker as they came, so the
  engine's spans join the client's trace (the proxy is not a span of its own unless it exports spans),
  when the ``traceparent`` is one (`valid_traceparent`); else neither is passed, as W3C Trace Context
  asks of a malformed one (a vendor's state without its trace, or garbage, in the engine's spans).
* CORS (`api.cors`): the answer's headers for the request's ``Origin``.

`WithHeaders` adds the answer's headers to every reply a handler writes. Per request: a lower-casing
and a search of the head per header read (a few hundred bytes).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from api.config import ProxyConfig
from api.cors import Cors
from api.http_stream import Headers, Sink, StreamCall, header_value
from api.proxy.tracing import ProxyTracing, RequestSpan, Timeline
from api.wire import is_request_id
from router.request_ids import new_request_id

__all__ = ["ClientHeaders", "Passed", "WithHeaders", "valid_traceparent"]

_TRACE = (b"traceparent", b"tracestate")
# version-traceid-parentid-flags in lower-case hex; a later version may append fields after a dash.
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?", re.DOTALL)


def valid_traceparent(value: bytes) -> bool:
    """W3C Trace Context's rules: the four fields, version ff refused, version 00 with nothing after
    them, trace and parent ids not all zeros."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest is not None):
        return False
    return trace_id.strip(b"0") != b"" and parent_id.strip(b"0") != b""


class Passed(NamedTuple):
    """One request's: its id, the header lines for the worker, the headers of its answer, its span."""

    request_id: str
    upstream: bytes
    answer: Headers
    span: RequestSpan | None = None


class ClientHeaders:
    def __init__(self, config: ProxyConfig, cors: Cors | None, tracing: ProxyTracing | None = None) -> None:
        self.name = config.proxy_request_id_header.lower().encode("latin-1")
        self._cors = cors if cors is not None and cors.enabled else None
        self._tracing = tracing

    def read(self, call: StreamCall, booking_id: str, route: str = "") -> Passed:
        head = call.head
        lowered = b"\n" + head.lower()
        request_id, answer = self._answer(head, lowered, booking_id)
        line = self.name + b": " + request_id.encode("latin-1") + b"\r\n"
        upstream = [line]
        span = None
        traceparent = tracestate = None
        if b"\ntraceparent" in lowered:
            traceparent, tracestate = (header_value(head, name, lowered) for name in _TRACE)
            if traceparent is not None and not valid_traceparent(traceparent):
                traceparent = tracestate = None
        if self._tracing is not None:  # the proxy's span is the worker's parent
            span = self._tracing.begin(route, traceparent, tracestate)
            upstream.append(b"traceparent: " + span.traceparent + b"\r\n")
        elif traceparent:
            upstream.append(b"traceparent: " + traceparent + b"\r\n")
        if tracestate:
            upstream.append(b"tracestate: " + tracestate + b"\r\n")
        return Passed(request_id, b"".join(upstream), answer, span)

    def unread(self, head: bytes) -> Headers:
        """The headers of an answer given before the request is read (its 401, its 413), from its
        header lines: its request id (the client's, else a fresh one: nothing is booked) and CORS."""
        return self._answer(head, b"\n" + head.lower(), new_request_id())[1]

    def _answer(self, head: bytes, lowered: bytes, fallback: str) -> tuple[str, Headers]:
        """The request id (the client's when it is one, else ``fallback``) and the headers every
        answer carries: that id, and CORS. ``lowered``: ``b"\\n"`` and the head in lower case."""
        given = (header_value(head, self.name, lowered) or b"").decode("latin-1")
        request_id = given if is_request_id(given) else fallback
        answer = [(self.name, request_id.encode("latin-1"))]
        if self._cors is not None:
            answer += self._cors.answer_headers(header_value(head, b"origin", lowered))
        return request_id, answer


class WithHeaders:
    """A `StreamCall` whose every answer carries ``extra`` headers too."""

    __slots__ = ("_call", "_extra", "answered", "authorization", "body", "head", "timeline")

    def __init__(self, call: StreamCall, extra: Headers, timeline: Timeline | None = None) -> None:
        self._call = call
        self._extra = extra
        self.timeline = timeline  # the request's steps, for its exported span
        self.body = call.body
        self.authorization = call.authorization
        self.head = call.head
        self.answered = False  # a head went out: the answer can no longer be another

    def is_disconnected(self) -> bool:
        return self._call.is_disconnected()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.answered = True
        await self._call.whole(status, [*headers, *self._extra], body)

    def begin(self, status: int, headers: Headers) -> Sink:
        self.answered = True
        return self._call.begin(status, [*headers, *self._extra])

    async def end(self, last: bytes = b"") -> None:
        await self._call.end(last)
