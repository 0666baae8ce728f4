"""Binding a command's HTTP address first, so that a port in use or a host that does not resolve is one
line naming the address, before anything starts: ``kv-router serve`` and ``kv-router mock-worker``.

Kept apart from `api.server` so that a command other than the service binds the same way without
importing the service.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

__all__ = ["SERVE_FLAGS", "AddressFlags", "ListenError", "listening_socket"]


class ListenError(OSError):
    """A command cannot listen on its address; the message is one line naming it and why."""


@dataclass(frozen=True, slots=True)
class AddressFlags:
    """What a `ListenError` tells the user to change: the command's flags for the address, and what
    usually holds the port already."""

    host: str = "--host"
    port: str = "--port"
    usual_holder: str = "kv-router serve"


SERVE_FLAGS = AddressFlags()


def _bind_reason(code: int, flags: AddressFlags) -> str | None:
    if code == errno.EADDRINUSE:
        return f"the port is in use (another {flags.usual_holder}? {flags.port} picks another)"
    if code == errno.EADDRNOTAVAIL:
        return f"no interface of this host has that address ({flags.host})"
    if code == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return None


def listening_socket(
    host: str, port: int, *, reuse_port: bool = False, flags: AddressFlags = SERVE_FLAGS
) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 preferred for a name), not yet listening, or
    `ListenError` naming the address and, where it helps, the flag in ``flags`` to change."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        candidates = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {shown}: the host does not resolve ({exc.strerror})") from None
    family, _, _, _, address = min(candidates, key=lambda c: c[0] != socket.AF_INET)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # Every process binds its own socket to the address; the kernel spreads connections over them.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        reason = _bind_reason(exc.errno or 0, flags) or exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {shown}: {reason}") from None
    return sock
