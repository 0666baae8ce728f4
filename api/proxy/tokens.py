"""The token ids a request is routed by.

A prompt of token ids is used as it is. Text prompts of a model with a local tokenizer (``--tokenizer
MODEL=PATH``, a ``tokenizer.json`` read with the ``tokenizers`` package, nothing downloaded) are
encoded here; every other text prompt, and every chat request, is tokenized by a worker serving the
model through its ``/tokenize`` endpoint (vLLM's and SGLang's shape), which applies the engine's own
chat template: routing tokens that differ from the engine's give silent cache misses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from api.proxy.upstream import Upstream, UpstreamError
from api.proxy.wire import ChatMessage, TokenizeReply
from indexer.errors import UNDECODABLE
from router.types import WorkerConfig

__all__ = ["PromptTokenizer", "TokenizeFailed", "load_tokenizers"]

# Longer texts are encoded off the event loop.
_INLINE_CHARS = 16_384

_decode_tokens = msgspec.json.Decoder(TokenizeReply).decode
_encode = msgspec.json.Encoder().encode


class TokenizeFailed(Exception):
    """No worker could tokenize the prompt."""


def load_tokenizers(paths: dict[str, Path]) -> dict[str, Tokenizer]:
    """The local tokenizers; raises ``ValueError`` naming a file that cannot be read."""
    loaded = {}
    for model, path in paths.items():
        try:
            loaded[model] = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ValueError(f"tokenizer for model {model!r}: cannot load {path}: {exc}") from None
    return loaded


class PromptTokenizer:
    def __init__(self, local: dict[str, Tokenizer], upstream: Upstream) -> None:
        self._local = local
        self._upstream = upstream
        self._turn = 0  # the workers take turns at tokenizing

    async def text(self, model: str, text: str, workers: Sequence[WorkerConfig]) -> list[int]:
        tokenizer = self._local.get(model)
        if tokenizer is None:
            return await self._remote({"model": model, "prompt": text}, workers)
        if len(text) <= _INLINE_CHARS:
            return list(tokenizer.encode(text).ids)
        encoding = await asyncio.to_thread(tokenizer.encode, text)
        return list(encoding.ids)

    async def chat(self, model: str, messages: list[ChatMessage], workers: Sequence[WorkerConfig]) -> list[int]:
        return await self._remote({"model": model, "messages": messages, "add_generation_prompt": True}, workers)

    async def _remote(self, body: dict[str, Any], workers: Sequence[WorkerConfig]) -> list[int]:
        """Ask the workers, starting with the next one's turn, until one answers."""
        payload = _encode(body)
        problems = []
        self._turn += 1
        start = self._turn % len(workers) if workers else 0
        for worker in (*workers[start:], *workers[:start]):
            assert worker.url is not None
            try:
                status, content = await self._upstream.post(worker.url, b"/tokenize", payload)
                if status == 200:
                    return _decode_tokens(content).tokens
                problems.append(f"worker {worker.worker_id}: HTTP {status}")
            except UpstreamError as exc:
                problems.append(f"worker {worker.worker_id}: {exc}")
            except UNDECODABLE as exc:
                problems.append(f"worker {worker.worker_id}: {type(exc).__name__}")
        raise TokenizeFailed("no worker could tokenize the prompt (" + "; ".join(problems or ["none serves it"]) + ")")
