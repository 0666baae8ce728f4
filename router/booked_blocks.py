"""One rank's booked prompt blocks: which sequence hashes active requests hold, and how many each.

Requests on a rank share blocks only as a common prefix of their prompts (a sequence hash names
its whole prefix), so every question the load model asks is about a prefix: how many leading blocks
of a prompt are booked already (`held`), how many of a booked prompt other requests hold too
(`shared`). `BookedBlocks` here keeps a dict sequence hash -> refcount and bisects it; with the
accelerator `router._native.BookedBlocks` answers the same from a trie of prompts with compressed
edges (one step per divergence, slices compared in C, no dict operation per block).
`tests/test_native_router.py` checks both give the same answers and refcounts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.native import ENABLED as NATIVE
from router.native import accel

__all__ = ["BookedBlocks", "BookedBlocksLike", "new_booked_blocks"]


class BookedBlocksLike(Protocol):
    """What `ActiveSequences` asks of a rank's booked blocks (both implementations)."""

    def __len__(self) -> int: ...
    def book(self, hashes: Sequence[int], /) -> int: ...
    def release(self, hashes: Sequence[int], /) -> int: ...
    def shared(self, hashes: Sequence[int], /) -> int: ...
    def held(self, hashes: Sequence[int], /) -> int: ...
    def refcounts(self) -> dict[int, int]: ...


class BookedBlocks:
    """Sequence hash -> how many active requests on the rank hold that block. `len()` is the number
    of distinct booked blocks."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def book(self, hashes: Sequence[int], /) -> int:
        """Book a prompt; returns how many of its leading blocks were booked before. O(len(hashes))."""
        refs = self._refs
        held = self.held(hashes)
        for block_hash in hashes[:held]:
            refs[block_hash] += 1
        refs.update(dict.fromkeys(hashes[held:], 1))
        return held

    def release(self, hashes: Sequence[int], /) -> int:
        """Free a booked prompt; returns how many of its leading blocks other requests still hold."""
        refs = self._refs
        shared = self.shared(hashes)
        for block_hash in hashes[:shared]:
            refs[block_hash] -= 1
        for block_hash in hashes[shared:]:
            del refs[block_hash]
        return shared

    def shared(self, hashes: Sequence[int], /) -> int:
        """How many leading blocks of a booked prompt other requests hold too: refcounts never
        increase along a prompt, so those only it holds (refcount 1) are a suffix. O(log n)."""
        refs = self._refs
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high) // 2
            if refs[hashes[middle]] > 1:
                low = middle + 1
            else:
                high = middle
        return low

    def held(self, hashes: Sequence[int], /) -> int:
        """How many leading hashes of a prompt are booked: they are a prefix, so bisect. O(log n)."""
        refs = self._refs
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in refs:
                low = middle + 1
            else:
                high = middle
        return low

    def refcounts(self) -> dict[int, int]:
        """Each booked hash and how many active requests hold it (for checks)."""
        return dict(self._refs)


def new_booked_blocks() -> BookedBlocksLike:
    """A rank's empty booked blocks: the C trie with the accelerator, else the dict."""
    return accel.BookedBlocks() if NATIVE else BookedBlocks()
