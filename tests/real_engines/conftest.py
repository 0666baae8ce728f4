"""The real-engine lane's fixtures: two real vLLM engines for the whole session (started together,
stopped by their PIDs), a real nats-server, and the selection rule: these tests run only when asked for
(``-m real_engines``, as ``.ci/run``'s lane stage does), so the ordinary ``python -m pytest -q`` runs
never start engines, and are skipped there with the way to run them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.event_plane.embedded_server import EmbeddedNats
from tests.real_engines.engines import SHARED, EngineMirror, VllmEngine, lane_model, vllm_python

LANE = (
    "the real-engine lane: .ci/vllm_lane.sh installs vLLM, then `python -m pytest -m real_engines tests/real_engines`"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr") or ""
    chosen = "real_engines" in expression and "not real_engines" not in expression
    python = vllm_python()
    for item in items:
        if item.get_closest_marker("real_engines") is None:
            continue
        if not chosen:
            item.add_marker(pytest.mark.skip(reason=f"runs in its own stage, {LANE}"))
        elif python is None:
            item.add_marker(pytest.mark.skip(reason=f"the vLLM venv is absent; {LANE}"))
        elif not python.exists():  # named by KV_ROUTER_VLLM_PYTHON (as .ci/run does): a broken lane fails
            raise pytest.UsageError(f"KV_ROUTER_VLLM_PYTHON={python}: no such interpreter")


@pytest.fixture(scope="session")
def lane_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model, the engines' and routers' logs: ``KV_ROUTER_LANE_DIR`` to keep them (CI artifacts)."""
    kept = os.environ.get("KV_ROUTER_LANE_DIR")
    if kept:
        path = Path(kept)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("real-engines")


@pytest.fixture(scope="session")
def engines(lane_dir: Path) -> Iterator[list[VllmEngine]]:
    """Two vLLM engines serving the tiny model, started in parallel (bounded waits)."""
    python = vllm_python()
    assert python is not None
    began = time.monotonic()
    model = lane_model(lane_dir)
    made = time.monotonic() - began
    fleet = [VllmEngine(python, model, lane_dir, worker_id) for worker_id in (1, 2)]
    SHARED[:] = fleet
    try:
        for engine in fleet:
            engine.start()
        for engine in fleet:
            engine.wait_ready()
        print(
            f"\nreal engines: model made in {made:.1f} s; engines ready in "
            + ", ".join(f"{engine.ready_after:.0f} s" for engine in fleet)
            + f" (both: {time.monotonic() - began - made:.0f} s)"
        )
        yield fleet
    finally:
        for engine in fleet:
            engine.stop()
        SHARED.clear()


@pytest.fixture(scope="session")
def lane_nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="session")
def mirrors(engines: list[VllmEngine]) -> Iterator[list[EngineMirror]]:
    """A raw subscriber of each engine's events: what its cache holds, independently of kv-router."""
    watching = [EngineMirror(engine) for engine in engines]
    try:
        yield watching
    finally:
        for mirror in watching:
            mirror.close()


@pytest.fixture(autouse=True)
def engines_alive(request: pytest.FixtureRequest) -> None:
    """Before each test that uses the engines, any engine a failed test left dead is started again, so
    one failure is reported once and not again by every test after it."""
    if "engines" not in request.fixturenames:
        return
    fleet: list[VllmEngine] = request.getfixturevalue("engines")
    for engine in fleet:
        if not engine.alive():
            engine.start().wait_ready()
