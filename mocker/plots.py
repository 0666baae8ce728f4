"""PNG plots of a replay report, drawn with matplotlib when it is installed (it is optional).

- ``ttft_cdf.png``: the TTFT distribution of every router, one curve each;
- ``hit_rate.png``: the engine-side hit rate per window, one line per router;
- ``worker_load.png``: per router, each worker's uncached prefill tokens per window;
- ``capacity.png`` (``kv-router replay --capacity``): SLO attainment against the arrival-rate multiplier,
  one line per router, its capacity marked.

Each plot names the workload it shows (``caption``). Routers whose curves are identical share one
line labelled ``a = b``: drawn one over the other, the last would hide the others.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mocker.report import RouterReport

__all__ = [
    "MATPLOTLIB_MISSING",
    "coinciding",
    "workload_caption",
    "write_capacity_plot",
    "write_pareto_plot",
    "write_plots",
]

MATPLOTLIB_MISSING = "matplotlib is not installed: no PNG plots (pip install 'kv-router[replay]' to get them)"


def _pyplot() -> Any | None:
    try:
        # Imported by name: matplotlib is an optional extra, and the rest of the package type-checks
        # without it.
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return None


def workload_caption(settings: Mapping[str, Any]) -> str:
    """What a replay ran, for the plots' titles: the trace's file name (or the generated workload and
    its seed), its requests and the workers."""
    trace = str(settings.get("trace", ""))
    generated = trace.startswith("workload:")
    name = f"{trace.removeprefix('workload:')} workload, seed {settings.get('seed')}" if generated else Path(trace).name
    return f"{name}: {settings.get('requests')} requests, {settings.get('workers')} workers"


def coinciding(series: Sequence[tuple[str, Sequence[float]]]) -> list[tuple[str, Sequence[float]]]:
    """``(label, values)`` with identical values merged into one, labelled ``a = b``, in first-seen order."""
    merged: dict[tuple[float, ...], list[str]] = {}
    for label, values in series:
        merged.setdefault(tuple(values), []).append(label)
    return [(" = ".join(labels), list(values)) for values, labels in merged.items()]


def write_plots(reports: Sequence[RouterReport], out_dir: Path, caption: str = "") -> list[Path] | None:
    """Write the three plots into ``out_dir``; None (nothing written) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _ttft_cdf(plt, reports, out_dir, caption),
        _hit_rate(plt, reports, out_dir, caption),
        _worker_load(plt, reports, out_dir, caption),
    ]
    plt.close("all")
    return paths


def _titled(title: str, caption: str) -> str:
    return f"{title}\n{caption}" if caption else title


def _ttft_cdf(plt: Any, reports: Sequence[RouterReport], out_dir: Path, caption: str) -> Path:
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, values in coinciding([(report.router, report.ttft_sorted_ms) for report in reports]):
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.plot(values, fractions, label=label)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(_titled("TTFT distribution", caption))
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    path = out_dir / "ttft_cdf.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _hit_rate(plt: Any, reports: Sequence[RouterReport], out_dir: Path, caption: str) -> Path:
    figure, axes = plt.subplots(figsize=(8, 5))
    starts = {report.router: [w["start_s"] / 60 for w in report.windows] for report in reports}
    rates = [(report.router, [w["hit_rate"] for w in report.windows]) for report in reports]
    for label, values in coinciding(rates):
        axes.plot(starts[label.split(" = ")[0]], values, label=label)
    axes.set_xlabel("time (min)")
    axes.set_ylabel("engine hit rate (tokens)")
    title = f"Cache hit rate per {reports[0].window_s:.0f} s window" if reports else "Cache hit rate"
    axes.set_title(_titled(title, caption))
    axes.grid(True, alpha=0.3)
    axes.legend()
    path = out_dir / "hit_rate.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _worker_load(plt: Any, reports: Sequence[RouterReport], out_dir: Path, caption: str) -> Path:
    columns = min(3, len(reports)) or 1
    rows = math.ceil(len(reports) / columns) or 1
    figure, grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for index, report in enumerate(reports):
        axes = grid[index // columns][index % columns]
        starts = [w["start_s"] / 60 for w in report.windows]
        workers = len(report.requests_per_worker)
        for worker in range(workers):
            axes.plot(starts, [w["prefill_tokens"][worker] / 1000 for w in report.windows], linewidth=0.8)
        axes.set_title(f"{report.router}: imbalance {report.imbalance:.2f}")
        axes.set_xlabel("time (min)")
        axes.set_ylabel("prefill k tokens / window")
        axes.grid(True, alpha=0.3)
    for index in range(len(reports), rows * columns):
        grid[index // columns][index % columns].axis("off")
    figure.suptitle(_titled("Uncached prefill work per worker", caption))
    figure.tight_layout()
    path = out_dir / "worker_load.png"
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return path


def write_pareto_plot(
    points: Sequence[tuple[float, float, float]],
    front: Sequence[tuple[float, float, float]],
    chosen: tuple[float, float, float],
    reference: tuple[float, float, float],
    out_dir: Path,
) -> Path | None:
    """``pareto.png``: every tuned setting as (TTFT p90, E2E p90) coloured by hit rate, the Pareto front
    ringed (it is a front in three dimensions, so its points are not joined), the written config
    starred, the reference router crossed. None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8, 5))
    drawn = axes.scatter([p[0] for p in points], [p[1] for p in points], c=[p[2] for p in points], cmap="viridis")
    figure.colorbar(drawn, label="engine hit rate (tokens)")
    axes.scatter(
        [p[0] for p in front],
        [p[1] for p in front],
        s=160,
        facecolors="none",
        edgecolors="tab:red",
        label="Pareto front",
    )
    axes.scatter([chosen[0]], [chosen[1]], marker="*", s=250, color="tab:red", label="written config")
    axes.scatter([reference[0]], [reference[1]], marker="x", s=80, color="black", label="dynamo")
    axes.set_xlabel("TTFT p90 (ms)")
    axes.set_ylabel("E2E p90 (ms)")
    axes.set_title("latency policy settings on this trace")
    axes.grid(True, alpha=0.3)
    axes.legend()
    path = out_dir / "pareto.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close("all")
    return path


# One router's capacity search: its name, its capacity, and per multiplier run (multiplier, fraction of
# the requests meeting the SLO, whether the fleet's p90s met it).
CapacityCurve = tuple[str, float, Sequence[tuple[float, float, bool]]]


def write_capacity_plot(curves: Sequence[CapacityCurve], out_dir: Path) -> Path | None:
    """``capacity.png``: per router, the fraction of requests meeting the SLO at every multiplier run (log
    scale), the points meeting the fleet's p90 SLO filled, the capacity a dotted line. None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8, 5))
    for router, capacity, points in curves:
        (line,) = axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        line.set_label(f"{router} (capacity {capacity:.3g}x)")
        met = [p for p in points if p[2]]
        axes.scatter([p[0] for p in met], [p[1] for p in met], color=line.get_color(), s=30)
        if capacity > 0:
            axes.axvline(capacity, color=line.get_color(), linestyle=":", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel("arrival-rate multiplier (log scale)")
    axes.set_ylabel("fraction of requests meeting the SLO")
    axes.set_title("SLO attainment against load (filled: the fleet's p90s meet the SLO)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    path = out_dir / "capacity.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close("all")
    return path
