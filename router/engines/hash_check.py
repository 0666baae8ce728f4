"""The engine's own block hashes against our tokens hashes: the doctor's direct `tokens_hash_mismatch`.

An engine's block hash names one block: its parent, its tokens and whatever else the engine salts
its cache with (vLLM's ``cache_salt`` and LoRA adapter, multimodal ``extra_keys``). Our
``tokens_hash`` is what requests will be matched with: the same tokens, salted only by what the
event says (``lora_name``, SGLang's ``cache_salt``, vLLM 0.32's salt in ``extra_keys``) and the
router's cache namespace. The two must
tell blocks apart alike; two contradictions show they do not:

- the engine gives two different hashes to blocks under one parent that our hashing makes equal:
  the engine salts with something its events do not carry (a ``cache_salt``, a LoRA adapter known
  only by ``lora_id``, multimodal ids), so the router merges caches the engine keeps apart and
  predicts hits that are misses;
- the engine sends one hash twice with tokens our hashing makes different: our salt (a LoRA name,
  a namespace) varies where the engine's does not, and the router splits one cache in two.

Only the first block of each stored event is looked at (one dict lookup each way per event, not per
block: a mis-salted prompt contradicts itself on its first block already). The record is bounded
and forgotten when the engine restarts.
"""

from __future__ import annotations

from indexer.engine_events import EngineStored

__all__ = ["TokensHashCheck"]

MAX_RECORDED = 65_536


class TokensHashCheck:
    def __init__(self, max_recorded: int = MAX_RECORDED) -> None:
        self.max_recorded = max_recorded
        # Also kept by `indexer._events_native.bridge_batch`, which observes as `observe` does.
        self.by_content: dict[tuple[int | None, int], int] = {}  # (parent, tokens_hash) -> engine hash
        self.by_hash: dict[int, int] = {}  # engine hash -> tokens_hash

    def observe(self, stored: EngineStored) -> str | None:
        """Record the store's first block; the evidence of a contradiction with an earlier one, if any."""
        if not stored.block_hashes:
            return None
        block_hash, tokens_hash, parent = stored.block_hashes[0], stored.tokens_hashes[0], stored.parent_hash
        if len(self.by_hash) >= self.max_recorded:
            self.reset()
        known_hash = self.by_content.setdefault((parent, tokens_hash), block_hash)
        known_tokens = self.by_hash.setdefault(block_hash, tokens_hash)
        return evidence(known_hash, block_hash, tokens_hash, parent, known_tokens)

    def reset(self) -> None:
        self.by_content.clear()
        self.by_hash.clear()


def evidence(known_hash: int, block_hash: int, tokens_hash: int, parent: int | None, known_tokens: int) -> str | None:
    """What a store's first block and the record say together: a contradiction's evidence, or None."""
    if known_hash != block_hash:
        under = "the root" if parent is None else f"parent {parent}"
        return (
            f"the engine hashes blocks {known_hash} and {block_hash} under {under} apart, but their token ids "
            f"hash alike here (tokens_hash {tokens_hash}): the engine salts its cache with something its events "
            "do not carry (a cache_salt, a LoRA adapter named only by lora_id, multimodal ids), so requests that "
            "differ only in it look cached when they are not"
        )
    if known_tokens != tokens_hash:
        return (
            f"the engine sends block {block_hash} with token ids that hash to {known_tokens} once and "
            f"{tokens_hash} another time: the LoRA name, cache salt or namespace that salts our hashes varies "
            "where the engine's does not, so one cache is split in two"
        )
    return None
