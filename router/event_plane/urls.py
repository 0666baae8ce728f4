"""NATS URLs as they may be shown: a URL can carry credentials (``nats://user:password@host:port``,
``nats://token@host:port``), and logs, HTTP bodies and printed settings must never repeat them."""

from __future__ import annotations

__all__ = ["redact_nats_url"]


def redact_nats_url(url: str) -> str:
    """``url`` with each server's credentials (its userinfo, a token alone included) replaced by
    ``***``: ``nats://***@host:4222``; a cluster's comma-separated URLs each alike; a URL without
    credentials unchanged. Nothing is imported for it (the settings show it without nats-py)."""
    return ",".join(_redact_server(server) for server in url.split(","))


def _redact_server(server: str) -> str:
    scheme, sep, rest = server.partition("://")
    if not sep:
        scheme, rest = "", server
    _, at, host = rest.rpartition("@")  # the last @: a password may hold one unescaped
    if not at:
        return server
    return f"{scheme}{sep}***@{host}"
