"""Bodies in and out: JSON or msgpack, chosen by ``Content-Type`` and ``Accept``.

A hot route sees a request as a `Call` (raw body plus the few headers it reads) and answers with a
`Reply` (status and encoded bytes); both the HTTP protocol and the FastAPI routes translate to and
from these, so a handler never touches a framework object. Decoders are typed and built once per
body type (`BodyDecoder`), and decoding failures become the API's 400 / 422 errors.

A JSON prompt (``"tokens": [1, 2, ...]``) is the costliest part of a body: msgspec builds one Python
int per token, then the router packs them into u32 for hashing. With the C accelerator
(`api.native`) the top-level ``tokens`` array is parsed straight into packed little-endian u32,
the form the router takes as it is, and the rest of the body (the array replaced by ``[]``) is
decoded as usual. Anything that parser does not take as it is (another form, a float, an id out of
range, any decoding error) is decoded again the ordinary way, so replies and errors are the same.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import msgspec

from api.errors import InvalidBody, MalformedBody
from api.native import ENABLED as NATIVE
from api.native import accel
from indexer.errors import UNDECODABLE
from indexer.native import declined
from router.types import Tokens

__all__ = [
    "JSON",
    "MSGPACK",
    "BodyDecoder",
    "Call",
    "Reply",
    "RequestHead",
    "call_of",
    "encode",
    "is_msgpack",
    "query_flag",
    "read_head",
]

JSON = "application/json"
MSGPACK = "application/msgpack"

T = TypeVar("T")

_json_encode = msgspec.json.Encoder().encode
_msgpack_encode = msgspec.msgpack.Encoder().encode


def is_msgpack(media_type: bytes | None) -> bool:
    """True for application/msgpack and its older spellings (x-msgpack, vnd.msgpack)."""
    return media_type is not None and b"msgpack" in media_type.lower()


def query_flag(query: bytes, name: bytes) -> bool:
    """Whether ``name=true`` (or ``=1`` / ``=yes``, or a bare ``name``) is in a raw query string."""
    for part in query.split(b"&"):
        key, _, value = part.partition(b"=")
        if key == name:
            return value.lower() in (b"", b"1", b"true", b"yes")
    return False


@dataclass(slots=True)
class Call:
    """What a hot route reads from an HTTP request."""

    body: bytes
    msgpack: bool = False
    reply_msgpack: bool = False
    request_id: str | None = None  # the X-Request-Id header
    explain: bool = False  # the ?explain=true query flag
    authorization: bytes | str | None = None  # the Authorization header, checked by `api.auth`
    # Returns once the client has disconnected; watched only while a request waits in the queue.
    wait_disconnect: Callable[[], Awaitable[None]] | None = None


class RequestHead(NamedTuple):
    """The headers a data-plane route reads, from a request's raw header list (`read_head`; the C
    twin is `api._native.parse_post`'s own scan of a whole request)."""

    content_length: int = -1  # -1: not given (chunked) or not a number
    content_type: bytes | None = None
    accept: bytes | None = None
    request_id: str | None = None  # X-Request-Id
    authorization: bytes | None = None

    def call(self, body: bytes, query: bytes, wait_disconnect: Callable[[], Awaitable[None]] | None) -> Call:
        """The `Call` of a request with this head, ``body`` and raw ``query`` string."""
        return call_of(
            body, query, self.content_type, self.accept, self.request_id, self.authorization, wait_disconnect
        )


def call_of(
    body: bytes,
    query: bytes,
    content_type: bytes | None,
    accept: bytes | None,
    request_id: str | None,
    authorization: bytes | None,
    wait_disconnect: Callable[[], Awaitable[None]] | None,
) -> Call:
    """The `Call` of a request (`RequestHead.call`; the protocol calls it with what `api._native`'s
    parse_post read, without making a head)."""
    return Call(
        body,
        msgpack=is_msgpack(content_type),
        reply_msgpack=is_msgpack(accept),
        request_id=request_id,
        explain=query_flag(query, b"explain") if query else False,
        wait_disconnect=wait_disconnect,
        authorization=authorization,
    )


def read_head(headers: Iterable[tuple[bytes, bytes]]) -> RequestHead:
    """The `RequestHead` of raw (lower-cased name, value) header pairs, as ASGI and httptools give them."""
    content_length = -1
    content_type = accept = authorization = None
    request_id = None
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            content_length = int(value) if value.isdigit() else -1
        elif name == b"accept":
            accept = value
        elif name == b"x-request-id":
            request_id = value.decode("latin-1")
        elif name == b"authorization":
            authorization = value
    return RequestHead(content_length, content_type, accept, request_id, authorization)


@dataclass(slots=True)
class Reply:
    """What a hot route answers: a status and a body already encoded for the client."""

    status: int
    body: bytes
    msgpack: bool = False
    request_id: str | None = None  # echoed as X-Request-Id
    headers: tuple[tuple[str, str], ...] = ()  # any other header to send (a 401's WWW-Authenticate)

    @property
    def media_type(self) -> str:
        return MSGPACK if self.msgpack else JSON


def encode(value: Any, msgpack: bool) -> bytes:
    return _msgpack_encode(value) if msgpack else _json_encode(value)


# What the prompt fields (``tokens``, Dynamo's ``token_ids``) take, told when one is refused: msgspec's
# words for an ill-formed value there ("Invalid base64 encoded string") name neither form.
_PROMPT_FIELD = re.compile(r" - at `\$\.(?P<field>tokens|token_ids)`$")
_PACKED_FORM = {
    False: "or, as a string, base64 of packed little-endian u32",
    True: "or a bin of packed little-endian u32",
}
# Every body is an object, and in msgpack a map never starts with "{" or whitespace (those are small ints).
_JSON_AS_MSGPACK = f"the body is not msgpack (Content-Type: {MSGPACK}); it looks like JSON: send Content-Type: {JSON}"


def _explained(message: str, msgpack: bool) -> str:
    """msgspec's ``message`` for a body that does not fit its type, with what a prompt field takes
    when that is the field refused."""
    prompt = _PROMPT_FIELD.search(message)
    if prompt is None:
        return message
    return f"{message}; {prompt['field']} is an array of u32 token ids ({_PACKED_FORM[msgpack]})"


def _looks_like_json(body: bytes) -> bool:
    return body.lstrip()[:1] == b"{"


class _Prompted(Protocol):
    tokens: Tokens


def _prompted_types(body_type: Any) -> tuple[type[msgspec.Struct], ...]:
    """The struct types among ``body_type`` (one, or a union of them) with a ``tokens`` field."""
    members = typing.get_args(body_type) or (body_type,)
    return tuple(
        member
        for member in members
        if isinstance(member, type) and issubclass(member, msgspec.Struct) and "tokens" in member.__struct_fields__
    )


class BodyDecoder(Generic[T]):
    """A JSON and a msgpack decoder for one body type, built once."""

    __slots__ = ("_json", "_msgpack", "_packed_tokens", "_prompted")

    def __init__(self, body_type: type[T] | Any, *, packed_tokens: bool = NATIVE) -> None:
        """``packed_tokens``: parse a JSON ``tokens`` array with the C accelerator (see the module)."""
        if packed_tokens and accel is None:
            raise ValueError("the C accelerator api._native is not built")
        self._json: msgspec.json.Decoder[T] = msgspec.json.Decoder(body_type)
        self._msgpack: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(body_type)
        self._prompted = _prompted_types(body_type)
        self._packed_tokens = packed_tokens and bool(self._prompted)

    def decode(self, call: Call) -> T:
        """The typed body; `MalformedBody` (400) if it does not parse, `InvalidBody` (422) if it
        parses but does not fit the type."""
        if self._packed_tokens and not call.msgpack:
            request = self._with_packed_tokens(call.body)
            if request is not None:
                return request
        try:
            return (self._msgpack if call.msgpack else self._json).decode(call.body)
        except msgspec.ValidationError as exc:
            if call.msgpack and _looks_like_json(call.body):
                raise MalformedBody(_JSON_AS_MSGPACK) from None
            raise InvalidBody(_explained(str(exc), call.msgpack)) from None
        except UNDECODABLE as exc:
            if call.msgpack and _looks_like_json(call.body):
                raise MalformedBody(_JSON_AS_MSGPACK) from None
            kind = "msgpack" if call.msgpack else "JSON"
            raise MalformedBody(f"body is not valid {kind}: {exc}") from None

    def _with_packed_tokens(self, body: bytes) -> T | None:
        """The body with its JSON token array as packed u32, or None to decode it the ordinary way."""
        split = accel.split_json_tokens(body)
        if split is None:
            declined("api._native", "json_tokens")
            return None
        packed, start, end = split
        try:
            request = self._json.decode(body[:start] + b"[]" + body[end:])
        except UNDECODABLE:
            return None  # the ordinary decoder says what is wrong, in its own words and positions
        if not isinstance(request, self._prompted):
            return None  # a union member without a prompt: its own error
        typing.cast(_Prompted, request).tokens = packed
        return request
