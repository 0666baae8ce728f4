"""Token ids for trace requests that carry only prefix-block ids (Mooncake's ``hash_ids``).

A trace block id stands for a whole prefix chain, so two prompts share their first k trace blocks
exactly when they share their first k ids. To keep that structure at *any* router or engine block
size, every token of a trace block is a function of that block's id alone, and no two blocks share a
single token: block ``d`` (ids renumbered densely, in order of first appearance) holds the tokens
``d * 2^s + j`` for ``j`` in ``0 .. trace_block_size - 1``, with ``2^s`` the trace block size rounded up
to a power of two. Any window of tokens therefore identifies the blocks it covers and its position in
them: equal windows come from equal prefixes, whatever the window size, and a prompt's partial last
block is a prefix of that block's tokens.

Ids are u32, so a trace may have up to ``2^32 / 2^s`` distinct blocks (8,388,608 at 512 tokens).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

__all__ = ["BlockTokens"]


class BlockTokens:
    """Packed little-endian u32 token ids for dense trace block ids."""

    def __init__(self, trace_block_size: int) -> None:
        if trace_block_size < 1:
            raise ValueError(f"trace block size must be >= 1, got {trace_block_size}")
        self.trace_block_size = trace_block_size
        self.shift = (trace_block_size - 1).bit_length()
        self.max_blocks = 1 << (32 - self.shift)
        # Block d is the template 0 .. n-1 with d's bits above them: one big-int OR builds it.
        self._template = int.from_bytes(array("I", range(trace_block_size)).tobytes(), "little")
        self._block_bytes = 4 * trace_block_size

    def block(self, dense_id: int) -> bytes:
        """The tokens of one trace block."""
        if not 0 <= dense_id < self.max_blocks:
            raise ValueError(f"trace block {dense_id} is beyond the {self.max_blocks} blocks u32 token ids can hold")
        high = int.from_bytes(struct.pack("<I", dense_id << self.shift) * self.trace_block_size, "little")
        return (self._template | high).to_bytes(self._block_bytes, "little")

    def prompt(self, dense_ids: Sequence[int], length: int) -> bytes:
        """The first ``length`` tokens of the chain of blocks ``dense_ids``."""
        if length > len(dense_ids) * self.trace_block_size:
            raise ValueError(f"{len(dense_ids)} trace blocks cannot hold {length} tokens")
        return b"".join(self.block(d) for d in dense_ids)[: 4 * length]
