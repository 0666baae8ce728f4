"""A local tool's first connection to the routers' NATS (``kv-router mock-worker``, ``bridge``,
``replay --online``): retried for a while, with one progress line, and a final error naming the cause.

Tools are often started right after ``kv-router serve`` (``serve ... & mock-worker ... &``), before
its embedded nats-server is up and before it has written its connection file: each attempt reads the
connection file again (`with_local_credentials`), so the tool finds the server, its port and its
token as soon as the service has written them. Once connected the client reconnects forever
(`connect`), with the token the file holds at each attempt (a restarted service's embedded server has
a new one); only the first connection has a deadline. Losing NATS later, and reaching it again, is
said in the tool's log (a WARNING, then an INFO): nothing else would show that its events waited.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.errors import Error as NatsError

from router.event_plane.connection import NatsOptions, connect, is_authorization_error
from router.event_plane.connection_file import (
    DEFAULT_URL,
    ConnectionFileError,
    loopback_port,
    runtime_directory,
    with_local_credentials,
)
from router.event_plane.urls import redact_nats_url

__all__ = ["DEFAULT_WAIT_SECS", "FirstConnectionError", "LocalToolConnection", "connect_local"]

log = logging.getLogger(__name__)

DEFAULT_WAIT_SECS = 30.0
_PROGRESS_EVERY_SECS = 10.0


class FirstConnectionError(Exception):
    """No connection within the wait; the message names the cause and what to do (one line)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class LocalToolConnection:
    """How one local tool reaches the routers' NATS.

    ``url`` is the URL the user gave (None: none, so the local service's embedded server, wherever
    it listens); ``options`` carry it (or the default URL) and any credentials the user gave.
    """

    tool: str
    url: str | None
    options: NatsOptions
    connection_file: str | None = None
    wait_s: float = DEFAULT_WAIT_SECS

    def resolved(self) -> NatsOptions:
        """The options for the next attempt: completed by a running service's connection file."""
        return with_local_credentials(self.url, self.options, self.connection_file)

    async def connect(self, progress: Callable[[str], None] = _stderr) -> tuple[Client, NatsOptions]:
        """Connect, retrying until ``wait_s`` has passed; `FirstConnectionError` after it. Raises
        `ConnectionFileError` at once when a connection file given explicitly cannot be read, or when
        no URL was given and several services of this user run (`SeveralLocalServers`: which one?)."""
        started = time.monotonic()
        deadline = started + self.wait_s
        backoff = 0.25
        next_progress = 0.0
        while True:
            options = self.resolved()
            try:
                return await self._connect_telling_outages(options), options
            except (OSError, TimeoutError, NatsError) as exc:
                error: BaseException = exc
            now = time.monotonic()
            if self._given_credentials() and is_authorization_error(error):
                # The server answered and refused what the user gave: waiting cannot change that.
                raise FirstConnectionError(self._explain(options, error, waited=False))
            if now >= deadline:
                raise FirstConnectionError(self._explain(options, error))
            if now >= next_progress:
                reason = self._waiting_reason(options, error)
                url = redact_nats_url(options.url)
                progress(
                    f"{self.tool}: waiting for NATS at {url} ({reason}); retrying for up to {self.wait_s:.0f} s"
                    if next_progress == 0.0
                    else f"{self.tool}: still waiting for NATS at {url} ({reason}) after {now - started:.0f} s"
                )
                next_progress = now + _PROGRESS_EVERY_SECS
            await asyncio.sleep(min(backoff, max(0.0, deadline - now)))
            backoff = min(2.0, backoff * 2)

    async def _connect_telling_outages(self, options: NatsOptions) -> Client:
        """`connect`, the connection's later losses and returns logged (not its own close)."""
        url = redact_nats_url(options.url)
        client: Client | None = None

        async def lost() -> None:
            if client is not None and not client.is_closed:  # nats-py says so on close too
                log.warning("%s: lost NATS at %s; reconnecting (what it publishes meanwhile waits)", self.tool, url)

        async def back() -> None:
            log.info("%s: reached NATS at %s again", self.tool, url)

        client = await connect(options, on_disconnect=lost, on_reconnect=back, token_source=self._token_source(options))
        return client

    def _token_source(self, options: NatsOptions) -> Callable[[], str] | None:
        """For a token found in a service's connection file: the file read again at each reconnection.
        A restarted ``kv-router serve`` starts its embedded server with a new token, and the tool, still
        holding the old one, was refused for ever without a word."""
        if self._given_credentials() or options.token is None:
            return None
        last = options.token

        def current() -> str:
            nonlocal last
            try:
                found = self.resolved().token
            except ConnectionFileError:
                found = None  # unreadable for now (being rewritten): the last one known
            if found is not None and found != last:
                log.info("%s: the service's connection file has a new NATS token: reconnecting with it", self.tool)
                last = found
            return last

        return current

    def _waiting_reason(self, options: NatsOptions, error: BaseException) -> str:
        """Why this attempt failed, as the progress line says it. A local server that wants credentials
        while no connection file has a token is, while waiting, most likely a ``kv-router serve`` still
        starting (its embedded server listens a moment before the file with its token is written)."""
        given = options.token or options.user or options.creds_file
        local = self.url is None or loopback_port(self.url) is not None
        if is_authorization_error(error) and not given and local:
            return "it needs a token and no kv-router serve of this user has written its connection file yet"
        return _reason(error)

    def _given_credentials(self) -> bool:
        """The user gave credentials (not found in a service's connection file)."""
        return bool(self.options.token or self.options.user or self.options.creds_file)

    def _explain(self, options: NatsOptions, error: BaseException, *, waited: bool = True) -> str:
        after = f" after {self.wait_s:.0f} s" if waited else ""
        where = f"cannot connect to NATS at {redact_nats_url(options.url)}{after} ({_reason(error)})"
        found = options.token is not None and self.options.token is None
        directory = runtime_directory()
        files = f"in {directory}" if directory is not None else "(this user has no connection-file directory)"
        if is_authorization_error(error):
            if found:
                cause = (
                    "the server refused the token of the kv-router serve's connection file: that service has "
                    "restarted or stopped; start the tool again"
                )
            elif self._given_credentials():
                cause = "the server refused the credentials given"
            else:
                cause = (
                    f"that server needs credentials and no running kv-router serve of this user has a connection "
                    f"file for it {files}: it is another program's NATS; pass your router's --nats-url "
                    "(GET /v1/info on the router returns it), or its --nats-connection-file"
                )
        elif isinstance(error, OSError | TimeoutError):
            if self.url is None and not found:
                cause = (
                    f"no kv-router serve of this user is running (no connection file {files}) and nothing "
                    "listens there: start kv-router serve first, or pass --nats-url with the URL it uses "
                    "(it logs it at start-up; GET /v1/info returns it)"
                )
            else:
                cause = (
                    "nothing answers there: is the NATS server (or kv-router serve) running, and is --nats-url the "
                    "router's (GET /v1/info on the router returns it)?"
                )
        else:
            cause = "check the URL and the server's log"
        return f"{where}: {cause}"


def _reason(error: BaseException) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if is_authorization_error(error):
        return "Authorization Violation"
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def connect_local(
    url: str | None = None, *, name: str = "kv-router-client", wait_s: float = DEFAULT_WAIT_SECS
) -> Client:
    """A client of the routers' NATS found the way ``kv-router mock-worker`` finds it: ``url``, or
    without one the embedded NATS of the ``kv-router serve`` running on this host (its URL and token
    from its connection file; `SeveralLocalServers` when several run, none on port 4222), else
    ``nats://127.0.0.1:4222``; retried for ``wait_s``."""
    connection = LocalToolConnection(name, url, NatsOptions(url or DEFAULT_URL, name=name), wait_s=wait_s)
    nc, _ = await connection.connect()
    return nc
