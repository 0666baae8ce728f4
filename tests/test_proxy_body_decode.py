"""A completion's body is decoded once (`api.proxy.service._completion_decoder`), with the same answer,
error messages included, as decoding it for token ids first and then, failing that, generally; with the C
accelerator a prompt of token ids comes out packed, with the same ids."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.native import ENABLED as NATIVE
from api.proxy.service import PackedIds, _completion_decoder
from api.proxy.wire import CompletionBody, TokenIdsBody, prompt_token_ids
from indexer.errors import UNDECODABLE

_ids = msgspec.json.Decoder(TokenIdsBody).decode
_general = msgspec.json.Decoder(CompletionBody).decode


def twice(body: bytes) -> TokenIdsBody | CompletionBody:
    """The decoding this replaced: token ids first, the general decoder after any validation error."""
    try:
        return _ids(body)
    except msgspec.ValidationError:
        return _general(body)


def outcome(decode: object, body: bytes) -> tuple[str, object]:
    """What the proxy makes of a body: the prompt's ids or text and the other fields, or the error."""
    assert callable(decode)
    try:
        request = decode(body)
        if isinstance(request, PackedIds):  # the ids the C parser cut out, the body decoded without them
            assert request.body.prompt == []
            request, prompt = request.body, list(struct.unpack(f"<{len(request.packed) // 4}I", request.packed))
        else:
            prompt = request.prompt if isinstance(request, TokenIdsBody) else prompt_token_ids(request.prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        return "ok", (request.model, list(prompt) if isinstance(prompt, list) else prompt, request.stream,
                      request.cache_salt, request.nvext, getattr(request, "add_special_tokens", True))  # fmt: skip
    except (*UNDECODABLE, ValueError) as exc:
        return type(exc).__name__, str(exc)


_space = st.sampled_from([b"", b" ", b"\n", b" \t\r\n "])
_token = st.one_of(st.integers(0, 2**32 - 1), st.integers(-5, -1), st.integers(2**32, 2**33))
_prompt = st.one_of(
    st.text(max_size=20).map(lambda text: msgspec.json.encode(text)),
    st.lists(_token, max_size=6).map(msgspec.json.encode),
    st.lists(st.lists(_token, max_size=3), max_size=3).map(msgspec.json.encode),
    st.lists(st.one_of(_token, st.text(max_size=3), st.booleans(), st.none()), max_size=4).map(msgspec.json.encode),
    st.sampled_from([b"null", b"5", b'{"a": 1}', b"[1.5]", b'["prompt", 1]', b"[ 1 , 2 ]", b"[\n3]"]),
)
_other = st.sampled_from([
    b'"stream": true', b'"stream": "yes"', b'"cache_salt": "s"', b'"max_tokens": 8', b'"model": 5',
    b'"add_special_tokens": false', b'"nvext": {"prompt": [1]}', b'"note": "\\"prompt\\": [1"',
    b'"nvext": {"annotations": 3}', b'"stream": tru', b'"x": [1,]', b'"cache_salt": s',
])  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    fields = [b'"model"' + draw(_space) + b":" + draw(_space) + b'"m"']
    if draw(st.booleans()):
        fields.append(b'"prompt"' + draw(_space) + b":" + draw(_space) + draw(_prompt))
    fields += draw(st.lists(_other, max_size=3))
    order = draw(st.permutations(fields))
    separator = b",," if draw(st.integers(0, 9)) == 0 else b", "  # now and then malformed
    body = b"{" + separator.join(order) + b"}"
    cut = draw(st.one_of(st.none(), st.integers(0, len(body))))
    return body if cut is None else body[:cut]


@settings(max_examples=3000, deadline=None)
@given(bodies())
def test_one_decode_answers_as_the_two_did(body: bytes) -> None:
    assert outcome(_completion_decoder(), body) == outcome(twice, body)


@settings(max_examples=1000, deadline=None)
@given(bodies())
def test_without_the_accelerator_too(body: bytes) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("api.proxy.service.NATIVE", False)
        assert outcome(_completion_decoder(), body) == outcome(twice, body)


def _ids_body(model: str, ids: list[int]) -> PackedIds | TokenIdsBody:
    if NATIVE:
        return PackedIds(TokenIdsBody(model=model, prompt=[]), struct.pack(f"<{len(ids)}I", *ids))
    return TokenIdsBody(model=model, prompt=ids)


def test_each_prompt_shape_is_decoded_once() -> None:
    decode = _completion_decoder()
    assert decode(b'{"model": "m", "prompt": [1, 2]}') == _ids_body("m", [1, 2])
    assert decode(b'{"model": "m", "prompt" :\n[ 7]}') == _ids_body("m", [7])
    assert decode(b'{"model": "m", "prompt": [4294967295, 0]}') == _ids_body("m", [4294967295, 0])
    # What the C parser declines, msgspec decodes: a repeated key (the last wins), an exponent (its error).
    assert decode(b'{"model": "m", "prompt": [1], "prompt": [2]}') == TokenIdsBody(model="m", prompt=[2])
    with pytest.raises(msgspec.ValidationError, match=r"got `float` - at `\$.prompt\[0\]`"):
        decode(b'{"model": "m", "prompt": [1e0]}')
    assert decode(b'{"model": "m", "prompt": "hi"}') == CompletionBody(model="m", prompt="hi")
    assert decode(b'{"model": "m", "prompt": [[1], [2]]}') == CompletionBody(model="m", prompt=[[1], [2]])
    assert decode(b'{"model": "m", "prompt": ["a", "b"]}') == CompletionBody(model="m", prompt=["a", "b"])
