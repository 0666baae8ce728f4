"""``kv-router mock-worker`` starts as ``kv-router serve`` does: each address it listens on (the HTTP
API's, the ZMQ endpoints') is bound before anything else, and one it cannot bind is one line on stderr
naming the address and the flag, exit code 1, no start-up line and nothing registered; once started,
its start-up line names its role.

Real ``kv-router mock-worker`` processes and a real nats-server with JetStream on free loopback ports,
the ports in use held by a listening socket of the test; each process ends by its own exit or is
stopped by its PID.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mocker import zmq_engine
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import ROOT, ToolProcess, kv_router_command
from tests.test_api_event_plane import registry_keys
from tests.waiting import until


@contextmanager
def port_in_use() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _mock_worker(nats_url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kv_router_command(), "mock-worker", "--nats-url", nats_url, *flags],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=os.environ.copy(),
    )  # fmt: skip


def test_an_http_port_in_use_is_one_line_exit_1_and_nothing_registered() -> None:
    with EmbeddedNats() as nats, port_in_use() as port:
        done = _mock_worker(nats.url, "--worker-id", "7", "--http-port", str(port))
        assert done.returncode == 1, done.stderr
        assert done.stderr == (
            f"kv-router mock-worker: cannot listen on 127.0.0.1:{port}: the port is in use "
            "(another kv-router mock-worker? --http-port picks another)\n"
        )
        assert done.stdout == ""  # no start-up line
        assert registry_keys(nats.url) == set()


@pytest.mark.parametrize("flag", ["--zmq-endpoint", "--replay-endpoint"])
def test_a_zmq_endpoint_in_use_is_one_line_exit_1_before_the_start_up_line(flag: str) -> None:
    with EmbeddedNats() as nats, port_in_use() as port:
        taken = f"tcp://127.0.0.1:{port}"
        endpoints = {"--zmq-endpoint": f"tcp://127.0.0.1:{free_port()}", "--replay-endpoint": None}
        endpoints[flag] = taken
        given = [part for name, endpoint in endpoints.items() if endpoint for part in (name, endpoint)]
        done = _mock_worker(nats.url, "--worker-id", "3", "--http-port", str(free_port()), "--block-size", "16", *given)
        assert done.returncode == 1, done.stderr
        assert (
            done.stderr
            == f"kv-router mock-worker: cannot bind {flag} {taken}: the port is in use ({flag} picks another)\n"
        )
        assert done.stdout == ""


def test_nats_without_jetstream_is_one_line_exit_2(plain_nats_url: str) -> None:
    """The worker registry is a JetStream bucket: on an operator's plain NATS (no ``-js``) the worker
    says so and what to do, where it died with nats-py's bare ServiceUnavailableError's traceback."""
    done = _mock_worker(plain_nats_url, "--worker-id", "4")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"kv-router mock-worker: NATS at {plain_nats_url}: JetStream did not answer for bucket "
        "kv_router_workers_default (not enabled on the NATS server, or a cluster without a leader yet), and "
        "kv-router keeps its worker registry there: start nats-server with -js (or `jetstream {}` in its config)\n"
    )


@pytest.mark.parametrize(
    ("flag", "endpoint", "said"),
    [
        ("--zmq-endpoint", "tcp://127.0.0.1:99999", "the event endpoint 'tcp://127.0.0.1:99999' has port 99999: a TCP "
         "port is 1 to 65535"),  # ZMQ binds it, as port 34463: subscribers told 99999 would never hear it
        ("--zmq-endpoint", "tcp://nohost", "the event endpoint must be tcp://HOST:PORT, got 'tcp://nohost'"),
        ("--replay-endpoint", "foo", "the replay endpoint must be tcp://HOST:PORT, got 'foo'"),
    ],
)  # fmt: skip
def test_a_malformed_endpoint_is_one_line_exit_2_before_anything_starts(flag: str, endpoint: str, said: str) -> None:
    """A usage error (exit 2, as the bridge's), said before NATS is asked: it exited 1 with ZMQ's
    "invalid argument", or bound a port out of range as its remainder."""
    endpoints = {"--zmq-endpoint": f"tcp://127.0.0.1:{free_port()}", flag: endpoint}
    given = [part for name, value in endpoints.items() for part in (name, value)]
    done = _mock_worker("nats://127.0.0.1:1", "--worker-id", "3", "--block-size", "16", *given)
    assert (done.returncode, done.stderr, done.stdout) == (2, f"kv-router mock-worker: {flag}: {said}\n", "")


def test_the_start_up_line_names_the_role(tmp_path: Path) -> None:
    with EmbeddedNats() as nats:
        http = free_port()
        flags = ("--nats-url", nats.url, "--worker-id", "5", "--role", "prefill", "--http-port", str(http))
        with ToolProcess(tmp_path, None, *flags) as worker:
            until(lambda: "mock worker 5 on" in worker.log() or worker.ended(), 60, "the start-up line")
            line = re.search(r"^mock worker 5 on .*$", worker.log(), re.MULTILINE)
            assert line is not None, worker.log()
            assert line.group(0) == (
                f"mock worker 5 on {nats.url} (namespace default, role prefill), "
                f"OpenAI API at http://127.0.0.1:{http} (model mock-model)"
            )


@pytest.mark.anyio
async def test_an_endpoint_another_program_holds_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a port this process let go of is worth waiting for: another's may be held for good.
    monkeypatch.setattr(zmq_engine, "_REBIND_WAIT_S", 60.0)
    with port_in_use() as port:
        publisher = zmq_engine.VllmZmqPublisher(f"tcp://127.0.0.1:{port}")
        started = time.monotonic()
        with pytest.raises(zmq_engine.EndpointBindError) as refused:
            await asyncio.wait_for(publisher.start(), timeout=20)
    assert time.monotonic() - started < 20
    assert (refused.value.endpoint, refused.value.replay, refused.value.in_use) == (
        f"tcp://127.0.0.1:{port}",
        False,
        True,
    )


def test_sigterm_ends_the_requests_in_flight_with_an_error_and_the_worker_exits(tmp_path: Path) -> None:
    """A stream and a whole answer in flight when the worker is told to stop: each ends in an error
    (the stream's last event, the answer a 503) and the worker exits 0, where the stream froze and the
    worker waited for its client to give up (30 s here, for ever without a client timeout)."""
    import openai

    with EmbeddedNats() as nats:
        http = free_port()
        flags = ("--nats-url", nats.url, "--worker-id", "8", "--http-port", str(http))
        with ToolProcess(tmp_path, None, *flags) as worker:
            until(lambda: "mock worker 8 on" in worker.log() or worker.ended(), 60, "the start-up line")

            async def in_flight() -> tuple[BaseException | None, BaseException | None]:
                client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="-", max_retries=0)
                whole = asyncio.create_task(client.completions.create(model="mock-model", prompt="hi", max_tokens=4000))
                stream = await client.completions.create(model="mock-model", prompt="hi", max_tokens=4000, stream=True)
                streamed: BaseException | None = None
                try:
                    async for chunk in stream:
                        if chunk.choices[0].text and worker.process.poll() is None:
                            worker.process.terminate()  # SIGTERM, once tokens flow
                except openai.APIError as exc:
                    streamed = exc
                answered = (await asyncio.gather(whole, return_exceptions=True))[0]
                await client.close()
                return streamed, answered if isinstance(answered, BaseException) else None

            started = time.monotonic()
            streamed, answered = asyncio.run(asyncio.wait_for(in_flight(), 20))
            assert worker.process.wait(10) == 0
            assert time.monotonic() - started < 15
            assert isinstance(streamed, openai.APIError) and "mock worker 8 stopped" in str(streamed)
            assert isinstance(answered, openai.InternalServerError) and answered.status_code == 503
