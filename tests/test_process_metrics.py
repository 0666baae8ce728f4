"""``/metrics`` under ``--processes N`` merges every process's exposition (`api.process_metrics`):
checked against prometheus_client's own parser on random registries, and on a process's socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.process_metrics import ProcessGroup, merge_expositions

NAMES = ("kv_router_a", "kv_router_b", "kv_router_c")
LABEL_VALUES = st.sampled_from(("x", "y z", 'quote"d', "brace{}", "new\nline"))


@st.composite
def registries(draw: st.DrawFn) -> bytes:
    """One process's exposition: a random subset of counters, gauges and histograms, some labelled."""
    registry = CollectorRegistry()
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True)):
        kind = draw(st.sampled_from((Counter, Gauge, Histogram)))
        labelled = draw(st.booleans())
        metric = kind(name, f"help of {name}", ["worker"] if labelled else [], registry=registry)
        for value in draw(st.lists(st.floats(0, 1e6), max_size=3)):
            series = metric.labels(draw(LABEL_VALUES)) if labelled else metric
            if isinstance(series, Counter):
                series.inc(value)
            elif isinstance(series, Gauge):
                series.set(value)
            else:
                series.observe(value)
    return generate_latest(registry)


def parsed(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (found.name, tuple(sorted(found.labels.items()))): found.value
        for family in text_string_to_metric_families(text.decode())
        for found in family.samples
    }


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 3), registries(), max_size=4))
def test_every_process_sample_is_in_the_merge_labelled_with_its_process(parts: dict[int, bytes]) -> None:
    merged = merge_expositions(parts, 4)
    expected = {
        (name, tuple(sorted((*labels, ("process", str(index)))))): value
        for index, text in parts.items()
        for (name, labels), value in parsed(text).items()
    }
    expected.update(
        (("kv_router_process_up", (("process", str(index)),)), 1.0 if index in parts else 0.0) for index in range(4)
    )
    assert parsed(merged) == expected
    # One HELP and one TYPE per family, its samples together (the parser above would split them otherwise).
    families = [line.split(" ")[2] for line in merged.decode().splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families))


def test_samples_are_labelled_in_place() -> None:
    first = b'# HELP m_total calls\n# TYPE m_total counter\nm_total{method="new"} 3.0\n'
    second = b"# HELP m_total calls\n# TYPE m_total counter\nm_total 1.0\n# HELP g level\n# TYPE g gauge\ng 2.0\n"
    assert merge_expositions({0: first, 2: second}, 3).decode().splitlines() == [
        "# HELP m_total calls",
        "# TYPE m_total counter",
        'm_total{process="0",method="new"} 3.0',
        'm_total{process="2"} 1.0',
        "# HELP g level",
        "# TYPE g gauge",
        'g{process="2"} 2.0',
        "# HELP kv_router_process_up Whether the router process answered this scrape (--processes N).",
        "# TYPE kv_router_process_up gauge",
        'kv_router_process_up{process="0"} 1.0',
        'kv_router_process_up{process="1"} 0.0',
        'kv_router_process_up{process="2"} 1.0',
    ]


@pytest.mark.anyio
async def test_a_scrape_gathers_the_siblings_and_reports_the_silent_ones_down(tmp_path: Path) -> None:
    """Process 1 answers on its socket; process 2 left a socket nobody listens on (killed outright):
    reported down at once, its series absent. Process 1's socket goes with its context."""
    first = ProcessGroup(tmp_path, 0, 3)
    second = ProcessGroup(tmp_path, 1, 3)
    second_exposition = b"# HELP g level\n# TYPE g gauge\ng 5.0\n"
    first.socket_path(2).touch()
    async with second.serving(lambda: second_exposition):
        merged = await asyncio.wait_for(first.exposition(b"# HELP g level\n# TYPE g gauge\ng 4.0\n"), 5)
    assert parsed(merged) == {
        ("g", (("process", "0"),)): 4.0,
        ("g", (("process", "1"),)): 5.0,
        ("kv_router_process_up", (("process", "0"),)): 1.0,
        ("kv_router_process_up", (("process", "1"),)): 1.0,
        ("kv_router_process_up", (("process", "2"),)): 0.0,
    }
    assert not second.socket_path(1).exists()
    assert parsed(await first.exposition(b""))[("kv_router_process_up", (("process", "1"),))] == 0.0


@pytest.mark.anyio
async def test_a_sibling_that_accepts_and_never_answers_is_reported_down_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.process_metrics.SIBLING_TIMEOUT_S", 0.2)
    group = ProcessGroup(tmp_path, 0, 2)
    held: list[asyncio.StreamWriter] = []

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_unix_server(never, path=str(group.socket_path(1)))
    try:
        merged = await asyncio.wait_for(group.exposition(b"# HELP g level\n# TYPE g gauge\ng 1.0\n"), 5)
    finally:
        for writer in held:
            writer.close()
        server.close()
    assert parsed(merged)[("kv_router_process_up", (("process", "1"),))] == 0.0
    assert parsed(merged)[("g", (("process", "0"),))] == 1.0


@pytest.mark.anyio
async def test_a_socket_that_cannot_be_made_leaves_the_process_serving_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A socket path past the kernel's limit (a deep TMPDIR) or a directory gone: the process still
    starts (it stopped at start, and its parent started it again for ever), its siblings report it down."""
    deep = ProcessGroup(tmp_path / ("d" * 120), 1, 2)
    async with deep.serving(lambda: b""):
        pass
    assert "process 1: its metrics are not shared with its siblings' scrapes" in caplog.text
