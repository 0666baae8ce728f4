"""How long one forward pass of a simulated worker takes.

A pass first runs the prefill chunks scheduled in it, then one decode step for every sequence that
was already generating; the pass lasts ``prefill_ms + decode_ms`` (divided by ``speedup_ratio``).

Prefill, for chunks of ``n_i`` new tokens each attending to ``c_i`` tokens already in the cache
(its cached prefix and its earlier chunks)::

    prefill_ms = base + per_token * N + attention * sum_i n_i * (n_i + 2 * c_i),    N = sum_i n_i

The linear term is the weight-bound work per token; the last term is attention: a new token attends
to the ``c_i`` cached tokens and, on average, to half of the chunk, so a chunk costs
``n_i * (c_i + n_i / 2)`` token pairs at ``2 * attention`` ms each. With one chunk and no context this
is exactly Dynamo's mocker polynomial ``16.50142 + 0.01518344 n + 4.209989e-7 n^2``, fitted by
NVIDIA on a real engine, so the constants are Dynamo's; the context term extends it in the only way
consistent with that fit: a cache hit removes the new tokens' own cost but the tokens computed after
it still pay for attending to the cached prefix. (Dynamo applies its polynomial to the batch total
``N`` and ignores context; the two agree for a single uncached chunk.)

Decode, for ``B`` sequences whose contexts add up to ``K`` tokens, in a pool of ``C`` tokens::

    decode_ms = max(floor, c0 + c1 * K / C + c2 * (K / C)^2 + per_seq * B)

The polynomial in the KV fraction is Dynamo's (5.74, 54.01, -25.74, with a 1 ms floor): decode is
memory-bound, so it grows with the KV read per step and flattens as the batch saturates the GPU. The
small per-sequence term is ours (sampling and per-request bookkeeping); 0.01 ms adds 2.6 ms at 256
sequences.

``prefill_form="dynamo"`` with ``decode_per_seq_ms=0`` reproduces Dynamo 1.6.1's mocker timing exactly
(the attention term becomes ``attention * N^2`` and context is ignored); the calibration bench uses it to
separate what the timing model changes from what the rest of the simulator does.
"""

from __future__ import annotations

from mocker.config import EngineConfig

__all__ = ["PassTimer"]


class PassTimer:
    """The timing model of one `EngineConfig`, with its constants bound for the hot path."""

    __slots__ = (
        "_attention",
        "_capacity",
        "_context",
        "_d0",
        "_d1",
        "_d2",
        "_floor",
        "_per_seq",
        "_per_token",
        "_prefill_base",
        "_speedup",
    )

    def __init__(self, config: EngineConfig) -> None:
        timing = config.timing
        self._prefill_base = timing.prefill_base_ms
        self._per_token = timing.prefill_per_token_ms
        self._attention = timing.prefill_attention_ms
        self._context = timing.prefill_form == "attention"
        self._d0 = timing.decode_base_ms
        self._d1 = timing.decode_linear_ms
        self._d2 = timing.decode_quadratic_ms
        self._per_seq = timing.decode_per_seq_ms
        self._floor = timing.decode_floor_ms
        self._capacity = float(config.capacity_tokens)
        self._speedup = config.speedup_ratio

    def prefill_ms(self, new_tokens: int, attended_pairs: int) -> float:
        """``new_tokens`` = N; ``attended_pairs`` = sum of n * (n + 2c) over the pass's chunks."""
        if new_tokens <= 0:
            return 0.0
        pairs = attended_pairs if self._context else new_tokens * new_tokens
        ms = self._prefill_base + self._per_token * new_tokens + self._attention * pairs
        return ms / self._speedup

    def decode_ms(self, sequences: int, context_tokens: int) -> float:
        if sequences <= 0:
            return 0.0
        used = context_tokens / self._capacity
        ms = self._d0 + self._d1 * used + self._d2 * used * used + self._per_seq * sequences
        return max(self._floor, ms) / self._speedup
