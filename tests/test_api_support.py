"""Helpers shared by the ``test_api_*`` suites (this module holds no tests).

Apps are real `create_app` instances driven through Starlette's TestClient (the real ASGI stack,
lifespan included; with ``fast_protocol``, through kv-router's HTTP protocol, `tests/protocol_asgi.py`);
events are real Dynamo-shaped ``RouterEvent`` JSON built from real block hashes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import ServiceConfig, Settings
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from tests.metrics import sample
from tests.protocol_asgi import ThroughProtocol

BLOCK_SIZE = 16
# One label of an exposition line: name="value" (values may hold commas and escaped quotes).
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


@contextmanager
def serve(fast_protocol: bool = True, seed: int = 0, **overrides: Any) -> Iterator[TestClient]:
    """A client of a fresh app; ``overrides`` go to `ServiceConfig` or `RouterConfig` by name. The HTTP
    contract is checked against Dynamo's decisions, so the app routes with `dynamo` unless told otherwise."""
    service = {k: v for k, v in overrides.items() if k in ServiceConfig.__struct_fields__}
    router = {k: v for k, v in overrides.items() if k not in service}
    settings = Settings(
        service=ServiceConfig(fast_protocol=fast_protocol, **service),
        router=RouterConfig(**{"block_size": BLOCK_SIZE, "policy": "dynamo", **router}),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(seed))
    # fast_protocol: through kv-router's HTTP protocol, as `kv-router serve` answers; else FastAPI's routes.
    with TestClient(ThroughProtocol(app) if fast_protocol else app, base_url="http://127.0.0.1") as client:
        yield client


def prompt(seed: int, n_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 32) for _ in range(n_tokens)]


def stored_event(
    worker_id: int, tokens: Sequence[int], *, event_id: int = 1, dp_rank: int = 0, blocks: int | None = None
) -> dict[str, Any]:
    """A ``stored`` RouterEvent for the full blocks of ``tokens`` (the first ``blocks`` of them),
    chained from the root, with the engine block hash equal to Dynamo's sequence hash."""
    local = compute_block_hashes(tokens, BLOCK_SIZE)[:blocks]
    chain = compute_sequence_hashes(local)
    return {
        "worker_id": worker_id,
        "event": {
            "event_id": event_id,
            "dp_rank": dp_rank,
            "data": {
                "stored": {
                    "parent_hash": None,
                    "blocks": [{"block_hash": s, "tokens_hash": t} for s, t in zip(chain, local, strict=True)],
                }
            },
        },
    }


def metric(client: TestClient, name: str, **labels: str) -> float | None:
    """One sample of the app's ``/metrics`` (None when the series is not exported)."""
    return sample(client.get("/metrics").text, name, **labels)


def state(client: TestClient) -> tuple[Any, Any, Any]:
    """Everything a request could change: workers with live loads, the index, queue and loads."""
    workers = client.get("/v1/workers").json()
    for worker in workers["workers"]:
        for stream in worker["event_streams"]:
            stream.pop("last_event_age_s")  # moves with the clock, not with requests
    dump = client.get("/v1/dump").json()
    loads = client.post("/v1/potential_loads", json={"tokens": list(range(64))}).json()
    return workers, dump, loads


def msgpack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)
