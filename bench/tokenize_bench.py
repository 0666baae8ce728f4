"""What the proxy's local tokenization costs per prompt, in the same run: ``tokenizers``' ``encode``
(one text) and ``encode_batch`` (a batch), which the proxy called before, against
``encode_batch_fast``, which it calls now (`api.proxy.tokens.Encoder`: the same ids, no offsets).

    python bench/tokenize_bench.py [--tokenizer tokenizer.json] [--chars 1000] [--batch 4] [--repeat 300]

Without ``--tokenizer`` the real-engine lane model's byte-level BPE (`tests/real_engines/make_model.py`,
trained in a second) and the mock engine's one-token-a-character tokenizer (what `bench/gateway_bench.py`
runs) are measured. Prompts are lines of this repository's docs. CPU time per call (every thread: a
batch is spread over the cores) and its ratio to the old call.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer

from mocker.openai_api import write_model_files
from tests.real_engines.make_model import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def corpus() -> list[str]:
    return [line for path in sorted((ROOT / "docs").glob("*.md")) for line in path.read_text().splitlines() if line]


def mock_tokenizer() -> Tokenizer:
    directory = Path(tempfile.mkdtemp(prefix="kv-router-tokenize-bench-"))
    return Tokenizer.from_file(str(write_model_files(directory) / "tokenizer.json"))


def prompt(rng: random.Random, lines: list[str], chars: int) -> str:
    text = ""
    while len(text) < chars:
        text += rng.choice(lines) + "\n"
    return text[:chars]


def cpu_us(call: Callable[[], object], repeat: int) -> float:
    call()
    started = time.process_time()
    for _ in range(repeat):
        call()
    return (time.process_time() - started) / repeat * 1e6


def measure(name: str, tokenizer: Tokenizer, texts: list[str], repeat: int) -> None:
    one = texts[0]
    assert tokenizer.encode(one).ids == tokenizer.encode_batch_fast([one])[0].ids
    assert [e.ids for e in tokenizer.encode_batch(texts)] == [e.ids for e in tokenizer.encode_batch_fast(texts)]
    tokens = len(tokenizer.encode(one, add_special_tokens=False).ids)
    old_one = cpu_us(lambda: tokenizer.encode(one, add_special_tokens=False).ids, repeat)
    new_one = cpu_us(lambda: tokenizer.encode_batch_fast([one], add_special_tokens=False)[0].ids, repeat)
    batch_repeat = max(1, repeat // len(texts))
    old_batch = cpu_us(lambda: [e.ids for e in tokenizer.encode_batch(texts)], batch_repeat)
    new_batch = cpu_us(lambda: [e.ids for e in tokenizer.encode_batch_fast(texts)], batch_repeat)
    print(f"{name}: one prompt of {len(one)} characters ({tokens} tokens), a batch of {len(texts)}")
    for label, old, new in (("one", old_one, new_one), ("batch", old_batch, new_batch)):
        before = "encode" if label == "one" else "encode_batch"
        print(f"  {label}: {before} {old:.0f} us, encode_batch_fast {new:.0f} us: ratio {new / old:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json [the lane model's and the mock's]")
    parser.add_argument("--chars", type=int, default=1000, help="characters per prompt [%(default)s]")
    parser.add_argument("--batch", type=int, default=4, help="prompts per batch [%(default)s]")
    parser.add_argument("--repeat", type=int, default=300, help="calls per measurement [%(default)s]")
    args = parser.parse_args()
    lines = corpus()
    rng = random.Random(0)
    texts = [prompt(rng, lines, args.chars) for _ in range(args.batch)]
    if args.tokenizer is not None:
        measure(str(args.tokenizer), Tokenizer.from_file(str(args.tokenizer)), texts, args.repeat)
        return
    measure("the lane model's byte-level BPE", train_tokenizer(), texts, args.repeat)
    measure("the mock engine's tokenizer (one token a character)", mock_tokenizer(), texts, args.repeat)


if __name__ == "__main__":
    main()
