"""An engine's ZMQ KV-event publisher, as vLLM runs it: PUB socket, seq numbers, replay ROUTER.

`VllmZmqPublisher` sends ``[topic, seq (u64 BE), payload]`` per batch from seq 0 and keeps the last
``buffer_steps`` batches for its replay ROUTER socket, which answers ``[b"", start_seq]`` with one
reply per buffered batch from that seq and the ``-1`` end marker, in vLLM's layout before 0.26
(``[seq, payload]``) or after (``[topic, seq, payload]``). `vllm_batch` encodes a mock engine's
`KvOp`s as the current vLLM does (map-form events with ``token_ids``).

Used by ``kv-router mock-worker --zmq-endpoint`` and by the tests as the fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from mocker.block_pool import KvOp, Removed, Stored

__all__ = ["END_MARKER", "EndpointBindError", "VllmZmqPublisher", "vllm_batch"]

END_MARKER = (-1).to_bytes(8, "big", signed=True)
# An engine restarted on the same ports in this process: ZMQ's I/O thread releases the old sockets'
# ports a moment after `close`, so a bind meanwhile finds them in use. Bounded, and only for an endpoint
# a publisher of this process has closed: any other in use is taken, and waiting would only delay saying so.
_REBIND_WAIT_S = 5.0
_REBIND_POLL_S = 0.02
_closed_endpoints: set[str] = set()

_encode = msgspec.msgpack.Encoder().encode


def vllm_batch(ops: list[KvOp], tokens_of: Callable[[int], bytes], block_size: int, dp_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` of map-form events; ``tokens_of(block_hash)`` gives a block's packed u32 tokens."""
    events: list[dict[str, object]] = []
    for op in ops:
        if isinstance(op, Stored):
            token_ids: list[int] = []
            for block_hash, _ in op.blocks:
                token_ids.extend(memoryview(tokens_of(block_hash)).cast("I"))
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hash for block_hash, _ in op.blocks],
                    "parent_block_hash": op.parent_hash,
                    "token_ids": token_ids,
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        elif isinstance(op, Removed):
            events.append({"type": "BlockRemoved", "block_hashes": op.block_hashes, "medium": "GPU"})
        else:
            events.append({"type": "AllBlocksCleared"})
    return _encode([time.time(), events, dp_rank])


class EndpointBindError(Exception):
    """`VllmZmqPublisher.start` cannot bind ``endpoint`` (the replay socket's when ``replay``): ``in_use``
    when another socket holds its port, ``reason`` ZMQ's words."""

    def __init__(self, endpoint: str, *, replay: bool, error: zmq.ZMQError) -> None:
        self.endpoint = endpoint
        self.replay = replay
        self.in_use = error.errno == zmq.EADDRINUSE
        # The reason alone: pyzmq appends the address to the message of a failed bind.
        self.reason = error.strerror.removesuffix(f" (addr={endpoint!r})")
        super().__init__(f"cannot bind {endpoint}: {self.reason}")


class VllmZmqPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        topic_in_replay: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.topic_in_replay = topic_in_replay
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay_socket: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._bound: list[str] = []  # the endpoints its sockets hold

    async def start(self) -> None:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        self._pub = pub
        try:
            await _bind(pub, self.endpoint, replay=False)
            self._bound.append(self.endpoint)
            if self.replay_endpoint is not None:
                replay_socket = self._context.socket(zmq.ROUTER)
                replay_socket.setsockopt(zmq.LINGER, 0)
                self._replay_socket = replay_socket
                await _bind(replay_socket, self.replay_endpoint, replay=True)
                self._bound.append(self.replay_endpoint)
                self._replay_task = asyncio.create_task(
                    self._serve_replay(replay_socket), name=f"replay-{self.replay_endpoint}"
                )
        except BaseException:
            await self.stop()  # no socket left open behind a failed start
            raise

    async def stop(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for socket in (self._pub, self._replay_socket):
            if socket is not None:
                socket.close()
        _closed_endpoints.update(self._bound)
        self._bound.clear()
        self._pub = self._replay_socket = None

    async def send(self, payload: bytes, *, seq: int | None = None, publish: bool = True) -> int:
        """Publish one batch (buffered for replay); ``publish=False`` only buffers it, as if the PUB
        socket had dropped it, and ``seq`` forces a number (a restarted engine counts from 0 again)."""
        if seq is not None:
            self.next_seq = seq
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if publish:
            assert self._pub is not None, "start() the publisher first"
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_corrupted(self, seq: int, payload: bytes) -> None:
        """Publish one message under ``seq`` that the engine never meant (corrupted on the wire): not
        buffered for replay, the numbering unmoved."""
        assert self._pub is not None, "start() the publisher first"
        await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def send_malformed(self) -> None:
        """Publish one message that is no batch (a lone frame): a subscriber counts and drops it, which
        tells a test that its subscription has reached this socket."""
        assert self._pub is not None, "start() the publisher first"
        await self._pub.send_multipart([b"not a batch"])

    def lose(self, seq: int) -> None:
        """Drop one buffered batch: a hole the buffer keeps for good (TensorRT-LLM's publisher takes a
        batch's seq, then drops the batch on a full queue)."""
        self._buffer = deque((kept for kept in self._buffer if kept[0] != seq), maxlen=self._buffer.maxlen)

    def corrupt_buffered(self, seq: int, payload: bytes) -> None:
        """Replay ``payload`` under ``seq`` from now on (a replay socket that answers garbage)."""
        self._buffer = deque(
            ((kept, payload if kept == seq else held) for kept, held in self._buffer), maxlen=self._buffer.maxlen
        )

    def forget_before(self, seq: int) -> None:
        """Drop buffered batches older than ``seq`` (a replay buffer that has wrapped)."""
        while self._buffer and self._buffer[0][0] < seq:
            self._buffer.popleft()

    async def _serve_replay(self, replay_socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay_socket.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM rejects any other frame count
            client, empty, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            head = [client, empty, self.topic] if self.topic_in_replay else [client, empty]
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay_socket.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            await replay_socket.send_multipart([*head, END_MARKER, b""])


async def _bind(socket: zmq.asyncio.Socket, endpoint: str, *, replay: bool) -> None:
    """Bind ``socket`` to ``endpoint``, or raise `EndpointBindError`."""
    deadline = asyncio.get_running_loop().time() + _REBIND_WAIT_S
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            released_soon = exc.errno == zmq.EADDRINUSE and endpoint in _closed_endpoints
            if not released_soon or asyncio.get_running_loop().time() > deadline:
                raise EndpointBindError(endpoint, replay=replay, error=exc) from None
        await asyncio.sleep(_REBIND_POLL_S)
