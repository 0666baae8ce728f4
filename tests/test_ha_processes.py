"""``kv-router serve --processes 2``: two router processes share one port (SO_REUSEPORT), each a
replica; every connection, whichever process answers it, sees the same load, and a child killed with
SIGKILL is started again by the parent and catches up, its index included (from the workers)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.types import WorkerConfig
from tests.metrics import sample
from tests.nats_proxy import LossyNatsProxy
from tests.router_processes import ROOT, RouterProcess, get, running
from tests.test_api_support import prompt, stored_event
from tests.test_never_blind import pairs, tokens
from tests.waiting import eventually, until

pytestmark = pytest.mark.slow

PROMPT = prompt(1, 64)


def on_new_connection(port: int, path: str, body: object) -> tuple[int, Any]:
    """A fresh TCP connection per call, so the kernel may hand it to either process."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def children_of(pid: int) -> list[int]:
    """Router processes started by ``pid`` (its embedded nats-server left out)."""
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    rows = [line.split(None, 1) for line in out.stdout.splitlines() if line.strip()]
    return [int(child) for child, command in rows if "nats-server" not in command]


def listening_sockets(port: int) -> int:
    """How many sockets listen on the loopback ``port`` (from /proc/net/tcp: state 0A is LISTEN)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A")


def active_everywhere(port: int, connections: int = 12) -> set[int]:
    """The active-request totals seen over several fresh connections (one value when all agree)."""
    totals = set()
    for _ in range(connections):
        loads = on_new_connection(port, "/v1/potential_loads", {"tokens": PROMPT})[1]["loads"]
        totals.add(sum(load["active_requests"] for load in loads))
    return totals


def registered_everywhere(port: int, worker_id: int, connections: int = 12) -> bool:
    """Whether every one of several fresh connections (either process) knows the worker: a
    registration reaches the other process through the shared registry, a few ms later."""
    return all(
        any(status["config"]["worker_id"] == worker_id for status in get(port, "/v1/workers")["workers"])
        for _ in range(connections)
    )


def test_processes_share_the_port_and_one_load_view(tmp_path: Path) -> None:
    # A lease of a few seconds: short enough for the kill below, long enough that a loaded machine's
    # late heartbeat does not drop a live peer's bookings (a later mark_free would then be a 404).
    router = RouterProcess(tmp_path, "--processes", "2", "--replica-lease-secs", "5")
    router.start()
    try:
        # Both children listening, not merely started: a child still in its start-up takes no
        # connection, and killing the only listener would refuse the next ones.
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        assert on_new_connection(router.port, "/v1/workers", {"worker_id": 1, "dp_size": 2})[0] in (200, 201)
        until(lambda: registered_everywhere(router.port, 1), 30, "every process knows the worker")
        for index in range(10):
            status, _ = on_new_connection(router.port, "/v1/new", {"tokens": PROMPT, "request_id": f"r{index}"})
            assert status == 200
        until(lambda: active_everywhere(router.port) == {10}, 30, "every process sees the 10 bookings")
        for index in range(0, 10, 2):  # marks land on whichever process takes the connection
            status, _ = on_new_connection(router.port, "/v1/mark_free", {"request_id": f"r{index}"})
            assert status == 200
        until(lambda: active_everywhere(router.port) == {5}, 30, "every process sees the frees")

        victim = children_of(router.pid)[0]
        os.kill(victim, signal.SIGKILL)
        until(lambda: victim not in children_of(router.pid) and listening_sockets(router.port) == 2,
              40, "the parent starts the killed process again")  # fmt: skip
        until(lambda: len(active_everywhere(router.port)) == 1, 40, "the processes agree again")
    finally:
        router.stop()
    assert router.process is not None and router.process.returncode == 0


def test_a_free_reaching_the_other_process_before_its_booking_frees_it(tmp_path: Path) -> None:
    """Each request booked, then freed at once on another fresh connection: the free often reaches the
    process that did not book it before the booking does. It is passed on (202, ``passed_to_replicas``)
    instead of a 404, and no booking is left on either process (each one leaked for 300 s)."""
    router = RouterProcess(tmp_path, "--processes", "2", "--replica-lease-secs", "5")
    router.start()
    try:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        assert on_new_connection(router.port, "/v1/workers", {"worker_id": 1})[0] in (200, 201)
        until(lambda: registered_everywhere(router.port, 1), 30, "every process knows the worker")
        for index in range(60):
            assert on_new_connection(router.port, "/v1/new", {"tokens": PROMPT, "request_id": f"r{index}"})[0] == 200
            status, body = on_new_connection(router.port, "/v1/mark_free", {"request_id": f"r{index}"})
            assert status in (200, 202), body
            assert body == {
                "request_id": f"r{index}",
                "success": True,
                **({"passed_to_replicas": True} if status == 202 else {}),
            }
        until(lambda: active_everywhere(router.port) == {0}, 30, "no booking left on any process")
    finally:
        router.stop()


def decided_and_freed(port: int, request_id: str) -> tuple[int, Any]:
    """``POST /v1/new`` on a fresh connection, its booking freed on the same one (the same process)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/v1/new", json.dumps({"tokens": PROMPT, "request_id": request_id}),
                           {"content-type": "application/json"})  # fmt: skip
        reply = connection.getresponse()
        status, answer = reply.status, json.loads(reply.read())
        if status == 200:
            connection.request("POST", "/v1/mark_free", json.dumps({"request_id": request_id}),
                               {"content-type": "application/json"})  # fmt: skip
            connection.getresponse().read()
        return status, answer
    finally:
        connection.close()


def wrong_answers(port: int, workers: set[int], active: int, seconds: float, requests: int = 300) -> list[str]:
    """Over fresh connections for ``seconds`` (at most ``requests`` rounds): every answer that misses a
    registered worker or a booking (``GET /v1/workers``), and every decision refused (``POST /v1/new``)."""
    wrong: list[str] = []
    deadline = time.monotonic() + seconds
    for _ in range(requests):
        if time.monotonic() > deadline:
            break
        listed = get(port, "/v1/workers")["workers"]
        seen = {row["config"]["worker_id"]: sum(rank["active_requests"] for rank in row["ranks"]) for row in listed}
        # More than `active` is a probe below whose free is still on its way to the other process.
        if set(seen) != workers or sum(seen.values()) < active:
            wrong.append(f"GET /v1/workers: active requests by worker {seen}")
        status, answer = decided_and_freed(port, f"probe-{time.monotonic_ns()}")
        if status != 200:
            wrong.append(f"POST /v1/new: {status} {answer}")
    return wrong


@contextmanager
def two_processes_behind(proxy: LossyNatsProxy, tmp_path: Path) -> Iterator[RouterProcess]:
    """``--processes 2`` reaching NATS through ``proxy``, both listening; stopped after, cleanly (exit 0).
    A lease longer than the tests: the bookings of a process killed stay in the view."""
    router = RouterProcess(tmp_path, "--processes", "2", "--nats-url", proxy.url, "--replica-lease-secs", "60")
    router.argv = [sys.executable, "-m", "api.cli", *router.args]  # this tree, not an installed script
    router.start()
    try:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        # Listening is not connected: a process serves HTTP while its event plane starts. The tests cut
        # NATS off from connections made after this point only (a process still connecting then was
        # refused too: the first kill's test read its refusals as the restarted process's and killed the
        # second before the first was started again).
        until(lambda: router.log().count("event plane: NATS at") == 2, 40, "both processes on the event plane")
        yield router
    finally:
        router.stop()
    assert router.process is not None and router.process.returncode == 0


def test_a_process_started_again_takes_no_connection_before_it_has_the_fleet(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # The kernel hands a listening socket its share of new connections whatever the process knows: a
    # child started again after SIGKILL must not listen before it has read the worker registry and
    # joined its siblings' bookings, or its share is answered from an empty view. Here it cannot reach
    # NATS for a while (its connections are refused; its sibling's, made before, go on), which holds
    # that start-up open long enough to be seen rather than a few milliseconds.
    with LossyNatsProxy(nats_server.port) as proxy, two_processes_behind(proxy, tmp_path) as router:
        for worker_id in (1, 2, 3):
            assert on_new_connection(router.port, "/v1/workers", {"worker_id": worker_id})[0] in (200, 201)
        until(lambda: registered_everywhere(router.port, 3), 30, "every process knows the workers")
        for index in range(4):
            status, _ = on_new_connection(router.port, "/v1/new", {"tokens": PROMPT, "request_id": f"r{index}"})
            assert status == 200
        until(lambda: active_everywhere(router.port) == {4}, 30, "every process sees the 4 bookings")
        assert wrong_answers(router.port, {1, 2, 3}, 4, seconds=0.5) == []

        proxy.refusing = True
        victim = children_of(router.pid)[0]
        os.kill(victim, signal.SIGKILL)
        # The new process's app has started: its first attempt to reach NATS was refused.
        until(lambda: proxy.refused > 0, 40, "the parent starts the killed process again")
        assert victim not in children_of(router.pid)
        while_cut_off = wrong_answers(router.port, {1, 2, 3}, 4, seconds=2.5)
        proxy.refusing = False
        until(lambda: listening_sockets(router.port) == 2, 40, "the new process listens once it caught up")
        caught_up = wrong_answers(router.port, {1, 2, 3}, 4, seconds=1.5)
        assert (while_cut_off, caught_up) == ([], [])

        # A SIGTERM while a process started again waits for NATS stops it too (it never listened).
        proxy.refusing, refused = True, proxy.refused
        os.kill(children_of(router.pid)[0], signal.SIGKILL)
        until(lambda: proxy.refused > refused, 40, "the parent starts the killed process again")


def test_processes_all_started_again_while_nats_is_out_of_reach_keep_the_port_served(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Both processes killed one after the other while NATS is out of reach: the first, started again
    # beside its sibling, waits for its event plane; when that sibling dies too, nobody would listen
    # (the second is started again beside the first, still waiting) and every connection would be
    # refused until NATS came back. The first listens, blind, once no sibling does.
    with LossyNatsProxy(nats_server.port) as proxy, two_processes_behind(proxy, tmp_path) as router:
        proxy.refusing = True
        first, second = children_of(router.pid)
        os.kill(first, signal.SIGKILL)
        until(lambda: proxy.refused > 0, 40, "the parent starts the first process again")
        # It waits beside its serving sibling: one socket listens.
        time.sleep(1.0)
        assert listening_sockets(router.port) == 1

        os.kill(second, signal.SIGKILL)
        until(lambda: second not in children_of(router.pid) and len(children_of(router.pid)) == 2,
              40, "the parent starts the second process again")  # fmt: skip
        until(lambda: listening_sockets(router.port) >= 1, 20, "a process listens while NATS is out of reach")
        for _ in range(6):  # fresh connections: whichever process the kernel picks answers
            assert get(router.port, "/healthz")["status"] == "ok"
        assert listening_sockets(router.port) == 1  # the second waits beside the first, now serving

        proxy.refusing = False
        until(lambda: listening_sockets(router.port) == 2, 40, "the second listens once it caught up")
        log = router.log()
        assert "no other process serves the port" in log, log


class SlowToAnswerResyncs(KvEventPublisher):
    """A worker whose resync answers take ``answer_delay_s`` (a large cache to dump, a busy host)."""

    answer_delay_s = 0.0

    async def _on_resync(self, message: Msg) -> None:
        await asyncio.sleep(self.answer_delay_s)
        await super()._on_resync(message)


def blocks_seen(port: int, worker_id: int, seed: int, blocks: int, connections: int = 16) -> set[int]:
    """The worker's cached blocks of a prompt as several fresh connections (either process) score them."""
    seen = set()
    for _ in range(connections):
        workers = on_new_connection(port, "/v1/overlap", {"tokens": tokens(seed, blocks)})[1]["workers"]
        seen.add({row["worker_id"]: row["device_blocks"] for row in workers}.get(worker_id, 0))
    return seen


def cached_everywhere(port: int, worker_id: int, seed: int, blocks: int, connections: int = 16) -> bool:
    """Whether every one of several fresh connections (either process) sees the worker's blocks."""
    for _ in range(connections):
        workers = on_new_connection(port, "/v1/overlap", {"tokens": tokens(seed, blocks)})[1]["workers"]
        if {row["worker_id"]: row["device_blocks"] for row in workers}.get(worker_id) != blocks:
            return False
    return True


def test_events_posted_over_http_reach_every_process(tmp_path: Path) -> None:
    """Events posted to whichever process a connection lands on are relayed on the worker's events
    subject, where every process takes them in one order: every process scores them. Each process kept
    its own, so half the connections saw the blocks and the other half routed as if the worker held
    nothing (and applied here first, then relayed, a later event posted to the other process could
    reach it first: a gap, the stream untrusted)."""
    with RouterProcess(tmp_path, "--processes", "2") as router:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        assert on_new_connection(router.port, "/v1/workers", {"worker_id": 7})[0] in (200, 201)
        until(lambda: registered_everywhere(router.port, 7), 30, "every process knows the worker")
        for event_id, seed in enumerate((11, 12, 13), 1):
            status, reply = on_new_connection(
                router.port, "/v1/events", [stored_event(7, tokens(seed, 4), event_id=event_id)]
            )
            assert (status, reply["received"], reply["relayed"]) == (200, 1, 1)
        for seed in (11, 12, 13):
            until(lambda: cached_everywhere(router.port, 7, seed, 4), 30, f"every process has chain {seed}")  # noqa: B023
        # A removal is relayed as well: gone everywhere.
        local = compute_block_hashes(tokens(12, 4), 16)
        removed = {"worker_id": 7, "event": {"event_id": 4, "dp_rank": 0, "data": {"removed": {
            "block_hashes": compute_sequence_hashes(local)}}}}  # fmt: skip
        assert on_new_connection(router.port, "/v1/events", [removed])[1]["relayed"] == 1
        until(lambda: blocks_seen(router.port, 7, 12, 4) == {0}, 30, "the removal reaches every process")
        assert cached_everywhere(router.port, 7, 11, 4) and cached_everywhere(router.port, 7, 13, 4)


def scraped(port: int) -> str:
    """``/metrics`` on a fresh connection; one the kernel queued on a process just killed is reset
    (SO_REUSEPORT), and asked again, as Prometheus's next scrape would."""
    for _ in range(5):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request("GET", "/metrics")
            return connection.getresponse().read().decode()
        except ConnectionError:
            continue
        finally:
            connection.close()
    raise AssertionError("five scrapes in a row were reset")


def test_one_scrape_answers_for_every_process_and_says_which_is_down(tmp_path: Path) -> None:
    """Whichever process a scrape reaches, it reports every process's counters, each labelled with
    its process: a process answering alone showed the other's counters every other scrape (to
    Prometheus, a counter reset each time). A process killed outright is reported down until it is
    back, counting from zero; the group's directory goes with the parent."""
    with RouterProcess(tmp_path, "--processes", "2") as router:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        for _ in range(20):
            assert on_new_connection(router.port, "/v1/potential_loads", {"tokens": PROMPT})[0] == 200
        for _ in range(8):
            text = scraped(router.port)
            per_process = [sample(text, "kv_router_requests_total", process=index, method="potential_loads",
                                  outcome="ok") or 0.0 for index in ("0", "1")]  # fmt: skip
            assert sum(per_process) == 20
            assert [sample(text, "kv_router_process_up", process=index) for index in ("0", "1")] == [1.0, 1.0]
        started = dict(re.findall(r"router process (\d) started \(pid (\d+)\)", router.log()))
        os.kill(int(started["1"]), signal.SIGKILL)
        until(lambda: sample(scraped(router.port), "kv_router_process_up", process="1") == 0.0, 20, "process 1 down")
        text = scraped(router.port)
        assert sample(text, "kv_router_requests_total", process="1", method="potential_loads", outcome="ok") is None
        kept = sample(text, "kv_router_requests_total", process="0", method="potential_loads", outcome="ok")
        assert kept == per_process[0]
        until(lambda: sample(scraped(router.port), "kv_router_process_up", process="1") == 1.0, 40, "process 1 back")
        group = re.search(r"KV_ROUTER__PROCESS_DIR=(\S+)", Path(f"/proc/{started['0']}/environ").read_bytes()
                          .replace(b"\0", b" ").decode())  # fmt: skip
        assert group is not None and Path(group[1]).is_dir()
    assert not Path(group[1]).exists()


def dashboard_panel(expression_of: str) -> promql_parser.AggregateExpr:
    """The aggregation of the Grafana dashboard's query over ``expression_of`` (one per panel)."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kv-router.json").read_text())
    (query,) = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if f"({expression_of}{{" in target["expr"]
    ]
    parsed = promql_parser.parse(query)
    assert isinstance(parsed, promql_parser.AggregateExpr) and isinstance(parsed.expr, promql_parser.VectorSelector)
    return parsed


def evaluated(panel: promql_parser.AggregateExpr, text: str) -> dict[tuple[str, ...], float]:
    """The panel's aggregation over one scrape (Prometheus adds only target labels, which it matches)."""
    grouping = panel.modifier.labels if panel.modifier is not None else []
    groups: dict[tuple[str, ...], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == panel.expr.name:
                groups.setdefault(tuple(found.labels[label] for label in grouping), []).append(found.value)
    aggregate = {"sum": sum, "max": max, "min": min, "avg": lambda values: sum(values) / len(values)}[str(panel.op)]
    return {group: float(aggregate(values)) for group, values in groups.items()}


def test_the_dashboards_per_rank_booking_panels_count_each_booking_once(tmp_path: Path) -> None:
    """Every process of ``--processes N`` (as every replica in sync) holds every booking: a panel that
    summed the processes showed each rank N times as loaded as it was."""
    with RouterProcess(tmp_path, "--processes", "2") as router:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        assert on_new_connection(router.port, "/v1/workers", {"worker_id": 1})[0] in (200, 201)
        until(lambda: registered_everywhere(router.port, 1), 30, "every process knows the worker")
        for index in range(3):
            status, _ = on_new_connection(router.port, "/v1/new", {"tokens": PROMPT, "request_id": f"r{index}"})
            assert status == 200
        until(lambda: active_everywhere(router.port) == {3}, 30, "every process sees the 3 bookings")
        text = scraped(router.port)
        shown = {
            name: evaluated(dashboard_panel(name), text)
            for name in (
                "kv_router_worker_active_requests",
                "kv_router_worker_active_prefill_tokens",
                "kv_router_worker_active_decode_blocks",
            )
        }
    blocks = len(PROMPT) // 16  # RouterProcess serves with --block-size 16
    assert shown == {
        "kv_router_worker_active_requests": {("1", "0"): 3.0},
        "kv_router_worker_active_prefill_tokens": {("1", "0"): 3.0 * len(PROMPT)},
        "kv_router_worker_active_decode_blocks": {("1", "0"): float(blocks)},
    }


@pytest.mark.anyio
async def test_a_process_started_after_the_events_learns_them_from_the_worker(
    nats_server: EmbeddedNats, client: Client, tmp_path: Path
) -> None:
    # Core NATS keeps nothing: a process that starts after a worker published (here: started again
    # after SIGKILL) must ask the worker for what it holds, or it routes blind to that cache.
    router = RouterProcess(tmp_path, "--processes", "2", "--nats-url", nats_server.url, "--replica-lease-secs", "5")
    await asyncio.to_thread(router.start)
    publisher = SlowToAnswerResyncs(client, WorkerConfig(worker_id=5, block_size=16))
    try:
        await eventually(
            lambda: listening_sockets(router.port) == 2, 40, "two router processes listening", in_thread=True
        )
        await publisher.start()
        await eventually(
            lambda: registered_everywhere(router.port, 5), 30, "every process knows the worker", in_thread=True
        )
        last_event = await publisher.stored(pairs(3, 6))
        await eventually(
            lambda: cached_everywhere(router.port, 5, 3, 6), 30, "every process indexed the blocks", in_thread=True
        )

        victim = children_of(router.pid)[0]
        publisher.answer_delay_s = 1.5  # the new process's ask for the worker's full dump: answered late
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: victim not in children_of(router.pid) and listening_sockets(router.port) == 2,
                         40, "the parent starts the killed process again", in_thread=True)  # fmt: skip
        # Nothing was published since: the new process has the blocks from the worker's full dump, and
        # listens only once it has them (its first answers would otherwise be blind to that cache).
        assert await asyncio.to_thread(cached_everywhere, router.port, 5, 3, 6)
        assert await publisher.stored(pairs(4, 2)) == last_event + 1
        await eventually(
            lambda: cached_everywhere(router.port, 5, 4, 2), 30, "both follow the live stream", in_thread=True
        )
    finally:
        await publisher.stop()
        await asyncio.to_thread(router.stop)
    assert router.process is not None and router.process.returncode == 0


def test_the_processes_end_with_a_parent_killed_with_sigkill(tmp_path: Path) -> None:
    # Orphans would keep answering on the port (ready, their plane gone with the parent's nats-server)
    # and share it with the children of a restarted parent: the kernel would send them connections.
    router = RouterProcess(tmp_path, "--processes", "2")
    router.argv = [sys.executable, "-m", "api.cli", *router.args]  # this tree, not an installed script
    router.start()
    started: list[int] = []
    try:
        until(lambda: len(children_of(router.pid)) == 2 and listening_sockets(router.port) == 2,
              40, "two router processes listening")  # fmt: skip
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(router.pid)], capture_output=True, text=True)
        started = [int(pid) for pid in out.stdout.split()]  # the nats-server too
        router.kill9()
        until(lambda: not any(running(pid) for pid in started), 5, "the children end with the parent")
        assert listening_sockets(router.port) == 0
    finally:
        router.stop()
        for pid in started:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def child_pids(pid: int) -> list[int]:
    """``pid``'s children now, read in one step (fast enough to catch a start-up under way)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_a_sigterm_while_the_processes_start_stops_every_one(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    # SIGTERM as soon as the first of several children exists: the others are still being started.
    router = RouterProcess(tmp_path, "--processes", "6", "--nats-url", nats_server.url)
    argv = [sys.executable, "-m", "api.cli", *router.args]  # this tree, not an installed script
    with router.log_path.open("wb") as log:
        parent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    seen: set[int] = set()
    try:
        until(lambda: bool(seen.update(child_pids(parent.pid)) or seen), 60, "a process started", poll=0.0005)
        parent.send_signal(signal.SIGTERM)
        try:
            assert parent.wait(60) == 0, router.log()[-3000:]
        except subprocess.TimeoutExpired:
            seen.update(child_pids(parent.pid))
            raise AssertionError("the parent waits forever for processes never told to stop") from None
        assert not any(running(pid) for pid in seen)
    finally:
        for pid in [*seen, parent.pid]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)
