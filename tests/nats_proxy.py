"""A NATS-protocol TCP proxy on loopback that loses messages on purpose (for fault tests).

Clients connect to ``url``; everything is relayed to the real server, except that every
``drop_every``-th message the server delivers on ``drop_subject`` whose payload contains ``marker``
is silently left out, as a network or a slow consumer would lose it (``drop_every=0``: nothing is).
(Counting only marked messages keeps the loss from locking onto one sender when the traffic is
periodic.) While ``refusing`` is set, a new client connection is closed at once: NATS unreachable
for a process that starts now, while the connections already made go on. Runs its own event loop in
a thread, so blocking tests can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

from router.event_plane.embedded_server import free_port


class LossyNatsProxy:
    def __init__(self, upstream_port: int, drop_subject: str = "", drop_every: int = 0, marker: bytes = b"") -> None:
        self.upstream_port = upstream_port
        self.drop_subject = drop_subject.encode()
        self.drop_every = drop_every
        self.marker = marker
        self.port = free_port()
        self.seen = 0
        self.dropped = 0
        self.refusing = False
        self.refused = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # every connection open, closed when it stops

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def __enter__(self) -> LossyNatsProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", self.port)

    def _accepted(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # Called as the connection is made (not as a task's first step): a connection whose relay is
        # cancelled before it starts is still known, and closed when the proxy stops.
        self._writers.add(client_writer)
        self._loop.create_task(self._serve(client_reader, client_writer))

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks(self._loop) if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Every connection closed before the loop is (one left open is a ResourceWarning in a later
        # test), and a turn of the loop for the sockets to close with their transports.
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        writers = [client_writer]
        try:
            if self.refusing:
                self.refused += 1
                return
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            writers.append(server_writer)
            self._writers.add(server_writer)
            upstream = asyncio.create_task(_pipe(client_reader, server_writer))
            try:
                await self._deliver(server_reader, client_writer)
            finally:
                upstream.cancel()
        finally:
            for writer in writers:
                self._writers.discard(writer)
                with contextlib.suppress(Exception):
                    writer.close()

    async def _deliver(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Server -> client, frame by frame: ``MSG subject sid [reply] size`` and ``HMSG subject sid
        [reply] header-size total-size`` carry a payload; every other line is a control line."""
        while line := await reader.readline():
            frame = line
            keyword = line.split(b" ", 1)[0]
            if keyword in (b"MSG", b"HMSG"):
                parts = line.split()
                frame += await reader.readexactly(int(parts[-1]) + 2)
                if self.drop_every and parts[1] == self.drop_subject and self.marker in frame:
                    self.seen += 1
                    if self.seen % self.drop_every == 0:
                        self.dropped += 1
                        continue
            writer.write(frame)
            await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()
