"""A prompt routed by its bytes: for a model none of whose workers sends KV events.

Such workers' caches are predicted from what the router itself sends them (approximate mode,
`router.approximate`), so the routing tokens only have to agree with each other: the same prefix, the
same leading blocks. A text's UTF-8 bytes, read four to a token (little-endian u32, zero-padded), are
such tokens, and already packed as routing hashes them: no tokenizer, no ``/tokenize`` round trip. Four
bytes is about one token of English text for today's tokenizers, so loads and cached prefixes come out in
about the engine's tokens. A chat is its messages encoded in JSON after what comes before them in the
template (tools, template, its arguments): a later turn of a conversation extends an earlier one's bytes.
A content part other than text (an image, audio, a file: often inlined as base64) stands in by a digest
of itself: the same part, the same bytes, and megabytes of image do not read as a million tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

from api.proxy.chat_template import without_billing_header
from api.proxy.wire import ChatBody, ChatMessage

__all__ = ["BYTES_PER_TOKEN", "chat_bytes", "text_bytes"]

BYTES_PER_TOKEN = 4

_encode = msgspec.json.Encoder().encode


def text_bytes(text: str) -> bytes:
    # surrogatepass: a JSON string may hold a lone surrogate; it is routed, the engine judges it.
    return _padded(text.encode("utf-8", "surrogatepass"))


def chat_bytes(request: ChatBody) -> bytes:
    before = _encode((request.tools, request.chat_template, request.chat_template_kwargs))
    return _padded(before + _encode([_routable(message) for message in request.messages]))


def _routable(message: ChatMessage) -> ChatMessage:
    message = without_billing_header(message)
    if isinstance(message.content, list):
        return msgspec.structs.replace(message, content=[_part(part) for part in message.content])
    return message


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "text":
        return part
    return {"type": part.get("type"), "digest": xxhash.xxh3_64_hexdigest(_encode(part))}


def _padded(data: bytes) -> bytes:
    short = -len(data) % BYTES_PER_TOKEN
    return data + bytes(short) if short else data
