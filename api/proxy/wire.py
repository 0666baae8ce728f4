"""The OpenAI bodies the proxy reads, and the ones it writes itself.

The proxy forwards a request's body to the worker byte for byte; it decodes only what routing needs
(model, prompt or messages, stream, Dynamo's ``nvext``: its routing hints, decoded by the same
struct as ``/v1/route``'s, `api.wire.NvExt`, and vLLM's ``cache_salt``: the prompt is hashed in that
cache namespace, as the engine salts its blocks) and checks it, so a malformed body is refused before
anything is booked. Unknown fields are the
engine's business and pass through. Errors are OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, which carries the service's ``type`` and ``message`` too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from api.wire import NvExt, NvExtResponse
from indexer.errors import UNDECODABLE
from indexer.events import U32, U32_MAX
from router.types import RouteDecision

__all__ = [
    "ROUTES",
    "ChatBody",
    "CompletionBody",
    "EmbeddingsBody",
    "ErrorReply",
    "InstanceQueryReply",
    "ModelCard",
    "ModelList",
    "OpenAIError",
    "RerankBody",
    "ResponsesBody",
    "TokenIdsBody",
    "TokenizeReply",
    "Usage",
    "after_last_event",
    "error_body",
    "finished_stream",
    "prompt_token_ids",
    "reported_usage",
]

# The proxy's POST routes, path -> route label (answered by `api.proxy.service.Proxy`; without
# ``--proxy``, by `api.routes.add_proxy_off_routes`).
ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/responses": "responses",
}


class _Body(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    nvext: NvExt | None = None
    # vLLM's per-request cache salt: the engine hashes the prompt's blocks apart from other salts'.
    cache_salt: str | None = None

    @property
    def cache_namespace(self) -> str | None:
        """The cache namespace the prompt is hashed in (None: the shared one); the one place a body's
        salt is read, whatever field carries it."""
        return self.cache_salt or None


class CompletionBody(_Body, kw_only=True):
    """``POST /v1/completions``: a prompt as text, token ids, or a batch of either."""

    prompt: str | list[str | int | list[int]]
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (a BOS)


class TokenIdsBody(_Body, kw_only=True):
    """The common case of `CompletionBody`, decoded and range-checked by msgspec alone: token ids."""

    prompt: list[U32]


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat message's fields that the chat template sees (vLLM's choice); the others are dropped."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class ChatBody(_Body, kw_only=True):
    """``POST /v1/chat/completions``: what its prompt is rendered from (vLLM's fields and defaults)."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def tokenize_body(self) -> dict[str, Any]:
        """The same chat for a worker's ``/tokenize`` (vLLM's shape)."""
        fields = ("messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                  "chat_template", "chat_template_kwargs")  # fmt: skip
        given = {name: getattr(self, name) for name in fields}
        return {"model": self.model, **{name: value for name, value in given.items() if value is not None}}


class EmbeddingsBody(_Body, kw_only=True):
    """``POST /v1/embeddings``: routed as a completion of its input (by the first of a batch, booked with
    them all), by load."""

    input: str | list[str | int | list[int]]
    add_special_tokens: bool = True

    def as_completion(self) -> CompletionBody:
        return CompletionBody(
            model=self.model, prompt=self.input, nvext=self.nvext, cache_salt=self.cache_salt,
            add_special_tokens=self.add_special_tokens,
        )  # fmt: skip


class RerankBody(_Body, kw_only=True):
    """``POST /v1/rerank`` (vLLM's, Cohere's and Jina's shape): routed by load, as a prompt of its query
    and documents (their text: what the engine prefills)."""

    query: str
    documents: list[str | dict[str, Any]]

    def as_completion(self) -> CompletionBody:
        if not self.documents:
            raise ValueError("documents is empty")
        texts = [doc if isinstance(doc, str) else str(doc.get("text", "")) for doc in self.documents]
        prompt = "\n".join([self.query, *texts])
        return CompletionBody(model=self.model, prompt=prompt, nvext=self.nvext, cache_salt=self.cache_salt)


class ResponsesBody(_Body, kw_only=True):
    """``POST /v1/responses``: routed by its prompt rendered as a chat, as vLLM renders it: the
    ``instructions`` as the system message, then the ``input`` (a text: one user message; message
    items: their role and content, text parts joined)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None

    def as_chat(self) -> ChatBody:
        """Raises ``ValueError`` naming a message item's field of the wrong type (the engine refuses it;
        a struct built here is not checked, and the chat template would get it as it is)."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            for index, item in enumerate(self.input):
                if item.get("type", "message") != "message":
                    continue  # tool calls and their outputs: not part of the rendered prefix here
                role, content = item.get("role", "user"), item.get("content")
                if not isinstance(role, str):
                    raise ValueError(f"input[{index}].role must be a string")
                if isinstance(content, list):
                    content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
                elif content is not None and not isinstance(content, str):
                    raise ValueError(f"input[{index}].content must be a string or a list of content parts")
                messages.append(ChatMessage(role=role, content=content))
        # The Responses API's function tools are flat; a chat template reads Chat Completions' shape.
        tools = [
            {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            for tool in self.tools or []
            if tool.get("type") == "function"
        ] or None
        return ChatBody(
            model=self.model, messages=messages, tools=tools, stream=self.stream, nvext=self.nvext,
            cache_salt=self.cache_salt,
        )  # fmt: skip


class OpenAIError(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorReply(msgspec.Struct):
    """OpenAI's error reply."""

    error: OpenAIError


_encode = msgspec.json.Encoder().encode


def error_body(status: int, kind: str, message: str, param: str | None = None) -> bytes:
    return _encode(ErrorReply(OpenAIError(message=message, type=kind, param=param, code=status)))


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "kv-router"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class TokenizeReply(msgspec.Struct):
    """A worker's ``/tokenize`` answer (vLLM's shape; only the ids are read, range-checked)."""

    tokens: list[U32]


def batch_rest(prompt: str | list[str | int | list[int]]) -> tuple[int, int]:
    """A batch's prompts after the first, which it is not routed by but which load the worker as much:
    (the token ids of the rows of ids, the UTF-8 bytes of the texts). (0, 0) for one prompt. Read
    after `prompt_token_ids` took the prompt (the shapes are checked there)."""
    if isinstance(prompt, str) or len(prompt) < 2 or isinstance(prompt[0], int):
        return 0, 0
    if isinstance(prompt[0], str):
        return 0, sum(len(text.encode()) for text in prompt[1:] if isinstance(text, str))
    return sum(len(row) for row in prompt[1:] if isinstance(row, list)), 0


def prompt_token_ids(prompt: str | list[str | int | list[int]]) -> list[int] | str:
    """The ids of the prompt the request is routed by, or its text to tokenize.

    A batch is routed as one request, by its first prompt (its others weigh in its load: `batch_rest`).
    Raises ``ValueError`` with what is wrong.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt
    if not prompt:
        raise ValueError("prompt is empty")
    first = prompt[0]
    if isinstance(first, int):
        if not all(type(token) is int for token in prompt):
            raise ValueError("prompt mixes token ids with other values")
        ids: list[int] = prompt  # type: ignore[assignment]
    elif isinstance(first, str):
        if not all(isinstance(text, str) for text in prompt):
            raise ValueError("prompt mixes texts with other values")
        return prompt_token_ids(first)
    else:
        if not all(isinstance(row, list) for row in prompt):
            raise ValueError("prompt mixes lists of token ids with other values")
        ids = first
        if not ids:
            raise ValueError("prompt is empty")
    if min(ids) < 0 or max(ids) > U32_MAX:
        raise ValueError("token ids must be in 0 .. 2^32 - 1")
    return ids


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """An answer's ``usage``: the tokens of its prompt and those the engine had cached, the tokens it
    generated (Chat Completions' names, or the Responses API's ``input_tokens``, ``output_tokens`` and
    ``input_tokens_details``)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _Details | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens is None:
            self.prompt_tokens = self.input_tokens
        if self.completion_tokens is None:
            self.completion_tokens = self.output_tokens

    @property
    def cached_tokens(self) -> int | None:
        details = self.prompt_tokens_details or self.input_tokens_details
        return details.cached_tokens if details is not None else None


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def reported_usage(body: bytes) -> Usage | None:
    """The ``usage`` of a response or chunk, if the engine reported one."""
    if b'"usage"' not in body:
        return None
    try:
        return _decode_usage(body).usage
    except UNDECODABLE:
        return None


# ---------------------------------------------------------------- Dynamo's query_instance_id answer
class QueryUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class InstanceQueryReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A completion, chat completion or one streamed chunk of either, with no text: the answer to
    ``query_instance_id``, whose content is ``nvext``. ``usage`` only in a whole answer."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: QueryUsage | None = None
    nvext: NvExtResponse


# The Responses API's last events (it sends no [DONE]).
_RESPONSE_ENDS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")


def finished_stream(events: bytes) -> bool:
    """Whether ``events`` end an OpenAI stream: its last event ``data: [DONE]``, or the Responses
    API's ``response.completed`` (``incomplete``, ``failed``); events framed with LF or CRLF."""
    tail = events.rstrip()
    if tail.endswith(b"data: [DONE]"):
        return True
    return tail[after_last_event(tail) :].lstrip().startswith(_RESPONSE_ENDS)


def after_last_event(data: bytes) -> int:
    """Where what follows the last whole SSE event of ``data`` starts: after its last blank line,
    ``\n\n`` or ``\r\n\r\n`` (0 when it holds none)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def receipt_headers(decision: RouteDecision) -> list[tuple[bytes, bytes]]:
    """The decision as the client's answer tells it: its worker, rank and predicted cached tokens, and on a
    disaggregated fleet the path taken and the prefill worker of a remote prefill. A new list each time:
    the answer adds its own headers to it."""
    headers = [
        (b"x-kv-router-worker", str(decision.worker_id).encode()),
        (b"x-kv-router-dp-rank", str(decision.dp_rank).encode()),
        (b"x-kv-router-cached-tokens", str(decision.cached_tokens).encode()),
    ]
    disaggregation = decision.disaggregation
    if disaggregation is not None:
        headers.append((b"x-kv-router-disaggregation", disaggregation.path.encode()))
        if disaggregation.prefill is not None:
            headers.append((b"x-kv-router-prefill-worker", str(disaggregation.prefill.worker_id).encode()))
    return headers
