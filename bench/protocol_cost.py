"""What one hot decision costs inside the service, counted rather than timed.

On a shared machine in-process CPU times move by 1.5x between runs of the same tree; instruction and
call counts do not. This feeds ``kv-router serve``'s HTTP protocol (`api.http_protocol`) a ``/v1/new``
and its ``/v1/mark_free`` as raw bytes through an in-memory transport (no sockets, no kernel), on
`bench/http_bench.py`'s workload, and reports per pair:

* ``--measure calls``: Python function calls and C / built-in calls (cProfile), by package;
* ``--measure instructions``: user-space instructions (callgrind, which must be installed): the
  script runs itself under valgrind with two run lengths and divides the difference, so start-up
  cancels out.

With ``--baseline DIR`` (an export of another tree, e.g. main, its C modules built in place) the same
is measured there and the ratio printed.

    python bench/protocol_cost.py --measure instructions --baseline /tmp/main --form json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import gc
import os
import pstats
import random
import re
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MemoryTransport(asyncio.Transport):
    """Keeps what the protocol writes; never closes by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def post(path: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        path, content_type, len(body), body
    )  # fmt: skip


def run_pairs(args: argparse.Namespace) -> None:
    """In the tree at ``args.tree``: build the service, index the workload, answer ``args.pairs``
    decisions and their frees (the first ``args.warmup`` unmeasured), and print the counts."""
    sys.path.insert(0, args.tree)
    import msgspec
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from api.app import create_app
    from api.config import Settings
    from api.http_protocol import fast_protocol
    from bench.http_bench import build_workload, worker_events
    from router.types import WorkerConfig

    workload = build_workload(
        argparse.Namespace(
            prompt_tokens=[args.prompt_tokens], seed=0, workers=8, documents=32, total_blocks=args.total_blocks, pool=64
        )
    )
    app = create_app(Settings(), rng=random.Random(0))  # the same ties, so the same bookings, in every run
    for worker in workload.workers:
        app.kv_router.register_worker(WorkerConfig(worker_id=worker))
    protocol_type = fast_protocol(app.hot)
    config = Config(app, http=protocol_type, lifespan="off", access_log=False, server_header=False, date_header=False)
    config.load()
    loop = asyncio.new_event_loop()
    protocol = protocol_type(config, ServerState(), {}, loop)
    transport = MemoryTransport()
    protocol.connection_made(transport)
    for worker in workload.workers:
        protocol.data_received(post(b"/v1/events", msgspec.json.encode(worker_events(workload, worker))))
    msgpack = msgspec.msgpack.Encoder()
    prompts = workload.prompts[args.prompt_tokens]
    requests = []
    for n in range(args.warmup + args.pairs):
        prompt, request_id = prompts[n % len(prompts)], b"r%d" % n
        if args.form == "json":
            new = post(b"/v1/new", b'{"request_id":"%s","tokens":%s}' % (request_id, prompt.json_tokens))
        else:
            body = msgpack.encode({"request_id": request_id.decode(), "tokens": prompt.packed})
            new = post(b"/v1/new", body, b"application/msgpack")
        requests.append((new, post(b"/v1/mark_free", b'{"request_id":"%s"}' % request_id)))
    for new, free in requests[: args.warmup]:
        protocol.data_received(new)
        protocol.data_received(free)
    transport.written.clear()
    # As the service does after start-up (api/server.py): a full collection then walks only what was
    # made since, so how many of them fall into a run moves the count per pair little.
    gc.collect()
    gc.freeze()
    profile = cProfile.Profile() if args.measure == "calls" else None
    if profile is not None:
        profile.enable()
    for new, free in requests[args.warmup :]:
        protocol.data_received(new)
        protocol.data_received(free)
    if profile is not None:
        profile.disable()
    refused = [reply for reply in transport.written if not reply.startswith(b"HTTP/1.1 200 ")]
    if refused or len(transport.written) != 2 * args.pairs:
        raise RuntimeError(f"not every request was answered 200: {refused[:2]!r}")
    if profile is not None:
        layers: collections.Counter[str] = collections.Counter()
        stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        for (filename, _, _), (_, calls, *_) in stats.items():
            path = os.path.relpath(filename, args.tree) if filename != "~" else "~"
            if path == "~":
                layer = "C functions and built-ins"
            elif path.split(os.sep)[0] in ("api", "router", "indexer"):
                layer = path if path.startswith("api") else path.split(os.sep)[0] + "/"
            else:
                layer = "other Python"
            layers[layer] += calls / args.pairs
        for layer, calls in layers.most_common():
            print(f"calls {calls:.2f} {layer}")


def instructions(tree: str, args: argparse.Namespace) -> float:
    """Instructions per pair in ``tree``: two runs under callgrind, the difference per pair."""
    counts = []
    for pairs in (args.pairs, 2 * args.pairs):
        command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
                   "--run", "--tree", tree, "--pairs", str(pairs), "--measure", "instructions",
                   "--form", args.form, "--prompt-tokens", str(args.prompt_tokens),
                   "--total-blocks", str(args.total_blocks)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, cwd=tree, check=True)
        match = re.search(r"Collected : (\d+)", done.stderr)
        if match is None:
            raise RuntimeError(f"no callgrind total in: {done.stderr[-500:]}")
        counts.append(int(match.group(1)))
    return (counts[1] - counts[0]) / args.pairs


def calls(tree: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--run", "--tree", tree, "--pairs", str(args.pairs), "--measure", "calls",
               "--form", args.form, "--prompt-tokens", str(args.prompt_tokens),
               "--total-blocks", str(args.total_blocks)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree, check=True)
    layers = {}
    for line in done.stdout.splitlines():
        if line.startswith("calls "):
            _, count, layer = line.split(" ", 2)
            layers[layer] = float(count)
    return layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--measure", choices=("calls", "instructions"), default="calls")
    parser.add_argument("--form", choices=("json", "msgpack"), default="json")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--total-blocks", type=int, default=8000, help="cached blocks of the workload")
    parser.add_argument(
        "--pairs", type=int, default=1000, help="decisions measured (instructions: this and twice this)"
    )
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--baseline", default=None, help="another tree (an export of main) measured the same way")
    parser.add_argument("--tree", default=HERE, help=argparse.SUPPRESS)
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_pairs(args)
        return 0
    trees = [("this tree", HERE)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    cell = f"{args.prompt_tokens} tokens, {args.form}, {args.total_blocks} cached blocks"
    if args.measure == "instructions":
        counted = {name: instructions(tree, args) for name, tree in trees}
        for name, count in counted.items():
            print(f"{name}: {count:,.0f} instructions per decision and its free ({cell})")
        if args.baseline:
            print(f"ratio this tree / baseline: {counted['this tree'] / counted['baseline']:.3f}")
        return 0
    for name, tree in trees:
        layers = calls(tree, args)
        print(f"{name}: {sum(layers.values()):.1f} calls per decision and its free ({cell})")
        for layer, count in layers.items():
            print(f"  {count:7.2f} {layer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
