"""Connecting to NATS with credentials and TLS: fail fast (or retry with capped backoff) on the first
connection, reconnect forever after it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import nats
from nats.aio.client import Client
from nats.errors import AuthorizationError, NoServersError
from nats.errors import Error as NatsError

from router.event_plane.urls import redact_nats_url

__all__ = [
    "NatsOptions",
    "NatsSettings",
    "check_creds_file",
    "check_nats_url",
    "close_connection",
    "connect",
    "connect_when_available",
    "is_authorization_error",
    "nats_servers",
]


class NatsSettings(Protocol):
    """The NATS fields every settings section that connects shares (the service's, the bridge's)."""

    @property
    def nats_url(self) -> str | None: ...
    @property
    def nats_user(self) -> str | None: ...
    @property
    def nats_password(self) -> str | None: ...
    @property
    def nats_token(self) -> str | None: ...
    @property
    def nats_creds_file(self) -> str | None: ...
    @property
    def nats_tls_ca_file(self) -> str | None: ...
    @property
    def nats_tls_cert_file(self) -> str | None: ...
    @property
    def nats_tls_key_file(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class NatsOptions:
    url: str
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    name: str = "kv-router"
    # The server does not deliver this connection's own messages back to its subscriptions.
    no_echo: bool = False

    @classmethod
    def from_settings(cls, settings: NatsSettings, *, name: str = "kv-router") -> NatsOptions:
        if settings.nats_url is None:
            raise ValueError("no NATS URL is configured")
        return cls(
            url=settings.nats_url,
            user=settings.nats_user,
            password=settings.nats_password,
            token=settings.nats_token,
            creds_file=settings.nats_creds_file,
            tls_ca_file=settings.nats_tls_ca_file,
            tls_cert_file=settings.nats_tls_cert_file,
            tls_key_file=settings.nats_tls_key_file,
            name=name,
        )

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca_file or self.tls_cert_file):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context


def check_certificate(cert_file: str, key_file: str | None) -> None:
    """Raise `ValueError` naming the problem unless the PEM certificate ``cert_file`` and its private key
    ``key_file`` (None: in the certificate's file) load as a pair: read at start-up, not met as a
    traceback once serving (HTTPS) or at every connection attempt (NATS)."""

    def encrypted() -> str:
        raise ValueError(f"the private key in {key_file or cert_file} is encrypted: give an unencrypted one")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=encrypted)
    except ssl.SSLError as exc:
        key = "its private key" if key_file is None else key_file
        raise ValueError(
            f"{cert_file} and {key} are not a PEM certificate and its private key ({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read {cert_file} or {key_file}: {exc.strerror or exc}") from None


def check_creds_file(path: str) -> None:
    """Raise `ValueError` naming the problem unless ``path`` is a readable ``.creds`` file with a user
    JWT and a user nkey seed (nats-py would otherwise fail on every connection attempt)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the NATS credentials file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read the NATS credentials file {path}: {exc}") from None
    for section in ("NATS USER JWT", "USER NKEY SEED"):
        if f"BEGIN {section}" not in text:
            raise ValueError(f"{path} is not a NATS credentials file: it has no {section} section (nsc writes them)")


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_servers(url: str) -> list[str]:
    """The servers of ``url``: one URL, or several separated by commas (a NATS cluster's, as its
    clients write it), which nats-py takes as a list (it cannot parse the joined string)."""
    return [server.strip() for server in url.split(",") if server.strip()]


def check_nats_url(url: str) -> None:
    """Raise `ValueError` naming the problem unless ``url`` is a NATS URL (``nats://``, ``tls://``,
    ``ws://``, ``wss://``, or a bare ``HOST:PORT``), or several separated by commas: nats-py would try
    to resolve ``http`` as a host."""
    servers = nats_servers(url)
    if not servers:
        raise ValueError(f"{redact_nats_url(url)!r} is not a NATS URL: it names no host")
    for server in servers:
        _check_one_nats_url(server)


def _check_one_nats_url(url: str) -> None:
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() not in NATS_SCHEMES:
        hint = (
            " (http:// is the router's HTTP API; its NATS URL is in GET /v1/info)" if scheme.startswith("http") else ""
        )
        raise ValueError(
            f"{redact_nats_url(url)!r} is not a NATS URL: use nats://HOST:PORT (or tls://, ws://, wss://){hint}"
        )
    if sep and not rest.strip("/"):
        raise ValueError(f"{redact_nats_url(url)!r} is not a NATS URL: it names no host")


def is_authorization_error(error: BaseException) -> bool:
    """The server refused the client's credentials (nats-py raises a plain error with the server's words)."""
    return isinstance(error, NatsError) and (
        isinstance(error, AuthorizationError) or "authorization violation" in str(error).lower()
    )


async def connect(
    options: NatsOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_error: Callable[[Exception], Awaitable[None]] | None = None,
    token_source: Callable[[], str] | None = None,
) -> Client:
    """Connect now or raise (``OSError``, ``TimeoutError`` or a nats error naming why); once connected,
    the client reconnects without limit. ``on_error`` receives the client's asynchronous errors (failed
    reconnection attempts among them) instead of nats-py's default, which logs each with a traceback.
    ``token_source``, when given, is asked for the token at every connection and reconnection (in place
    of ``options.token``): a restarted embedded server has a new one."""
    failures: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        # A refusal of the credentials is the reason, even when a later try only saw the server hang up.
        if not (failures and is_authorization_error(failures[-1]) and not is_authorization_error(exc)):
            failures[:] = [exc]
        if on_error is not None:
            await on_error(exc)

    kwargs: dict[str, Any] = {
        "servers": nats_servers(options.url),
        "name": options.name,
        # Two tries, then the first connection fails; raised to unlimited once connected (below).
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "connect_timeout": 2,
        "error_cb": error_cb,
        "no_echo": options.no_echo,
    }
    if options.user is not None:
        kwargs["user"] = options.user
        kwargs["password"] = options.password
    if token_source is not None:
        kwargs["token"] = token_source
    elif options.token is not None:
        kwargs["token"] = options.token
    if options.creds_file is not None:
        kwargs["user_credentials"] = options.creds_file
    tls = options.tls_context()
    if tls is not None:
        kwargs["tls"] = tls
    if on_reconnect is not None:
        kwargs["reconnected_cb"] = on_reconnect
    if on_disconnect is not None:
        kwargs["disconnected_cb"] = on_disconnect
    try:
        nc = await nats.connect(**kwargs)
    except NoServersError:
        # nats-py reports only that no server is left; the reason is the last attempt's error.
        if failures:
            raise failures[-1] from None
        raise
    # nats-py has one limit for the first connection and for reconnections; after the first
    # connection the client must never give up (the options dict is what its reconnect loop reads).
    nc.options["max_reconnect_attempts"] = -1
    return nc


async def connect_when_available(
    options: NatsOptions,
    *,
    on_attempt_failed: Callable[[int, float, Exception], None],
    first_backoff_s: float = 0.5,
    max_backoff_s: float = 5.0,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_error: Callable[[Exception], Awaitable[None]] | None = None,
) -> Client:
    """`connect`, retried until the server answers: ``on_attempt_failed(attempt, backoff_s, error)``
    after each failure, then a wait that doubles up to ``max_backoff_s``. Cancel it to give up."""
    backoff = first_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return await connect(options, on_reconnect=on_reconnect, on_disconnect=on_disconnect, on_error=on_error)
        except (OSError, TimeoutError, NatsError) as exc:
            on_attempt_failed(attempt, backoff, exc)
        await asyncio.sleep(backoff)
        backoff = min(max_backoff_s, backoff * 2)


async def close_connection(nc: Client) -> None:
    """Close ``nc``; a connection NATS dropped meanwhile (nats-py raises the lost transport's error
    while flushing what it buffered) is closed all the same: nothing could have taken those bytes."""
    with contextlib.suppress(OSError, NatsError):
        await nc.close()
