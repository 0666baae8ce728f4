"""The KV hand-off of a mock worker's OpenAI API (`mocker.openai_api`), as the engines' P/D
connectors do it over HTTP, in both styles the proxy runs (`api.proxy.handoff`):

- vLLM's ``kv_transfer_params``: a request with ``{"do_remote_decode": true}`` is a prefill leg,
  answered (one token, not streamed) with the params a decode worker needs, `remote_params`: this
  worker's engine id, host and port, and one block id per prompt block. A request with
  ``{"do_remote_prefill": true}`` is a decode leg: the KV of those blocks is pulled from there.
- SGLang's bootstrap: a prefill-role worker given ``bootstrap_room`` prefills the prompt and marks the
  room done in its `Rooms` (or failed, when its request ends early); a decode worker given
  ``bootstrap_host / port / room`` waits at that bootstrap server (``GET /bootstrap/{room}`` on the
  prefill worker's HTTP API, long-polled: `await_room`) until the room is prefilled, then pulls.

A pull costs `KvTransfer.ms` of the blocks this worker lacks (its own cached prefix is not sent), at
the worker's speedup; the prompt then enters the engine with its KV loaded (only its last token is
computed), so the decode worker's KV events are those of a real decode instance.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import httpx

from mocker.simulation import KvTransfer

__all__ = ["BootstrapFailed", "Rooms", "await_room", "remote_params"]

# Rooms remembered by a prefill worker (a decode leg that never came leaves its room behind).
_ROOMS_KEPT = 4096
# How long one long-poll of a room waits on the prefill worker, and a decode leg in all.
ROOM_POLL_SECS = 2.0
_ROOM_WAIT_SECS = 60.0


class BootstrapFailed(Exception):
    """The room failed (its prefill ended early) or did not come in time."""


class _Room:
    __slots__ = ("blocks", "event")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.blocks: int | None = None  # None once set: failed


class Rooms:
    """A prefill worker's bootstrap rooms: each a prompt prefilled (its block count) or failed."""

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, _Room] = OrderedDict()

    def _room(self, room: int) -> _Room:
        found = self._rooms.get(room)
        if found is None:
            found = self._rooms[room] = _Room()
            while len(self._rooms) > _ROOMS_KEPT:
                self._rooms.popitem(last=False)
        return found

    def __len__(self) -> int:
        return len(self._rooms)

    def done(self, room: int, blocks: int | None) -> None:
        """The room's prefill ended: ``blocks`` prefilled, or None (failed)."""
        found = self._room(room)
        found.blocks = blocks
        found.event.set()

    async def wait(self, room: int, timeout: float) -> tuple[bool, int | None]:
        """Whether the room's prefill has ended within ``timeout``, and its blocks (None: failed)."""
        found = self._room(room)
        try:
            await asyncio.wait_for(found.event.wait(), timeout)
        except TimeoutError:
            return False, None
        return True, found.blocks


def remote_params(worker_id: int, host: str, port: int, blocks: int) -> dict[str, Any]:
    """What a vLLM prefill instance answers a ``do_remote_decode`` request with (NixlConnector's
    fields), for its decode worker to pull ``blocks`` blocks."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": str(worker_id),
        "remote_block_ids": list(range(blocks)),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


async def await_room(host: str, port: int, room: int) -> int:
    """Wait at the bootstrap server ``host:port`` until ``room`` is prefilled; its blocks. A server
    that cannot be reached yet is asked again (the prefill leg may be slower to start), as SGLang's
    decode waits for its bootstrap. Raises `BootstrapFailed`."""
    deadline = time.monotonic() + _ROOM_WAIT_SECS
    url = f"http://{host}:{port}/bootstrap/{room}"
    async with httpx.AsyncClient(timeout=ROOM_POLL_SECS + 5.0) as client:
        while time.monotonic() < deadline:
            try:
                answer = await client.get(url)
            except httpx.HTTPError:
                await asyncio.sleep(0.05)
                continue
            if answer.status_code == 200:
                blocks: int = answer.json()["blocks"]
                return blocks
            if answer.status_code == 410:
                raise BootstrapFailed(f"bootstrap room {room}: its prefill failed")
    raise BootstrapFailed(f"bootstrap room {room}: not prefilled within {_ROOM_WAIT_SECS:g} s")


def transfer_secs(transfer: KvTransfer, missing_blocks: int, block_size: int, speedup: float) -> float:
    return transfer.ms(missing_blocks, block_size) / speedup / 1000.0
