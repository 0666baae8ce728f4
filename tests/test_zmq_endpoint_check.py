"""Every ZMQ endpoint a user gives (``serve --engine``'s event and ``replay=`` sockets, ``bridge
--zmq-endpoint`` and ``--replay-endpoint``) is checked at start-up by one rule: without ``tcp://`` (or
``ipc://``), or with the engine's bind address (``tcp://*:PORT``, vLLM's documented value, or no host),
or a port outside 1-65535, the command says so in one line on stderr and exits 2, never retrying a
socket ZMQ refuses (a ZMQError traceback every few seconds, forever) nor one it connects nowhere.
A stream or replay given such an endpoint anyway fails at once: its start, or the replay.

Real ``kv-router serve`` and ``bridge`` processes (the bridge with a real nats-server to reach), each
ended by its own exit or, should it hang, killed by its PID when ``subprocess.run`` times out.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import threading
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from router.config import RouterConfig
from router.engines.direct import SequencerSink
from router.engines.engine_spec import EndpointRefused, check_zmq_endpoint, is_ipv6_literal, parse_engine_spec
from router.engines.zmq_stream import END_SEQ, ReplayError, ZmqEngineStream, replay_batches
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.kv_router import KvRouter
from tests.router_processes import ROOT, kv_router_command
from tests.waiting import eventually

TIMEOUT_S = 40  # the old code never exited: the run would time out


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "tcp://127.0.0.1", "tcp://h:x", "udp://h:1", "tcp://h:1=2"])
def test_an_endpoint_without_tcp_scheme_and_port_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"the replay endpoint must be tcp://HOST:PORT, got '"):
        check_zmq_endpoint(endpoint, "replay")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://host.example:1", "ipc:///x"])
def test_tcp_and_ipc_endpoints_pass(endpoint: str) -> None:
    check_zmq_endpoint(endpoint, "event")


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///x"])
def test_an_address_to_bind_may_name_every_interface(endpoint: str) -> None:
    check_zmq_endpoint(endpoint, "event", bind=True)


@pytest.mark.parametrize("endpoint", ["tcp://:5557", "tcp://*:0", "tcp://*:65536", "tcp://*:x", "tcp://nohost"])
def test_an_address_to_bind_without_host_or_a_port_in_range_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"the event endpoint"):
        check_zmq_endpoint(endpoint, "event", bind=True)


@pytest.mark.parametrize(
    ("endpoint", "said"),
    [
        ("tcp://*:5558", "the replay endpoint 'tcp://*:5558' is a bind address (* binds every interface): give "
         "the engine's address to connect to, not the address it binds, e.g. tcp://127.0.0.1:5558"),
        ("tcp://:5558", "the replay endpoint 'tcp://:5558' has no host: give the engine's address"),
        ("tcp://127.0.0.1:99999",
         "the replay endpoint 'tcp://127.0.0.1:99999' has port 99999: a TCP port is 1 to 65535"),
        ("tcp://127.0.0.1:0", "the replay endpoint 'tcp://127.0.0.1:0' has port 0: a TCP port is 1 to 65535"),
    ],
)  # fmt: skip
def test_a_bind_address_or_a_port_out_of_range_is_refused_saying_what_to_give(endpoint: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        check_zmq_endpoint(endpoint, "replay")


@pytest.mark.anyio
async def test_a_stream_whose_endpoint_zmq_refuses_fails_its_start_and_a_replay_fails_as_a_replay() -> None:
    """Past the check (a stream made in code): the start raises at once, leaving nothing running, where it
    waited forever on a reader that crashed and restarted; a replay fails as any replay, where its
    ZMQError crashed the stream's apply loop again and again."""
    router = KvRouter(RouterConfig(block_size=4))
    stream = ZmqEngineStream(SequencerSink(router, 1), "tcp://*:5557", block_size=4)
    with pytest.raises(EndpointRefused, match=re.escape("ZMQ refuses the event endpoint 'tcp://*:5557'")):
        await asyncio.wait_for(stream.start(), 10)
    await stream.stop()
    with pytest.raises(ReplayError, match=re.escape("ZMQ refuses the replay endpoint 'tcp://*:5558'")):
        await replay_batches(zmq.asyncio.Context.instance(), "tcp://*:5558", 0)


def test_an_engine_spec_checks_its_replay_endpoint_as_its_event_endpoint() -> None:
    with pytest.raises(ValueError, match=re.escape("the event endpoint must be tcp://HOST:PORT, got '127.0.0.1:5557'")):
        parse_engine_spec("1=127.0.0.1:5557")
    with pytest.raises(
        ValueError, match=re.escape("the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558'")
    ):
        parse_engine_spec("1=tcp://127.0.0.1:5557,replay=127.0.0.1:5558")


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kv_router_command(), *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                          cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("1=tcp://127.0.0.1:5557,replay=127.0.0.1:5558",
         "the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558' (from flag --engine)"),
        # The engine's bind address copied: the service neither served nor stopped on SIGTERM.
        ("1=tcp://*:5557", "the event endpoint 'tcp://*:5557' is a bind address"),
        ("1=tcp://127.0.0.1:5557,replay=tcp://*:5558", "the replay endpoint 'tcp://*:5558' is a bind address"),
    ],
)  # fmt: skip
def test_serve_refuses_an_engine_endpoint_it_cannot_connect_to(tmp_path: Path, spec: str, said: str) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    done = _run("serve", "--port", str(free_port()), "--no-embedded-nats", "--engine", spec, env=env)
    assert said in _one_line(done)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--zmq-endpoint", "127.0.0.1:5557"],
            "kv-router bridge: zmq_endpoint: the event endpoint must be tcp://HOST:PORT, got '127.0.0.1:5557' "
            "(from flag --zmq-endpoint)",
        ),
        (
            ["--zmq-endpoint", "tcp://127.0.0.1:{port}", "--replay-endpoint", "127.0.0.1:5558"],
            "kv-router bridge: replay_endpoint: the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558' "
            "(from flag --replay-endpoint)",
        ),
        (  # vLLM's documented bind value, copied: the bridge's apply loop crashed forever and it exited 0
            ["--zmq-endpoint", "tcp://127.0.0.1:{port}", "--replay-endpoint", "tcp://*:5558"],
            "kv-router bridge: replay_endpoint: the replay endpoint 'tcp://*:5558' is a bind address (* binds every "
            "interface): give the engine's address to connect to, not the address it binds, e.g. "
            "tcp://127.0.0.1:5558 for an engine on this host (from flag --replay-endpoint)",
        ),
        (
            ["--zmq-endpoint", "tcp://127.0.0.1:99999"],
            "kv-router bridge: zmq_endpoint: the event endpoint 'tcp://127.0.0.1:99999' has port 99999: a TCP port "
            "is 1 to 65535 (from flag --zmq-endpoint)",
        ),
    ],
)
def test_bridge_refuses_endpoints_without_tcp(tmp_path: Path, flags: list[str], said: str) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    port = free_port()
    with EmbeddedNats() as nats:  # reachable: the old bridge got past NATS and looped on the socket
        done = _run("bridge", "--worker-id", "3", "--nats-url", nats.url,
                    *[flag.format(port=port) for flag in flags], env=env)  # fmt: skip
    assert _one_line(done) == said


def _ipv6_loopback_port() -> int:
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.anyio
async def test_an_engine_at_an_ipv6_address_is_heard_and_replayed() -> None:
    """``tcp://[::1]:PORT`` (the form an IPv6 pod's address takes) passes the check; the stream's SUB
    socket and its replay DEALER connect to it (libzmq connects to no IPv6 address without ZMQ_IPV6:
    they waited forever, heard nothing, and every replay timed out)."""
    context = zmq.asyncio.Context.instance()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    for bound in (pub, replay):
        bound.setsockopt(zmq.LINGER, 0)
        bound.setsockopt(zmq.IPV6, 1)
    events, replay_endpoint = f"tcp://[::1]:{_ipv6_loopback_port()}", f"tcp://[::1]:{_ipv6_loopback_port()}"
    pub.bind(events)
    replay.bind(replay_endpoint)
    stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "medium": "GPU",
              "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None}  # fmt: skip
    batch = msgspec.msgpack.encode([1.0, [stored], 0])

    async def answer_one_replay() -> None:
        identity, _, _ = await replay.recv_multipart()
        await replay.send_multipart([identity, b"", b"", (0).to_bytes(8, "big"), batch])
        await replay.send_multipart([identity, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    stream = ZmqEngineStream(SequencerSink(KvRouter(RouterConfig(block_size=4)), 1), events, block_size=4)
    await stream.start()
    try:
        answering = asyncio.create_task(answer_one_replay())
        assert await replay_batches(context, replay_endpoint, 0, timeout_s=5.0) == [(0, batch)]
        await answering

        async def heard() -> bool:  # published until heard: a PUB drops what precedes the subscription
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), batch])
            return stream.stats["applied"] >= 1

        await eventually(heard, 10, "the engine's batch over IPv6")
    finally:
        await stream.stop()
        pub.close()
        replay.close()


def test_only_an_ipv6_literal_turns_ipv6_on() -> None:
    """ZMQ_IPV6 makes libzmq look a host name up as IPv6 alone: ``tcp://localhost:PORT`` would go to
    ``[::1]`` (the usual /etc/hosts) where an engine bound to ``tcp://*:PORT`` listens on IPv4 only,
    heard from never. Only a bracketed address turns it on."""
    assert is_ipv6_literal("tcp://[::1]:5557") and is_ipv6_literal("tcp://[fd00::12]:5557")
    assert not any(map(is_ipv6_literal, ("tcp://localhost:5557", "tcp://127.0.0.1:5557", "ipc:///tmp/kv")))


class _AcceptAndClose:
    """A TCP listener that accepts each connection and closes it at once (a port-forward or proxy with
    no engine behind it, or an endpoint that is not a ZMQ PUB socket); counts them. It accepts in a
    thread, stopped by `close`: a task accepting, cancelled just as a connection came, lost the socket
    it had accepted, left open until the garbage collector met it in a later test."""

    def __init__(self) -> None:
        self.accepted = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.05)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="accept-and-close", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        self._listener.close()


@pytest.mark.anyio
async def test_a_peer_that_drops_every_connection_is_asked_no_faster_than_libzmq_retries() -> None:
    """A connection that ends is left to libzmq to make again (every 100 ms), and made afresh here only
    when no handshake followed, after a wait that doubles: before, each one ended was made again at
    once, thousands a second at a full core against a peer that accepts and drops them."""
    peer = _AcceptAndClose()
    stream = ZmqEngineStream(SequencerSink(KvRouter(RouterConfig(block_size=4)), 1), peer.endpoint, block_size=4)
    await stream.start()
    try:
        await asyncio.sleep(2.0)
        assert 5 <= peer.accepted <= 60, peer.accepted  # libzmq's own retries: about 20 in 2 s
        assert 1 <= stream.stats["reconnects"] <= 3
    finally:
        await stream.stop()
        peer.close()


@pytest.mark.anyio
async def test_batches_received_before_the_engine_goes_away_are_all_read() -> None:
    """An engine that publishes a burst and stops (its socket closed with the batches on their way):
    every batch that reached this host is read. Before, the connection's end was answered by
    disconnecting the socket at once, which dropped what libzmq held for it unread (768 of 20,000)."""
    context = zmq.asyncio.Context.instance()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 5000)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    stream = ZmqEngineStream(SequencerSink(KvRouter(RouterConfig(block_size=4)), 1), endpoint, block_size=4)
    await stream.start()
    try:
        await asyncio.wait_for(pub.recv(), 10)  # the subscription: what is sent from now on is delivered
        removed = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}], 0])
        sent = 8_000  # within the stream's queue: none dropped for want of room
        for seq in range(sent):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), removed])
        pub.close()
        await eventually(lambda: stream.stats["messages"] == sent, 10, "every batch sent read")
    finally:
        await stream.stop()
        pub.close()
