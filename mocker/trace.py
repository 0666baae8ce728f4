"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per ``trace_block_size`` tokens, 512 in Mooncake's files).

Loading applies the replay options: only the first ``limit`` lines; prompts longer than
``max_input_length`` clipped or dropped; arrivals shifted so the first is at 0, jittered uniformly within
``jitter_ms``, then divided by ``speedup``. Without ``jitter_ms`` a trace whose timestamps are quantised
(the real Mooncake traces': about 3 s apart, up to 28 requests sharing one) is jittered within its
quantum (`timestamp_quantum`): replayed as written, those requests arrive at one instant at any
``speedup``, and a replay at a quarter of the load (or at 1/64) measures a 28-request burst, not load.
Block ids are renumbered densely in order of first appearance (see
`mocker.tokens`); a prompt longer than its ids cover gets fresh blocks of its own for the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from mocker.tokens import BlockTokens

__all__ = [
    "COARSE_QUANTUM_MS",
    "Row",
    "Trace",
    "TraceError",
    "TraceOptions",
    "TraceRequest",
    "build_trace",
    "load_trace",
    "read_rows",
    "timestamp_quantum",
]

LengthPolicy = Literal["clip", "drop"]
# Timestamps never closer than this, some shared by several requests, are quantised: the quantum is
# the information lost, not arrivals at one instant. (The synthetic and generated traces have 1 ms
# resolution and keep their arrivals as written.)
COARSE_QUANTUM_MS = 100.0


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and line."""


# Past any context a model serves (and a request's prompt and block ids are built in memory: 10^11
# tokens took all of it); and past three centuries of milliseconds, where a pass's time no longer
# moves the clock (the simulation stalls: "made no progress").
MAX_REQUEST_TOKENS = 10_000_000
MAX_TIMESTAMP_MS = 1e13


class _Line(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=-MAX_TIMESTAMP_MS, le=MAX_TIMESTAMP_MS)]
    input_length: Annotated[int, msgspec.Meta(le=MAX_REQUEST_TOKENS)]
    output_length: Annotated[int, msgspec.Meta(le=MAX_REQUEST_TOKENS)]
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class TraceOptions:
    speedup: float = 1.0
    limit: int | None = None
    max_input_length: int | None = None
    length_policy: LengthPolicy = "clip"
    jitter_ms: float | None = None  # None: the trace's quantum when its timestamps are quantised, else 0
    seed: int = 0
    trace_block_size: int = 512

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.max_input_length is not None and self.max_input_length < 1:
            raise ValueError(f"max input length must be >= 1, got {self.max_input_length}")
        if self.jitter_ms is not None and not (self.jitter_ms >= 0 and math.isfinite(self.jitter_ms)):
            raise ValueError(f"jitter must be a finite number of ms >= 0, got {self.jitter_ms}")
        if self.trace_block_size < 1:
            raise ValueError(f"trace block size must be >= 1, got {self.trace_block_size}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay; ``blocks`` are dense trace block ids (see `mocker.tokens`)."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


@dataclass(slots=True)
class Trace:
    path: str
    options: TraceOptions
    requests: list[TraceRequest]
    clipped: int = 0
    dropped: int = 0
    jitter_ms: float = 0.0  # the jitter applied: the options', or the trace's quantum
    tokens: BlockTokens = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = BlockTokens(self.options.trace_block_size)

    def prompt(self, request: TraceRequest) -> bytes:
        """The request's prompt as packed little-endian u32 token ids."""
        return self.tokens.prompt(request.blocks, request.input_length)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def time_scaled(self, factor: float) -> Trace:
        """The same requests arriving ``factor`` times sooner (to run a replay faster than real time)."""
        requests = [dataclasses.replace(r, arrival_ms=r.arrival_ms / factor) for r in self.requests]
        return Trace(
            self.path, self.options, requests, clipped=self.clipped, dropped=self.dropped, jitter_ms=self.jitter_ms
        )

    @property
    def span_ms(self) -> float:
        return self.requests[-1].arrival_ms - self.requests[0].arrival_ms if self.requests else 0.0


_decode_line = msgspec.json.Decoder(_Line).decode

# A trace line: (timestamp ms, input length, output length, hash ids).
Row = tuple[float, int, int, list[int]]


def read_rows(path: str | Path, limit: int | None = None) -> Iterator[Row]:
    """The lines of a Mooncake JSONL file, checked, as rows."""
    count = 0
    with open(path, "rb") as source:
        for number, raw in enumerate(source, 1):
            if not raw.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                line = _decode_line(raw)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{number}: not a Mooncake trace line: {exc}") from None
            if line.input_length < 1 or line.output_length < 0:
                raise TraceError(f"{path}:{number}: lengths must be input >= 1 and output >= 0")
            count += 1
            yield line.timestamp, line.input_length, line.output_length, line.hash_ids


def load_trace(path: str | Path, options: TraceOptions | None = None) -> Trace:
    options = options or TraceOptions()
    return build_trace(read_rows(path, options.limit), options, str(path))


def build_trace(rows: Iterable[Row], options: TraceOptions, path: str) -> Trace:
    """Apply the replay options to trace rows (see the module doc)."""
    block = options.trace_block_size
    dense: dict[int, int] = {}
    lines: list[Row] = []
    clipped = dropped = 0
    for timestamp, input_length, output_length, hash_ids in rows:
        length = input_length
        if options.max_input_length is not None and length > options.max_input_length:
            if options.length_policy == "drop":
                dropped += 1
                continue
            length = options.max_input_length
            clipped += 1
        needed = -(-length // block)
        ids = [dense.setdefault(h, len(dense)) for h in hash_ids[:needed]]
        lines.append((timestamp, length, output_length, ids))
    # Blocks the ids do not cover belong to their request alone: number them after every shared one.
    fresh = len(dense)
    for _, length, _, ids in lines:
        while len(ids) * block < length:
            ids.append(fresh)
            fresh += 1
    rng = random.Random(options.seed)
    timestamps = [timestamp for timestamp, *_ in lines]
    start = min(timestamps, default=0.0)
    jitter = options.jitter_ms if options.jitter_ms is not None else timestamp_quantum(timestamps)
    speedup = options.speedup
    arrivals = [(stamp - start + (rng.uniform(0.0, jitter) if jitter else 0.0)) / speedup for stamp in timestamps]
    order = sorted(range(len(lines)), key=lambda i: (arrivals[i], i))
    requests = [TraceRequest(i, arrivals[i], lines[i][1], lines[i][2], tuple(lines[i][3])) for i in order]
    return Trace(path, options, requests, clipped=clipped, dropped=dropped, jitter_ms=jitter)


def timestamp_quantum(timestamps: list[float]) -> float:
    """The quantum of quantised timestamps: the least gap between two distinct ones, when it is at least
    `COARSE_QUANTUM_MS` and some timestamp is shared by several requests; else 0 (arrivals as written).
    Read from the lines replayed: a ``--limit`` within the first timestamp's requests (fewer than 28 of
    a Mooncake trace) shows no quantum, and they stay at one instant (give ``--jitter-ms``). O(n log n)."""
    distinct = sorted(set(timestamps))
    if len(distinct) < 2 or len(distinct) == len(timestamps):
        return 0.0
    least_gap = min(later - earlier for earlier, later in itertools.pairwise(distinct))
    return least_gap if least_gap >= COARSE_QUANTUM_MS else 0.0
