"""What a replay measured, per router: the numbers users choose a policy by.

From the per-request records of one run (offline or online) `summarize` computes:

- engine-side cache hit rate, from the engines' own accounting at admission: block-weighted (cached
  blocks / prompt blocks) and token-weighted (cached tokens / prompt tokens);
- router-predicted hit rate: the cached tokens the router expected on the worker it chose;
- TTFT, inter-token latency (a request's mean gap between its output tokens, ``(finished - first
  token) / (output tokens - 1)``, for requests of two tokens or more) and end-to-end latency
  (p50 / p90 / p99 / mean), throughput;
- prefill-work imbalance: max / mean over workers of the uncached prompt tokens they had to compute,
  over the whole run and per ``window_s`` window (work-weighted mean and worst window);
- requests queued (in the router's queue, or left waiting by an engine pass) and rejected;

plus the same latencies per worker (`WorkerReport`) and per-window series (hit rate, per-worker
prefill work) for plots. `render_table` and
`render_markdown` format several routers side by side; `write_reports` writes report.json and
report.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from mocker.trace import TraceRequest

__all__ = [
    "Latency",
    "ReplayRecord",
    "RouterReport",
    "WorkerReport",
    "blank_records",
    "render_markdown",
    "render_table",
    "render_worker_table",
    "renumber_workers",
    "rescale_times",
    "summarize",
    "write_reports",
]


@dataclass(slots=True)
class ReplayRecord:
    """One request's fate in a replay; times in ms from the start of the trace, -1 if it never happened."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    worker_id: int = -1
    # When the online replay sent it to the router (its lateness, sent_ms - arrival_ms, is the
    # replayer's and is inside its TTFT); -1 offline, where requests leave at their arrival.
    sent_ms: float = -1.0
    routed_ms: float = -1.0
    queued_in_router: bool = False
    predicted_cached_tokens: int = 0
    cached_tokens: int = 0
    cached_blocks: int = 0
    prompt_blocks: int = 0
    queued_in_engine: bool = False
    first_token_ms: float = -1.0
    finished_ms: float = -1.0
    preemptions: int = 0
    # Disaggregated fleets: the prefill leg's worker (-1: none, prefilled where it decoded) and how long
    # its KV took to reach the decode worker.
    prefill_worker_id: int = -1
    transfer_ms: float = 0.0
    # "completed", "rejected_by_router", "rejected_by_engine" or "unfinished".
    status: str = "unfinished"

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.finished_ms - self.arrival_ms

    @property
    def itl_ms(self) -> float | None:
        """The mean gap between output tokens; None with fewer than two tokens."""
        if self.output_length < 2:
            return None
        return (self.finished_ms - self.first_token_ms) / (self.output_length - 1)


@dataclass(slots=True)
class Latency:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ordered = sorted(values)
        return cls(_rank(ordered, 50), _rank(ordered, 90), _rank(ordered, 99), sum(ordered) / len(ordered))


def _rank(ordered: Sequence[float], percent: float) -> float:
    """Nearest-rank percentile (the convention of Dynamo's replay reports)."""
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]


@dataclass(slots=True)
class WorkerReport:
    """One worker's share of a run: its completed requests and the latencies they saw."""

    worker: int
    requests: int
    hit_rate_tokens: float
    ttft_ms: Latency
    itl_ms: Latency
    e2e_ms: Latency


@dataclass(slots=True)
class RouterReport:
    router: str
    requests: int
    completed: int
    hit_rate_blocks: float
    hit_rate_tokens: float
    predicted_hit_rate: float
    ttft_ms: Latency
    itl_ms: Latency
    e2e_ms: Latency
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    imbalance: float
    imbalance_window_mean: float
    imbalance_window_worst: float
    queued_in_router: int
    queued_in_engine: int
    rejected_by_router: int
    rejected_by_engine: int
    unfinished: int
    preemptions: int
    duration_s: float
    wall_s: float
    window_s: float
    # Per window: start (s), engine hit rate (tokens) of the requests that arrived in it, and each
    # worker's uncached prefill tokens.
    windows: list[dict[str, Any]] = field(default_factory=list)
    requests_per_worker: list[int] = field(default_factory=list)
    per_worker: list[WorkerReport] = field(default_factory=list)
    ttft_sorted_ms: list[float] = field(default_factory=list, repr=False)


def blank_records(requests: Iterable[TraceRequest]) -> list[ReplayRecord]:
    """One record per request, at the position of its index (its line in the trace, not its arrival
    order, which jitter may change)."""
    ordered = sorted(requests, key=lambda r: r.index)
    return [ReplayRecord(r.index, r.arrival_ms, r.input_length, r.output_length) for r in ordered]


def renumber_workers(records: Sequence[ReplayRecord]) -> int:
    """Number the workers 0..n-1 in order of first use (online worker ids are arbitrary); returns n."""
    numbering: dict[int, int] = {}
    for record in records:
        if record.worker_id >= 0:
            record.worker_id = numbering.setdefault(record.worker_id, len(numbering))
    return len(numbering)


def rescale_times(records: Sequence[ReplayRecord], factor: float) -> None:
    """Multiply every time by ``factor``: a replay run ``factor`` times faster, brought back to scale."""
    for r in records:
        r.arrival_ms *= factor
        if r.sent_ms >= 0:
            r.sent_ms *= factor
        if r.routed_ms >= 0:
            r.routed_ms *= factor
        if r.first_token_ms >= 0:
            r.first_token_ms *= factor
        if r.finished_ms >= 0:
            r.finished_ms *= factor


def send_lateness(records: Sequence[ReplayRecord]) -> Latency:
    """How late the online replay sent its requests after their arrivals (ms; NaN offline)."""
    return Latency.of([r.sent_ms - r.arrival_ms for r in records if r.sent_ms >= 0])


def summarize(
    router: str, records: Sequence[ReplayRecord], workers: int, *, wall_s: float, window_s: float = 60.0
) -> RouterReport:
    done = [r for r in records if r.status == "completed"]
    prompt_tokens = sum(r.input_length for r in done) or 1
    prompt_blocks = sum(r.prompt_blocks for r in done) or 1
    start = min((r.arrival_ms for r in records), default=0.0)
    end = max((r.finished_ms for r in done), default=start)
    duration_s = max(end - start, 1e-9) / 1000.0
    ttfts = sorted(r.ttft_ms for r in done)
    work = [0] * workers
    per_worker = [0] * workers
    windows: dict[int, dict[str, Any]] = {}
    for r in done:
        uncached = r.input_length - r.cached_tokens
        work[r.worker_id] += uncached
        per_worker[r.worker_id] += 1
        slot = int((r.routed_ms - start) // (window_s * 1000.0))
        window = windows.get(slot)
        if window is None:
            window = windows[slot] = {"work": [0] * workers, "cached": 0, "tokens": 0}
        window["work"][r.worker_id] += uncached
        window["cached"] += r.cached_tokens
        window["tokens"] += r.input_length
    series = [
        {
            "start_s": slot * window_s,
            "hit_rate": w["cached"] / w["tokens"] if w["tokens"] else 0.0,
            "prefill_tokens": w["work"],
        }
        for slot, w in sorted(windows.items())
    ]
    weighted = total_work = 0.0
    worst = 0.0
    for w in windows.values():
        ratio = _max_over_mean(w["work"])
        amount = sum(w["work"])
        weighted += ratio * amount
        total_work += amount
        worst = max(worst, ratio)
    return RouterReport(
        router=router,
        requests=len(records),
        completed=len(done),
        hit_rate_blocks=sum(r.cached_blocks for r in done) / prompt_blocks,
        hit_rate_tokens=sum(r.cached_tokens for r in done) / prompt_tokens,
        predicted_hit_rate=sum(r.predicted_cached_tokens for r in done) / prompt_tokens,
        ttft_ms=Latency.of(ttfts),
        itl_ms=Latency.of(_itls(done)),
        e2e_ms=Latency.of([r.e2e_ms for r in done]),
        requests_per_s=len(done) / duration_s,
        input_tokens_per_s=sum(r.input_length for r in done) / duration_s,
        output_tokens_per_s=sum(r.output_length for r in done) / duration_s,
        imbalance=_max_over_mean(work),
        imbalance_window_mean=weighted / total_work if total_work else 1.0,
        imbalance_window_worst=worst or 1.0,
        queued_in_router=sum(r.queued_in_router for r in records),
        queued_in_engine=sum(r.queued_in_engine for r in records),
        rejected_by_router=sum(r.status == "rejected_by_router" for r in records),
        rejected_by_engine=sum(r.status == "rejected_by_engine" for r in records),
        unfinished=sum(r.status == "unfinished" for r in records),
        preemptions=sum(r.preemptions for r in records),
        duration_s=duration_s,
        wall_s=wall_s,
        window_s=window_s,
        windows=series,
        requests_per_worker=per_worker,
        per_worker=_per_worker(done, workers),
        ttft_sorted_ms=ttfts,
    )


def _itls(records: Iterable[ReplayRecord]) -> list[float]:
    return [itl for r in records if (itl := r.itl_ms) is not None]


def _per_worker(done: Sequence[ReplayRecord], workers: int) -> list[WorkerReport]:
    served: list[list[ReplayRecord]] = [[] for _ in range(workers)]
    for r in done:
        served[r.worker_id].append(r)
    return [
        WorkerReport(
            worker=worker,
            requests=len(records),
            hit_rate_tokens=sum(r.cached_tokens for r in records) / (sum(r.input_length for r in records) or 1),
            ttft_ms=Latency.of([r.ttft_ms for r in records]),
            itl_ms=Latency.of(_itls(records)),
            e2e_ms=Latency.of([r.e2e_ms for r in records]),
        )
        for worker, records in enumerate(served)
    ]


def _max_over_mean(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


# ---------------------------------------------------------------------- rendering
_COLUMNS = (
    ("router", "router"),
    ("hit blk", "engine hit rate, block-weighted"),
    ("hit tok", "engine hit rate, token-weighted"),
    ("pred", "router-predicted hit rate"),
    ("TTFT p50/p90/p99 ms", "time to first token"),
    ("ITL p50/p90 ms", "inter-token latency, per request mean"),
    ("E2E p50/p90/p99 ms", "end-to-end latency"),
    ("req/s", "completed requests per second"),
    ("imbal", "prefill-work max/mean over workers, whole run"),
    ("imbal 60s", "same per window: work-weighted mean / worst"),
    ("queued r/e", "requests queued in the router / in an engine"),
    ("rej", "requests rejected"),
    ("unfin", "requests unfinished: their worker sent nothing in time, or left"),
)


def _row(report: RouterReport) -> list[str]:
    t, i, e = report.ttft_ms, report.itl_ms, report.e2e_ms
    return [
        report.router,
        f"{report.hit_rate_blocks:.3f}",
        f"{report.hit_rate_tokens:.3f}",
        f"{report.predicted_hit_rate:.3f}",
        f"{t.p50:.0f}/{t.p90:.0f}/{t.p99:.0f}",
        f"{i.p50:.1f}/{i.p90:.1f}",
        f"{e.p50:.0f}/{e.p90:.0f}/{e.p99:.0f}",
        f"{report.requests_per_s:.2f}",
        f"{report.imbalance:.2f}",
        f"{report.imbalance_window_mean:.2f}/{report.imbalance_window_worst:.2f}",
        f"{report.queued_in_router}/{report.queued_in_engine}",
        f"{report.rejected_by_router + report.rejected_by_engine}",
        f"{report.unfinished}",
    ]


def render_table(reports: Sequence[RouterReport]) -> str:
    """A plain-text table for the terminal, one router per row."""
    rows = [[name for name, _ in _COLUMNS], *(_row(r) for r in reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render_worker_table(reports: Sequence[RouterReport]) -> str:
    """Per router, one line per worker: its requests, hit rate and latencies."""
    rows = [["router", "worker", "requests", "hit tok", "TTFT p50/p90 ms", "ITL p50/p90 ms", "E2E p50/p90 ms"]]
    rows += [_worker_row(r.router, w) for r in reports for w in r.per_worker]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _worker_row(router: str, w: WorkerReport) -> list[str]:
    return [
        router,
        str(w.worker),
        str(w.requests),
        f"{w.hit_rate_tokens:.3f}",
        f"{w.ttft_ms.p50:.0f}/{w.ttft_ms.p90:.0f}",
        f"{w.itl_ms.p50:.1f}/{w.itl_ms.p90:.1f}",
        f"{w.e2e_ms.p50:.0f}/{w.e2e_ms.p90:.0f}",
    ]


def render_markdown(reports: Sequence[RouterReport], settings: dict[str, Any]) -> str:
    lines = ["# Replay report", ""]
    lines += [f"- {key}: `{value}`" for key, value in settings.items()]
    lines += ["", "| " + " | ".join(name for name, _ in _COLUMNS) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(_COLUMNS))) + "|")
    lines += ["| " + " | ".join(_row(r)) + " |" for r in reports]
    lines += ["", "Columns: " + "; ".join(f"**{name}**: {meaning}" for name, meaning in _COLUMNS[1:]) + "."]
    lines += ["", "| router | completed | unfinished | preemptions | throughput in / out tok/s | wall s |"]
    lines.append("|---|---:|---:|---:|---:|---:|")
    for r in reports:
        lines.append(
            f"| {r.router} | {r.completed}/{r.requests} | {r.unfinished} | {r.preemptions} | "
            f"{r.input_tokens_per_s:.0f} / {r.output_tokens_per_s:.0f} | {r.wall_s:.1f} |"
        )
    lines += ["", "## Per worker", ""]
    lines += ["| router | worker | requests | hit tok | TTFT p50/p90 ms | ITL p50/p90 ms | E2E p50/p90 ms |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    lines += ["| " + " | ".join(_worker_row(r.router, w)) + " |" for r in reports for w in r.per_worker]
    return "\n".join(lines) + "\n"


def write_reports(reports: Sequence[RouterReport], settings: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.json (everything but per-request data) and report.md into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {"settings": settings, "results": [_jsonable(r) for r in reports]}
    json_path = out_dir / "report.json"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(body), indent=1) + b"\n")
    md_path = out_dir / "report.md"
    md_path.write_text(render_markdown(reports, settings))
    return [json_path, md_path]


def _jsonable(report: RouterReport) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(report)
    del data["ttft_sorted_ms"]
    return data
