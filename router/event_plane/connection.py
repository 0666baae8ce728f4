"""Connecting to NATS with credentials and TLS, reconnecting forever."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client

__all__ = ["NatsOptions", "connect"]


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

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca_file or self.tls_cert_file):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context


async def connect(
    options: NatsOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """A client that retries its first connection and every later one without limit."""
    kwargs: dict[str, Any] = {
        "servers": [options.url],
        "name": options.name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "connect_timeout": 2,
    }
    if options.user is not None:
        kwargs["user"] = options.user
        kwargs["password"] = options.password
    if options.token is not None:
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
    return await nats.connect(**kwargs)
