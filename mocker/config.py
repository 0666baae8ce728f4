"""`EngineConfig`: one simulated worker's geometry, scheduler limits and timing model.

Defaults are Dynamo 1.6.1's mocker defaults (``_normalize_mocker_config({})``): 16,384 blocks of 64
tokens (about 1 M tokens of KV per worker), 256 sequences and 8,192 tokens per forward pass, prefix
caching and chunked prefill on. The timing constants are explained in `mocker.timing`.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import msgspec

__all__ = ["EngineConfig", "PrefillForm", "TimingConfig"]

Positive = Annotated[int, msgspec.Meta(ge=1)]
# "attention": each chunk pays for attending to its cached context (ours, the default);
# "dynamo": Dynamo 1.6.1's form, the polynomial of the pass's total new tokens, context ignored.
PrefillForm = Literal["attention", "dynamo"]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class TimingConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Constants of the forward-pass timing model, in milliseconds (see `mocker.timing`).

    The prefill polynomial and the decode polynomial are Dynamo's mocker defaults (its
    ``PerfModel::Polynomial``), measured here against the 1.6.1 binary to the microsecond.
    """

    # Prefill: base + per_token * N + attention * sum(n * (n + 2 * context)) over the pass's chunks.
    prefill_form: PrefillForm = "attention"
    prefill_base_ms: NonNegativeFloat = 16.50142
    prefill_per_token_ms: NonNegativeFloat = 1.518344e-02
    prefill_attention_ms: NonNegativeFloat = 4.209989e-07
    # Decode: max(floor, c0 + c1 * u + c2 * u^2 + per_seq * batch), u = active KV tokens / capacity.
    decode_base_ms: float = 5.74
    decode_linear_ms: float = 54.01
    decode_quadratic_ms: float = -25.74
    decode_per_seq_ms: NonNegativeFloat = 0.01
    decode_floor_ms: NonNegativeFloat = 1.0


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A vLLM-like worker: KV block pool, continuous batching with chunked prefill, timing."""

    num_gpu_blocks: Positive = 16384
    block_size: Positive = 64
    max_num_seqs: Positive = 256
    max_num_batched_tokens: Positive = 8192
    # Divides every pass duration (Dynamo's ``speedup_ratio``): a faster or slower GPU.
    speedup_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=sys.float_info.max)] = 1.0
    timing: TimingConfig = msgspec.field(default_factory=TimingConfig)

    @property
    def capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def request_blocks(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most KV blocks a request holds: its prompt and every output token but the last, whose KV
        is never computed (at least one output token, as the engine generates)."""
        return -(-(prompt_tokens + max(1, max_tokens) - 1) // self.block_size)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether one worker's pool can hold the request at all, whatever the load (vLLM's
        ``max_model_len`` check at admission): a request that cannot is rejected when submitted."""
        return prompt_tokens > 0 and self.request_blocks(prompt_tokens, max_tokens) <= self.num_gpu_blocks
