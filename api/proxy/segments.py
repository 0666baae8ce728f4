"""A text's token ids from its segments' cached ids, exactly as the tokenizer would encode it whole.

A Hugging Face tokenizer first splits its input at its added tokens (special or not: leftmost-longest
matches of their text, those with ``normalized: false`` on the raw text), then normalizes, pre-tokenizes
and encodes each piece between them on its own, and the post-processor wraps the whole (a BOS, ...). So
``encode(text)`` is the template's ids before, each piece's ids (or the added token's id) in order, the
template's ids after. A multi-turn chat or a shared system prompt renders to the same pieces again:
only its new pieces are encoded.

That holds by construction only for what this module can read and prove per piece (`SegmentPlan.of`
answers why not otherwise, and the model is encoded whole): added tokens that strip the whitespace
beside them (``lstrip``/``rstrip``), match only whole words (``single_word``) or match the normalized
text under a normalizer; a pre-tokenizer that looks at where a piece sits in the text (``Metaspace``
with ``prepend_scheme: first``: only the piece at offset 0 gets its ``▁``) or one not listed here; BPE
dropout; truncation or padding; a post-processor other than a template of ids around the sequence.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

__all__ = ["SegmentCache", "SegmentPlan"]

# Whatever their settings, these see one piece at a time and only its text.
_NORMALIZERS = {
    "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace", "Prepend",
    "BertNormalizer", "Precompiled", "Nmt", "ByteLevel",
}  # fmt: skip
_PRE_TOKENIZERS = {
    "ByteLevel", "Split", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "BertPreTokenizer",
    "UnicodeScripts", "CharDelimiterSplit", "Metaspace",
}  # fmt: skip
_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
# A cache entry's own memory (its key, the dict's slot) counted as this many tokens.
ENTRY_TOKENS = 16


@dataclass(frozen=True)
class SegmentPlan:
    """How a tokenizer splits a text at its added tokens, and its template's ids around a sequence."""

    added: re.Pattern[str] | None  # the added tokens matched on the raw text, longest first
    later: re.Pattern[str] | None  # those with normalized: true (no normalizer: the same text), matched after
    ids: dict[str, int]
    before_ids: tuple[int, ...]  # the template's ids before the sequence (add_special_tokens)
    after_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> SegmentPlan | str:
        """The plan, or why encoding by segment would not be exact for this tokenizer."""
        if tokenizer.encode_special_tokens:
            return "it encodes special tokens as text"
        config = json.loads(tokenizer.to_str())
        if config.get("truncation") is not None or config.get("padding") is not None:
            return "it truncates or pads"
        normalizer = config.get("normalizer")
        if normalizer is not None and (unknown := _unknown(normalizer, _NORMALIZERS, "normalizers")):
            return f"normalizer {unknown} is not known to work per piece"
        pre_tokenizer = config.get("pre_tokenizer")
        if pre_tokenizer is not None and (unknown := _unknown(pre_tokenizer, _PRE_TOKENIZERS, "pretokenizers")):
            return f"pre-tokenizer {unknown} is not known to work per piece"
        model = config.get("model") or {}
        if model.get("type") not in _MODELS:
            return f"model {model.get('type')} is not known to work per piece"
        if model.get("dropout"):
            return "its BPE dropout is random"
        raw: list[str] = []
        normalized: list[str] = []
        ids: dict[str, int] = {}
        for token in config.get("added_tokens") or []:
            content = token["content"]
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return f"added token {content!r} strips whitespace or matches whole words only"
            if not content or content in ids:
                return f"added token {content!r} is empty or given twice"
            if token.get("normalized"):
                if normalizer is not None:
                    return f"added token {content!r} is matched on the normalized text"
                normalized.append(content)
            else:
                raw.append(content)
            ids[content] = token["id"]
        template = _template(config.get("post_processor"))
        if template is None:
            return f"post-processor {(config.get('post_processor') or {}).get('type')} is not a template of ids"
        before, after = template
        if len(before) + len(after) != tokenizer.num_special_tokens_to_add(is_pair=False):
            return "its post-processor adds other tokens than its template reads"
        return cls(_alternation(raw), _alternation(normalized), ids, tuple(before), tuple(after))

    def split(self, text: str) -> list[str | int]:
        """The text's pieces in order: texts to encode, and added tokens' ids."""
        if self.added is None:
            return self._split_later(text)
        pieces: list[str | int] = []
        start = 0
        for match in self.added.finditer(text):
            if match.start() > start:
                pieces += self._split_later(text[start : match.start()])
            pieces.append(self.ids[match.group()])
            start = match.end()
        if start < len(text):
            pieces += self._split_later(text[start:])
        return pieces

    def _split_later(self, text: str) -> list[str | int]:
        if self.later is None:
            return [text]
        pieces: list[str | int] = []
        start = 0
        for match in self.later.finditer(text):
            if match.start() > start:
                pieces.append(text[start : match.start()])
            pieces.append(self.ids[match.group()])
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces


def _unknown(component: dict[str, Any], known: set[str], nested: str) -> str | None:
    """The first component (of a ``Sequence``, recursively) not in ``known``, or working across pieces."""
    kind = component.get("type")
    if kind == "Sequence":
        return next((found for part in component.get(nested) or [] if (found := _unknown(part, known, nested))), None)
    if kind == "Metaspace" and component.get("prepend_scheme") == "first":
        return "Metaspace (prepend_scheme first)"
    return None if kind in known else str(kind)


def _template(processor: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a single sequence with special tokens."""
    if processor is None:
        return [], []
    kind = processor.get("type")
    if kind == "ByteLevel":  # offsets only
        return [], []
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [processor["cls"][1]], [processor["sep"][1]]
    if kind == "TemplateProcessing":
        before: list[int] = []
        after: list[int] = []
        sequences = 0
        for item in processor["single"]:
            if "Sequence" in item:
                sequences += 1
            else:
                (after if sequences else before).extend(processor["special_tokens"][item["SpecialToken"]["id"]]["ids"])
        return (before, after) if sequences == 1 else None
    if kind == "Sequence":  # each wraps what the one before made
        before, after = [], []
        for part in processor.get("processors") or []:
            wrap = _template(part)
            if wrap is None:
                return None
            before, after = wrap[0] + before, after + wrap[1]
        return before, after
    return None


def _alternation(contents: list[str]) -> re.Pattern[str] | None:
    """Leftmost-longest matches of the contents (Python's alternation takes the first that matches at
    the leftmost place: longest first)."""
    if not contents:
        return None
    return re.compile("|".join(re.escape(content) for content in sorted(contents, key=len, reverse=True)))


class SegmentCache:
    """Pieces' ids (packed u32), least recently used first out, bounded by their tokens (each entry
    counting `ENTRY_TOKENS` more for its own memory)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, piece: str) -> bytes | None:
        found = self._entries.get(piece)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(piece)
        return found

    def put(self, piece: str, ids: bytes) -> None:
        cost = len(ids) // 4 + ENTRY_TOKENS
        if cost > self.max_tokens or piece in self._entries:
            return
        self._entries[piece] = ids
        self.tokens += cost
        while self.tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped) // 4 + ENTRY_TOKENS
