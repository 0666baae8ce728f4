"""``/metrics`` under ``kv-router serve --processes N``: one scrape answers for every process.

The kernel hands each connection to one of the N processes sharing the port, so a scrape answered
by that process alone shows another process's counters each time: to Prometheus a counter reset at
every other scrape, and rates that mean nothing. Each process therefore also serves its own exposition
on a Unix socket in a directory private to the parent (mode 0700, removed when the parent stops);
the process a scrape reaches asks every sibling at once (each within `SIBLING_TIMEOUT_S`), labels
each sample with ``process="i"`` and merges the families. ``kv_router_process_up{process}`` says which
answered: a process being started again is 0 and its series are absent until it is back, its counters
then starting from 0 (a reset, as a restart is).

Costs: a scrape reads N expositions and rewrites their sample lines (string operations, no parse);
the sockets are idle between scrapes. Guardrail: a sibling that does not answer in time is reported
down, never waited for longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROCESS_LABEL", "ProcessGroup", "merge_expositions"]

log = logging.getLogger(__name__)

PROCESS_LABEL = "process"
SIBLING_TIMEOUT_S = 2.0
UP_METRIC = "kv_router_process_up"
_GROUP_DIR_ENV = "KV_ROUTER__PROCESS_DIR"
_INDEX_ENV = "KV_ROUTER__CHILD_INDEX"
_COUNT_ENV = "KV_ROUTER__PROCESS_COUNT"


@dataclass(frozen=True)
class ProcessGroup:
    """One process of ``--processes N``: its index, the group's size and where the group's sockets live."""

    directory: Path
    index: int
    count: int

    def environment(self) -> dict[str, str]:
        """What a child is started with to find its group (`from_environment`)."""
        return {_GROUP_DIR_ENV: str(self.directory), _INDEX_ENV: str(self.index), _COUNT_ENV: str(self.count)}

    @classmethod
    def from_environment(cls) -> ProcessGroup | None:
        directory = os.environ.get(_GROUP_DIR_ENV)
        if not directory:
            return None
        return cls(Path(directory), int(os.environ[_INDEX_ENV]), int(os.environ[_COUNT_ENV]))

    def socket_path(self, index: int) -> Path:
        return self.directory / f"metrics-{index}.sock"

    @contextlib.asynccontextmanager
    async def serving(self, exposition: Callable[[], bytes]) -> AsyncIterator[None]:
        """This process's exposition on its socket, for its siblings' scrapes, while the context lasts."""

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.write(exposition())
                await writer.drain()
            except OSError:
                pass  # the asking sibling gave up (its timeout); it reports this process down
            finally:
                writer.close()

        path = self.socket_path(self.index)
        try:
            path.unlink(missing_ok=True)  # left by this index's previous process, killed outright
            server = await asyncio.start_unix_server(answer, path=str(path))
        except OSError as exc:  # a path too long for a socket (a deep TMPDIR), the directory gone
            log.warning("process %d: its metrics are not shared with its siblings' scrapes: %s", self.index, exc)
            yield
            return
        try:
            yield
        finally:
            server.close()
            path.unlink(missing_ok=True)

    async def exposition(self, own: bytes) -> bytes:
        """Every process's exposition, ``own`` this one's, merged and labelled by process."""
        siblings = [index for index in range(self.count) if index != self.index]
        answers = await asyncio.gather(*(_read_exposition(self.socket_path(index)) for index in siblings))
        parts = {self.index: own}
        parts.update((index, text) for index, text in zip(siblings, answers, strict=True) if text is not None)
        return merge_expositions(parts, self.count)


async def _read_exposition(path: Path) -> bytes | None:
    try:
        async with asyncio.timeout(SIBLING_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(str(path))
            try:
                return await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None  # not started yet, being started again, or stuck: reported down


def merge_expositions(parts: Mapping[int, bytes], count: int) -> bytes:
    """Prometheus text expositions of processes ``parts`` (by index) as one: each sample labelled with
    its process, each family's samples together under one HELP and TYPE (the format requires it), in
    the order families first appear; then ``kv_router_process_up`` for each of the ``count`` processes."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index in sorted(parts):
        label = f'{PROCESS_LABEL}="{index}"'
        family: list[str] | None = None
        for line in parts[index].decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                family = samples.setdefault(name, [])
                known = headers.setdefault(name, [])
                if len(known) < 2 and line not in known:
                    known.append(line)
            elif line and not line.startswith("#") and family is not None:
                family.append(_labelled(line, label))
    lines = [line for name in headers for line in (*headers[name], *samples[name])]
    lines.append(f"# HELP {UP_METRIC} Whether the router process answered this scrape (--processes N).")
    lines.append(f"# TYPE {UP_METRIC} gauge")
    lines.extend(f'{UP_METRIC}{{{PROCESS_LABEL}="{index}"}} {1.0 if index in parts else 0.0}' for index in range(count))
    return ("\n".join(lines) + "\n").encode()


def _labelled(sample: str, label: str) -> str:
    """``name{a="b"} 1.0`` as ``name{process="i",a="b"} 1.0``; ``name 1.0`` as ``name{process="i"} 1.0``.
    A metric name holds neither a brace nor a space, so the first of them ends it."""
    space = sample.find(" ")
    brace = sample.find("{", 0, space)
    if brace != -1:
        return f"{sample[: brace + 1]}{label},{sample[brace + 1 :]}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"
