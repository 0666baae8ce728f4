"""How a ``--processes`` child started again beside its siblings tells that one of them still serves
the port, by connecting to it (`api.server._SiblingProbe`): a connection refused means nobody does,
and the child then listens rather than leave the port unserved. Real sockets on loopback, bound as
the children bind theirs (``SO_REUSEPORT``); the whole behaviour runs in tests/test_ha_processes.py."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from api.listen import listening_socket
from api.server import SIBLING_PROBES_UNTOLD, _SiblingProbe
from router.event_plane.embedded_server import free_port

pytestmark = pytest.mark.anyio


@contextmanager
def bound(host: str, port: int, *, listening: bool = False) -> Iterator[socket.socket]:
    sock = listening_socket(host, port, reuse_port=True)
    try:
        if listening:
            sock.listen()
        yield sock
    finally:
        sock.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::"])
async def test_a_sibling_listening_serves_until_it_closes(host: str) -> None:
    if host == "::" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    port = free_port()
    with bound(host, port) as held:  # the waiting child's own socket: bound, not listening
        probe = _SiblingProbe(held)
        with bound(host, port, listening=True):
            assert await probe.serving()
            assert await probe.serving()  # each probe's connection closed at once, nothing held
        assert not await probe.serving()  # refused: only the waiting child's socket is bound there


async def test_probes_that_cannot_tell_end_the_wait_after_a_few(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    with bound("127.0.0.1", port) as held, bound("127.0.0.1", port, listening=True):
        probe = _SiblingProbe(held)
        # An address no connection can even be tried on (an IPv4 host for an IPv6 socket): no answer.
        probe._addresses = [(socket.AF_INET6, ("127.0.0.1", port, 0, 0))]
        with caplog.at_level(logging.WARNING, logger="api.server"):
            told = [await probe.serving() for _ in range(SIBLING_PROBES_UNTOLD)]
    assert told == [True] * (SIBLING_PROBES_UNTOLD - 1) + [False]
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == SIBLING_PROBES_UNTOLD
    assert all(line.startswith("cannot tell whether another process serves the port (") for line in lines)
    assert lines[-1].endswith(": listening")
