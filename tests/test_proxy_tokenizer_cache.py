"""The tokenizer cache (`api.proxy.segments`): a text's ids from its pieces' cached ids are exactly
``Tokenizer.encode``'s, for the tokenizers of the chat vectors and of the real-engine lane, warm or cold,
with or without special tokens; a tokenizer whose configuration makes the split unsafe is encoded whole
(and the cut there would indeed be wrong)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

from api.config import ProxyConfig
from api.proxy.metrics import ProxyMetrics
from api.proxy.segments import ENTRY_TOKENS, SegmentCache, SegmentPlan
from api.proxy.tokens import Encoder, load_model_files
from indexer.hashing import unpack_tokens
from tests.chat_vectors.models import HERE, MODELS, assemble
from tests.real_engines.make_model import train_tokenizer


def base() -> Tokenizer:
    return Tokenizer.from_file(str(HERE / "base_tokenizer.json"))


def chat_vector_tokenizers(root: Path) -> dict[str, Tokenizer]:
    return {model: Tokenizer.from_file(str(assemble(model, root / model) / "tokenizer.json")) for model in MODELS}


def with_normalized_tokens() -> Tokenizer:
    """No normalizer: tokens matched on the normalized text are matched on the same text, after the others
    (one overlapping a raw token's text: the raw one wins where both could)."""
    tokenizer = base()
    tokenizer.add_tokens([AddedToken("<sep>", normalized=True), AddedToken("im_end|>xy", normalized=True)])
    return tokenizer


def with_piece_normalizer() -> Tokenizer:
    """A normalizer sees each piece between the added tokens on its own: safe."""
    tokenizer = base()
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Prepend("x"), normalizers.Lowercase()])
    tokenizer.post_processor = processors.BertProcessing(("</s>", 2), ("<s>", 1))
    return tokenizer


def bpe_lane() -> Tokenizer:
    """tests/real_engines/make_model.py's tokenizer, trained here."""
    return train_tokenizer()


SAFE = {"with-normalized-tokens": with_normalized_tokens, "piece-normalizer": with_piece_normalizer}

FRAGMENTS = [
    "<|", "|>", "<", ">", "im_", "end", "eot_id", "[INST", "]", "/", "<s", "s>", " ", "  ", "\n", "\n\n", "\t",
    "é", "▁", "日本", "🙂", "user", "system", "xy", "<sep", "ep>", "Hello", " world", "0123",
]  # fmt: skip


def texts(specials: list[str]) -> st.SearchStrategy[str]:
    piece = st.one_of(st.sampled_from(specials + FRAGMENTS), st.text(max_size=6))
    return st.lists(piece, max_size=24).map("".join)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    found = chat_vector_tokenizers(tmp_path_factory.mktemp("models"))
    found.update({name: make() for name, make in SAFE.items()})
    found["bpe-lane"] = bpe_lane()
    return found


def specials_of(tokenizer: Tokenizer) -> list[str]:
    return [token.content for token in tokenizer.get_added_tokens_decoder().values()]


@pytest.mark.parametrize("name", [*MODELS, *SAFE, "bpe-lane"])
def test_cached_ids_equal_plain_encode(
    name: str, tokenizers: dict[str, Tokenizer], loop: asyncio.AbstractEventLoop
) -> None:
    tokenizer = tokenizers[name]
    assert isinstance(SegmentPlan.of(tokenizer), SegmentPlan)
    # Small enough that pieces are dropped as examples come: cold, warm and evicted pieces all checked.
    encoder = Encoder(tokenizer, cache_tokens=400)
    assert encoder.cache is not None

    @settings(max_examples=300, deadline=None)
    @given(texts(specials_of(tokenizer)), st.booleans())
    def check(text: str, special: bool) -> None:
        expected = tokenizer.encode(text, add_special_tokens=special).ids
        for _ in range(2):  # cold, then warm
            assert unpack_tokens(loop.run_until_complete(encoder.encode(text, add_special_tokens=special))) == expected

    check()
    assert encoder.cache.hits and encoder.cache.misses
    assert encoder.cache.tokens <= 400


def test_long_texts_encode_their_new_pieces_on_a_thread_exactly(
    tokenizers: dict[str, Tokenizer], loop: asyncio.AbstractEventLoop
) -> None:
    tokenizer = tokenizers["llama3-like"]
    encoder = Encoder(tokenizer, cache_tokens=1 << 20)
    system = "<|start_header_id|>system<|end_header_id|>\n\n" + "You are a careful assistant. " * 60 + "<|eot_id|>"
    turns = [f"<|start_header_id|>user<|end_header_id|>\n\n{f'question {n} ' * 120}<|eot_id|>" for n in range(4)]
    for count in range(1, 5):
        text = "<|begin_of_text|>" + system + "".join(turns[:count])
        misses = encoder.cache.misses if encoder.cache else 0
        assert (
            unpack_tokens(loop.run_until_complete(encoder.encode(text, add_special_tokens=False)))
            == tokenizer.encode(text, add_special_tokens=False).ids
        )
        assert encoder.cache is not None
        if count > 1:  # the system prompt and the earlier turns were found; only the new turn's text encoded
            assert encoder.cache.misses - misses == 1


def test_a_text_of_many_pieces_holds_the_event_loop_briefly_and_encodes_exactly(
    tokenizers: dict[str, Tokenizer], loop: asyncio.AbstractEventLoop
) -> None:
    """A client's text of 30,000 distinct pieces between added tokens (300 kB, well under the body limit):
    its pieces were looked up in a list, quadratic, seconds of the event loop held; now a few tens of ms."""
    tokenizer = tokenizers["chatml-tools"]
    encoder = Encoder(tokenizer, cache_tokens=1 << 20)
    many = "".join(f"piece {n}<|im_end|>" for n in range(30_000))
    other = "<|im_start|>user\n" + "a few words " * 100  # another request's, queued for the thread beside it

    async def longest_hold() -> tuple[float, list[bytes]]:
        held, ticking = 0.0, True

        async def tick() -> None:
            nonlocal held
            last = time.perf_counter()
            while ticking:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                held, last = max(held, now - last), now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        encoded = await asyncio.gather(
            encoder.encode(many, add_special_tokens=False), encoder.encode(other, add_special_tokens=True)
        )
        ticking = False
        await ticker
        return held, encoded

    held, (ids, other_ids) = loop.run_until_complete(longest_hold())
    assert unpack_tokens(ids) == tokenizer.encode(many, add_special_tokens=False).ids
    assert unpack_tokens(other_ids) == tokenizer.encode(other, add_special_tokens=True).ids
    assert held < 1.0


def unsafe_cases() -> dict[str, tuple[Tokenizer, str, str, list[str | int] | None]]:
    """Tokenizers whose split would not be exact: why, a text, and the naive cut of that text (each
    piece encoded on its own, the added tokens' ids between) that encodes differently from the whole."""
    prepend = base()
    prepend.normalizer = normalizers.Prepend("x")
    prepend.add_tokens([AddedToken("<sep>", normalized=True)])
    first = base()
    first.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    strip = base()
    strip.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    single = base()
    single.add_tokens([AddedToken("ab", single_word=True)])
    truncating = base()
    truncating.enable_truncation(8)
    sep, mask, ab = (
        tokenizer.token_to_id(token) for tokenizer, token in ((prepend, "<sep>"), (strip, "<mask>"), (single, "ab"))
    )
    return {
        "normalized token under a normalizer": (
            prepend,
            "is matched on the normalized text",
            "a<sep>b",
            ["a", sep, "b"],
        ),
        "Metaspace first": (first, "Metaspace (prepend_scheme first)", "a<|eot_id|>b", ["a", 6, "b"]),
        "lstrip": (strip, "strips whitespace", "a <mask> b", ["a ", mask, " b"]),
        "single word": (single, "whole words", "xab ab", ["x", ab, " ", ab]),
        "truncation": (truncating, "truncates", "<s>" + "word " * 20, None),
    }


@pytest.mark.parametrize("case", sorted(unsafe_cases()))
def test_a_tokenizer_the_cut_would_get_wrong_is_encoded_whole(
    case: str, loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer, why, text, naive_cut = unsafe_cases()[case]
    plan = SegmentPlan.of(tokenizer)
    assert isinstance(plan, str) and why in plan
    with caplog.at_level(logging.INFO, logger="api.proxy.tokens"):
        encoder = Encoder(tokenizer, cache_tokens=1 << 20, where="model 'm'")
    assert encoder.cache is None
    assert f"model 'm': tokenizer cache off, texts encoded whole: {plan}" in caplog.text
    assert (
        unpack_tokens(loop.run_until_complete(encoder.encode(text, add_special_tokens=True)))
        == tokenizer.encode(text).ids
    )
    if naive_cut is not None:
        naive = [
            token_id
            for piece in naive_cut
            for token_id in (
                [piece] if isinstance(piece, int) else tokenizer.encode(piece, add_special_tokens=False).ids
            )
        ]
        assert naive != tokenizer.encode(text, add_special_tokens=False).ids


def test_the_cache_is_bounded_by_tokens_least_recently_used_first() -> None:
    cache = SegmentCache(max_tokens=3 * (ENTRY_TOKENS + 2))
    two = bytes(8)
    for piece in "abc":
        cache.put(piece, two)
    assert cache.get("a") == two  # a is now the most recent
    cache.put("d", two)
    assert cache.get("b") is None and cache.get("a") == two and cache.get("d") == two
    assert cache.tokens == 3 * (ENTRY_TOKENS + 2) and len(cache) == 3
    cache.put("huge", bytes(4 * 1000))  # more than the whole budget: not kept, nothing dropped for it
    assert len(cache) == 3 and (cache.hits, cache.misses) == (3, 1)


def test_the_setting_sizes_each_model_s_cache_and_metrics_count_it(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    directory = assemble("llama3-like", tmp_path / "m")
    files = load_model_files({"m": directory}, ProxyConfig().proxy_tokenizer_cache_tokens)["m"]
    assert files.encoder.cache is not None and files.encoder.cache.max_tokens == 1_048_576
    assert load_model_files({"m": directory}, 0)["m"].encoder.cache is None
    registry = CollectorRegistry()
    ProxyMetrics(registry, 8, lambda worker_id: True).watch_tokenizer_caches({"m": files.encoder.cache})
    for _ in range(2):
        loop.run_until_complete(files.encoder.encode("hi<|eot_id|>there", add_special_tokens=True))
    assert registry.get_sample_value("kv_router_proxy_tokenizer_cache_misses_total", {"model": "m"}) == 2
    assert registry.get_sample_value("kv_router_proxy_tokenizer_cache_hits_total", {"model": "m"}) == 2
    held = registry.get_sample_value("kv_router_proxy_tokenizer_cache_tokens", {"model": "m"})
    assert held == files.encoder.cache.tokens > 0
