"""A request's tokens turned into what routing needs: the prompt length, the local block hashes the
index is queried with, and the blocks the router books for it (§4.1 step 1).

Booked blocks are the prompt's sequence hashes, so concurrent prompts sharing a prefix share them
(`router_assume_kv_reuse`, the default). Without KV reuse Dynamo books random hashes that never match;
the same load is kept here as a count of private blocks, with no hash to compute or store. With
`router_track_active_blocks` off nothing is booked (§4.2: the decode term is then 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from indexer.hashing import TokenInput, compute_block_hashes, sequence_hash_tuple
from router.config import RouterConfig
from router.errors import InvalidRequest

__all__ = ["Prompt", "prepare_prompt", "token_count"]


class Prompt:
    """A hashed prompt. ``shared_hashes`` is None when the router books no shared blocks."""

    __slots__ = ("isl_tokens", "local_hashes", "private_blocks", "shared_hashes")

    def __init__(
        self, isl_tokens: int, local_hashes: list[int], shared_hashes: tuple[int, ...] | None, private_blocks: int
    ) -> None:
        self.isl_tokens = isl_tokens
        self.local_hashes = local_hashes
        self.shared_hashes = shared_hashes
        self.private_blocks = private_blocks

    def unbooked(self) -> Prompt:
        """The same prompt booking no blocks (as with `router_track_active_blocks` off)."""
        return Prompt(self.isl_tokens, self.local_hashes, None, 0)

    @property
    def booked_blocks(self) -> int:
        """Blocks this prompt adds to an idle rank's decode load."""
        return len(self.shared_hashes) if self.shared_hashes is not None else self.private_blocks


def token_count(tokens: TokenInput) -> int:
    """The prompt length; packed tokens are little-endian u32, 4 bytes each."""
    return len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)


def prepare_prompt(
    tokens: TokenInput,
    config: RouterConfig,
    *,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    block_mm_infos: Sequence[Mapping[str, Any] | None] | None = None,
    isl_tokens: int | None = None,
) -> Prompt:
    """Hash a prompt. ``isl_tokens``: the prompt length for load when the tokens hashed are not the
    prompt itself (Dynamo's ``expanded_prompt_len`` of multimodal routing tokens); their count by
    default. Raises `InvalidRequest` for an empty or malformed one. O(tokens)."""
    if token_count(tokens) == 0:
        raise InvalidRequest("a request needs at least one token")
    if isl_tokens is None:
        isl_tokens = token_count(tokens)
    elif isl_tokens < 1:
        raise InvalidRequest(f"the prompt length must be at least 1 token, got {isl_tokens}")
    try:
        local_hashes = compute_block_hashes(
            tokens,
            config.block_size,
            lora_name=lora_name,
            cache_namespace=cache_namespace,
            block_mm_infos=block_mm_infos,
            is_eagle=config.enable_eagle,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    shared_hashes = None
    private_blocks = 0
    if config.router_track_active_blocks:
        if config.router_assume_kv_reuse:
            # A tuple: booked requests keep it, and the collector stops tracking a tuple of ints after
            # one look, where a list of a thousand hashes would be walked by every full collection.
            shared_hashes = sequence_hash_tuple(local_hashes)
        else:
            private_blocks = len(local_hashes)
    return Prompt(isl_tokens, local_hashes, shared_hashes, private_blocks)
