"""A NATS URL naming several servers, comma-separated as a NATS cluster's clients write it
(``nats://a:4222,nats://b:4222``): the service and the mock worker connect through whichever answers
(here one real server, the other address dead); each URL in it is checked like a single one."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.event_plane.connection import NatsOptions, check_nats_url, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import RouterProcess, ToolProcess
from tests.waiting import until


def cluster_url(live: EmbeddedNats) -> str:
    return f"nats://127.0.0.1:{free_port()}, {live.url}"  # nothing listens on the first


@pytest.mark.anyio
async def test_a_client_connects_through_the_server_that_answers(nats_server: EmbeddedNats) -> None:
    nc = await connect(NatsOptions(cluster_url(nats_server)))
    try:
        assert nc.is_connected and nc.connected_url is not None
        assert nc.connected_url.port == nats_server.port
        assert len(nc.servers) >= 2  # the dead one stays in the pool, for reconnections
    finally:
        await nc.close()


def test_the_service_and_a_mock_worker_meet_over_a_cluster_url(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    url = cluster_url(nats_server)
    with (
        RouterProcess(tmp_path, "--nats-url", url) as router,  # ready once its event plane has started
        ToolProcess(tmp_path, None, "--nats-url", url, "--worker-id", "7", "--block-size", "16"),
    ):
        until(lambda: [w["config"]["worker_id"] for w in router.get("/v1/workers")["workers"]] == [7], 30,
              "the worker registered with the router")  # fmt: skip


def test_each_url_of_a_cluster_url_is_checked() -> None:
    check_nats_url("nats://a:4222,nats://b:4222")
    check_nats_url("a:4222, tls://b:4222")
    with pytest.raises(ValueError, match="'http://b:8000' is not a NATS URL"):
        check_nats_url("nats://a:4222,http://b:8000")
    with pytest.raises(ValueError, match="names no host"):
        check_nats_url(" , ")
