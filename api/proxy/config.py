"""`ProxyConfig`: the ``proxy`` settings section (``kv-router serve --proxy``).

Kept free of heavy imports: `api.config` lists it among the sections whatever command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

__all__ = ["ProxyConfig"]


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


PositiveSecs = Annotated[float, msgspec.Meta(gt=0)]


class ProxyConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The OpenAI-compatible front door: /v1/completions, /v1/chat/completions, /v1/models."""

    proxy: Annotated[
        bool, _doc("serve the OpenAI API and forward each request to the worker the router picks (workers with a url)")
    ] = False
    proxy_retries: Annotated[
        int,
        _doc("other workers tried when one refuses the connection or answers 5xx before its first byte"),
        msgspec.Meta(ge=0),
    ] = 2
    proxy_cooldown_secs: Annotated[
        float, _doc("a worker that failed is not proxied to for this long"), msgspec.Meta(ge=0)
    ] = 10.0
    proxy_connect_timeout_secs: Annotated[PositiveSecs, _doc("time to open a connection to a worker")] = 2.0
    proxy_read_timeout_secs: Annotated[
        PositiveSecs, _doc("longest silence of a worker: before its first byte (prefill, its queue) and between chunks")
    ] = 300.0
    proxy_connections_per_worker: Annotated[
        int, _doc("pooled keep-alive connections to one worker (0: no limit)"), msgspec.Meta(ge=0)
    ] = 512
    proxy_retry_after_secs: Annotated[
        int, _doc("Retry-After of a 429 when the router's queue refuses a request"), msgspec.Meta(ge=0)
    ] = 1
    proxy_calibration_window: Annotated[
        int, _doc("requests per worker in the predicted-vs-actual cached tokens gauge"), msgspec.Meta(ge=1)
    ] = 256
    tokenizer: Annotated[
        str | None,
        _doc(
            "local tokenizers for text prompts, MODEL=PATH[,MODEL=PATH...] to tokenizer.json files (never "
            "downloaded); other models and chat messages are tokenized by a worker's /tokenize"
        ),
    ] = None

    def __post_init__(self) -> None:
        self.tokenizer_paths()  # a malformed value fails at start-up, naming the setting

    def tokenizer_paths(self) -> dict[str, Path]:
        """Model name -> tokenizer.json, from ``tokenizer``."""
        paths: dict[str, Path] = {}
        for item in (self.tokenizer or "").split(","):
            if not item.strip():
                continue
            model, sep, path = item.partition("=")
            if not sep or not model.strip() or not path.strip():
                raise ValueError(f"tokenizer: expected MODEL=PATH, got {item.strip()!r}")
            paths[model.strip()] = Path(path.strip())
        return paths
