"""Bearer-token access control: which routes need ``Authorization: Bearer <token>``, and the check.

Every route belongs to one `Access` class. With an API token configured, `Access.ADMIN` routes (those
that change state other than bookings: ``/v1/events``, worker registration and removal) always need
the token; `Access.DECISION` routes (``/v1/new``, ``/v1/router``, ``mark_*``, ``potential_loads``,
``overlap``, and the OpenAI proxy's routes) need it with ``protect_decisions``; `Access.READ` routes
(``GET /v1/workers``, ``/v1/dump``, ``/metrics``, ``/docs``) with ``protect_reads``; `Access.PROBE`
(``/healthz``, ``/readyz``) with ``protect_probes``. Without a token nothing is checked.

`ApiAuth` is the one check, used on every path a request can take: the hot routes' handlers are
wrapped by `ApiAuth.guard` (so kv-router's HTTP protocol and FastAPI's routes both reach the same
check), FastAPI's other routes declare `ApiAuth.dependency`, and code outside both
(the OpenAI proxy's routes) calls `ApiAuth.refuse` with the request's headers, or `ApiAuth.require`
with its ``Authorization`` header. The token is
compared in constant time (`hmac.compare_digest` over SHA-256 digests, so not even its length leaks)
and never appears in a log line, an error message or a repr.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import Depends, Request

from api.codec import Call, Reply
from api.errors import ApiError, error_reply

__all__ = ["Access", "ApiAuth", "Unauthorized", "unauthorized_reply"]


class Access(enum.Enum):
    """What a route does, which decides when it needs the token."""

    ADMIN = "admin"  # changes the router's state other than bookings
    DECISION = "decision"  # routing decisions and the bookings they make
    READ = "read"  # state, metrics and documentation, read only
    PROBE = "probe"  # liveness and readiness


class Unauthorized(ApiError):
    """The route needs the API token and the request did not carry it."""

    status = 401
    type = "unauthorized"
    headers = (("www-authenticate", 'Bearer realm="kv-router"'),)  # RFC 6750: name the scheme to use


_MESSAGE = "this route needs the API token: Authorization: Bearer <token>"


def unauthorized_reply() -> Reply:
    mapped = error_reply(Unauthorized(_MESSAGE))
    assert mapped is not None
    return Reply(mapped[0], mapped[2], headers=Unauthorized.headers)


_UNAUTHORIZED = unauthorized_reply()


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiAuth:
    """The configured token (or none) and which access classes it guards."""

    __slots__ = ("_digest", "_guarded")

    def __init__(
        self,
        token: str | None,
        *,
        protect_decisions: bool = False,
        protect_reads: bool = False,
        protect_probes: bool = False,
    ) -> None:
        self._digest = None if token is None else _digest(token.encode())
        guarded = {Access.ADMIN}
        if protect_decisions:
            guarded.add(Access.DECISION)
        if protect_reads:
            guarded.add(Access.READ)
        if protect_probes:
            guarded.add(Access.PROBE)
        self._guarded = frozenset(guarded) if token is not None else frozenset()

    def __repr__(self) -> str:  # never the token
        classes = sorted(a.value for a in self._guarded)
        return f"ApiAuth(token={'***' if self._digest else None}, guarded={classes})"

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def guards(self, access: Access) -> bool:
        return access in self._guarded

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries the token (scheme ``Bearer``, any case)."""
        if self._digest is None:
            return True
        if authorization is None:
            return False
        value = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
        scheme, _, credentials = value.strip().partition(b" ")
        # Compare digests even for a wrong scheme, so the time taken says nothing about the header.
        matches = hmac.compare_digest(_digest(credentials.strip()), self._digest)
        return matches and scheme.lower() == b"bearer"

    def require(self, access: Access, authorization: str | bytes | None) -> None:
        """Raise `Unauthorized` unless ``access`` is open or the header carries the token. For code
        outside the routes here (the OpenAI proxy calls it with `Access.DECISION`)."""
        if access in self._guarded and not self.allows(authorization):
            raise Unauthorized(_MESSAGE)

    def refuse(self, access: Access, headers: Iterable[tuple[bytes, bytes]]) -> Reply | None:
        """For routes answering in their own error shape (the OpenAI proxy's): the 401 to send for a request
        with these ASGI ``headers``, or None if it may pass."""
        if access not in self._guarded:
            return None
        authorization = next((value for name, value in headers if name == b"authorization"), None)
        return None if self.allows(authorization) else _UNAUTHORIZED

    def guard(
        self,
        access: Access,
        handler: Callable[[Call], Reply | Coroutine[Any, Any, Reply]],
        refused: Callable[[], None] | None = None,
    ) -> Callable[[Call], Reply | Coroutine[Any, Any, Reply]]:
        """``handler`` itself if ``access`` is open (the hot path pays nothing), else a handler that
        answers 401 (and calls ``refused``, to count it) before ``handler`` runs unless the call
        carries the token."""
        if access not in self._guarded:
            return handler
        allows = self.allows

        def checked(call: Call) -> Reply | Coroutine[Any, Any, Reply]:
            if not allows(call.authorization):
                if refused is not None:
                    refused()
                return _UNAUTHORIZED
            return handler(call)

        return checked

    def dependency(self, access: Access) -> Any:
        """A FastAPI dependency (``dependencies=[...]``) enforcing `require` for a route."""

        def check(request: Request) -> None:
            self.require(access, request.headers.get("authorization"))

        return Depends(check)
