"""The OpenAI HTTP API of a mock worker, served from its simulated engine (``mock-worker --http-port``).

``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (streamed as SSE or not; a
response's input rendered as a chat, its instructions the system message), ``/v1/embeddings`` and
``/v1/rerank`` (answered at once, not through the engine), ``/tokenize`` (vLLM's shape),
``/v1/models`` and ``/health``. A request is submitted to the worker's `MockEngine`; its
tokens come out when the passes that generate them end (the engine's timing model), and its usage
reports the cached tokens its block pool really had (``prompt_tokens_details.cached_tokens``).
A client that disconnects mid-stream aborts its request in the engine, as vLLM does. As vLLM's, a
completion's batch ``prompt`` (texts or token id lists) and ``n`` give one choice each, indexed prompt
by prompt (``prompt index * n + sample``), each its own engine request (so its own KV events); the
usage counts each prompt once. ``max_tokens`` and ``n`` below 1 are refused (400), as vLLM's
`SamplingParams` refuses them (vLLM takes ``max_tokens: 0`` only with ``echo``, which the mock has not),
and a chat asking both ``continue_final_message`` and ``add_generation_prompt`` (its default) is refused
(400) on ``/tokenize`` and ``/v1/chat/completions`` alike, as vLLM's request validation refuses it.

Disaggregated roles (`mocker.handoff`): a prefill leg (vLLM's ``kv_transfer_params``
``do_remote_decode``, or a prefill-role worker given a ``bootstrap_room``) computes the prompt and one
token and answers with the params a decode worker needs, or marks its bootstrap room done (served at
``GET /bootstrap/{room}``); a decode leg (``do_remote_prefill``, or ``bootstrap_*`` on a worker that
is not prefill-only) pulls the KV first, for the transfer time of the blocks it lacks.

Text is tokenized one token per UTF-8 byte; chat messages are rendered ``<|role|>\\ncontent\\n`` then
``<|assistant|>\\n``. The proxy gets the same ids from ``/tokenize``, or from the files `write_model_files`
writes (for ASCII text), so routing and the engine's cache agree. Generated tokens read `` w1 w2 ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from mocker.handoff import ROOM_POLL_SECS, BootstrapFailed, Rooms, await_room, remote_params, transfer_secs
from mocker.simulation import KvTransfer
from mocker.worker import MockWorker, TokenStream, WorkerStopped

__all__ = ["MockOpenAI", "render_chat", "serve_openai", "text_tokens", "write_model_files"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

DEFAULT_MAX_TOKENS = 16
# vLLM's defaults of VLLM_MAX_N_SEQUENCES and VLLM_MAX_COMPLETION_PROMPTS.
MAX_N = 16384
MAX_PROMPTS = 1024


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Body(msgspec.Struct):
    model: str | None = None
    prompt: str | list[str | int | list[int]] | None = None
    messages: list[_Message] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None  # the Responses API's
    input: str | list[Any] | None = None  # embeddings' texts or ids; the Responses API's input
    instructions: str | None = None  # the Responses API's system prompt
    query: str | None = None  # rerank's
    documents: list[str] | None = None
    # The hand-off (`mocker.handoff`): vLLM's connector params, SGLang's bootstrap.
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


_decode_body = msgspec.json.Decoder(_Body).decode
_encode = msgspec.json.Encoder().encode


def text_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# render_chat as a Hugging Face chat template, for `write_model_files`.
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def write_model_files(directory: Path) -> Path:
    """Writes the mock engine's tokenizer files into ``directory`` (made if needed), for the proxy's
    ``--tokenizer``: a ``tokenizer.json`` giving each ASCII character its code (the engine's ids for
    ASCII text) and a ``tokenizer_config.json`` whose chat template renders as `render_chat` does."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(1, 128)}, unk_token="\x01"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": _CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_bytes(msgspec.json.encode(config))
    return directory


def render_chat(messages: list[_Message]) -> str:
    parts = []
    for message in messages:
        content = _content_text(message.content)
        parts.append(f"<|{message.role}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


def _content_text(content: Any) -> Any:
    """A message's content as text: its parts' texts joined (`ValueError` for a part that is no object)."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(part, dict) for part in content):
        raise ValueError("content: a text, or a list of parts, each an object with its text")
    return "".join(str(part.get("text", "")) for part in content)


def responses_messages(instructions: str | None, given: str | list[Any]) -> list[_Message]:
    """The chat a Responses API request is: its instructions as the system message, then its input
    (a text: one user message; items: their role and text), as vLLM hands them to the template."""
    messages = [_Message(role="system", content=instructions)] if instructions else []
    if isinstance(given, str):
        return [*messages, _Message(role="user", content=given)]
    for item in given:
        if not isinstance(item, dict):
            raise ValueError(f"input: an item is an object with a role and content, got {item!r}")
        messages.append(_Message(role=item.get("role", "user"), content=_content_text(item.get("content"))))
    return messages


def _token_ids(values: list[Any]) -> list[int]:
    """A list of token ids as given, each an int in 0 .. 2^32 - 1 (`ValueError` naming what is not)."""
    for value in values:
        if type(value) is not int or not 0 <= value < 1 << 32:
            raise ValueError(f"prompt: token ids are ints in 0 .. 2^32 - 1, got {value!r}")
    return list(values)


def _prompt_ids(body: _Body) -> list[int]:
    if body.messages is not None:
        if body.continue_final_message and body.add_generation_prompt:  # vLLM's message
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return text_tokens(render_chat(body.messages))
    if body.query is not None:
        return text_tokens(body.query + "\n" + "\n".join(body.documents or []))
    if body.input is not None and body.model is not None and body.prompt is None:
        body.prompt = body.input  # embeddings: as a completion's prompt
    prompt = body.prompt
    if prompt is None:
        raise ValueError("prompt or messages is required")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if not prompt:
        raise ValueError("prompt is empty")
    first = prompt[0]
    if isinstance(first, int):
        return _token_ids(prompt)
    if isinstance(first, str):
        return text_tokens(first)
    return _token_ids(first)


def _batch(body: _Body, first: list[int]) -> list[list[int]]:
    """A completion's prompts: a list of texts or of token id lists is a batch, one prompt each (as
    vLLM takes it, at most `MAX_PROMPTS`); anything else is the one prompt ``first``."""
    prompt = body.prompt
    if not isinstance(prompt, list) or isinstance(prompt[0], int):
        return [first]
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_PROMPTS}.")
    prompts = []
    for item in prompt:
        if isinstance(item, int) or isinstance(item, str) != isinstance(prompt[0], str):
            raise ValueError("prompt: a text, a list of token ids, or a list of texts or of token id lists")
        prompts.append(text_tokens(item) if isinstance(item, str) else _token_ids(item))
    return prompts


def _sampling(body: _Body) -> tuple[int, int]:
    """``(n, max_tokens)``, checked as vLLM's `SamplingParams` checks them: both at least 1 (a
    ``max_tokens`` of 0 too: vLLM takes it only with ``echo``, which the mock has not). The chat's
    ``max_completion_tokens`` wins over ``max_tokens``; neither given: `DEFAULT_MAX_TOKENS`."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {n}.")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        return n, DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    return n, max_tokens


def _word(index: int) -> str:
    return f" w{index}"


class MockOpenAI:
    """The ASGI app of one mock worker's HTTP API."""

    def __init__(
        self,
        worker: MockWorker,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transfer: KvTransfer | None = None,
    ) -> None:
        self.worker = worker
        self.model = model
        self.host = host
        self.port = port
        self.transfer = transfer or KvTransfer()
        self.rooms = Rooms()
        self.aborted = 0  # requests whose client left before their end
        self.tokenized = 0  # /tokenize calls answered (refusals too)
        self.generated = 0  # completions, chat completions and responses received
        self.pooled = 0  # embeddings and rerank requests answered
        self.last_headers: dict[bytes, bytes] = {}  # of the last POST
        self.prefill_legs = 0  # prefill legs answered (either hand-off style)
        self.pulled_blocks = 0  # KV blocks received from prefill workers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/v1/models":
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "kv-router-mocker"}
            await _reply(send, 200, _encode({"object": "list", "data": [card]}))
        elif method == "GET" and path == "/health":
            await _reply(send, 200, b"{}")
        elif method == "GET" and path.startswith("/bootstrap/") and path[11:].isdigit():
            ended, blocks = await self.rooms.wait(int(path[11:]), ROOM_POLL_SECS)
            if not ended:
                await _reply(send, 202, b'{"status": "pending"}')
            elif blocks is None:
                await _reply(send, 410, _error(410, "the room's prefill failed"))
            else:
                await _reply(send, 200, _encode({"blocks": blocks}))
        elif method == "POST" and path in _POSTS:
            self.last_headers = dict(scope["headers"])
            body = await _read(receive)
            self.tokenized += path == "/tokenize"
            try:
                request = _decode_body(body)
                if path == "/v1/responses":
                    request.messages = responses_messages(request.instructions, request.input or "")
                    request.max_tokens = request.max_output_tokens
                    request.n = None  # the Responses API has one output
                tokens = _prompt_ids(request)
                prompts = _batch(request, tokens) if path == "/v1/completions" else [tokens]
                n, max_tokens = _sampling(request) if path in _KINDS else (1, DEFAULT_MAX_TOKENS)
            except (msgspec.DecodeError, ValueError) as exc:
                await _reply(send, 400, _error(400, str(exc)))
                return
            if path == "/tokenize":
                await _reply(send, 200, _encode({"tokens": tokens, "count": len(tokens)}))
            elif path in ("/v1/embeddings", "/v1/rerank"):
                self.pooled += 1
                await _reply(send, 200, self._pooled(path, request, tokens))
            else:
                await self._generate(_KINDS[path], request, prompts, n, max_tokens, receive, send)
        else:
            await _reply(send, 404, _error(404, f"{method} {path}: not found"))

    def _pooled(self, path: str, request: _Body, tokens: list[int]) -> bytes:
        """An embedding (its prompt's length and the worker's id) or a ranking (documents in order)."""
        usage = {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
        if path == "/v1/embeddings":
            vector = [float(len(tokens)), float(self.worker.worker_id)]
            data = [{"object": "embedding", "index": 0, "embedding": vector}]
            return _encode({"object": "list", "data": data, "model": self.model, "usage": usage})
        results = [
            {"index": index, "relevance_score": 1.0 / (1 + index), "document": {"text": text}}
            for index, text in enumerate(request.documents or [])
        ]
        return _encode({"id": "rerank-" + uuid.uuid4().hex, "model": self.model, "results": results, "usage": usage})

    async def _generate(
        self,
        kind: str,
        request: _Body,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        receive: Receive,
        send: Send,
    ) -> None:
        self.generated += 1
        if not all(prompts):
            await _reply(send, 400, _error(400, "the prompt has no tokens"))
            return
        params = request.kv_transfer_params or {}
        room = request.bootstrap_room
        # A prefill leg computes the prompt and one token; a decode leg first pulls the prompt's KV.
        prefill_leg = params.get("do_remote_decode") is True or (room is not None and self.worker.role == "prefill")
        decode_leg = params.get("do_remote_prefill") is True or (room is not None and not prefill_leg)
        if (prefill_leg or decode_leg) and (len(prompts) > 1 or n > 1):
            await _reply(send, 400, _error(400, "a disaggregated request takes one prompt and n = 1"))
            return
        if prefill_leg:
            max_tokens = 1
        tokens = prompts[0]
        request_id = uuid.uuid4().hex
        left = asyncio.ensure_future(_disconnected(receive))
        choices: list[_Choice] = []
        try:
            if decode_leg:
                pulled = asyncio.ensure_future(self._pull(request, tokens))
                await asyncio.wait((pulled, left), return_when=asyncio.FIRST_COMPLETED)
                if left.done():
                    pulled.cancel()
                    self.aborted += 1
                    return
                try:
                    pulled.result()
                except (BootstrapFailed, ValueError) as exc:
                    status = 503 if isinstance(exc, BootstrapFailed) else 400
                    await _reply(send, status, _error(status, str(exc)))
                    return
            # One engine request per prompt and per sample, each choice indexed as vLLM indexes it:
            # prompt by prompt, its n samples in turn.
            for prompt_index, prompt in enumerate(prompts):
                for sample in range(n):
                    index = prompt_index * n + sample
                    choice_id = request_id if index == 0 else f"{request_id}-{index}"
                    try:
                        stream = self.worker.open_stream(choice_id, prompt, max_tokens, kv_loaded=decode_leg)
                    except WorkerStopped as exc:
                        await _reply(send, 503, _error(503, str(exc)))
                        return
                    if stream is None:
                        refusal = f"prompt of {len(prompt)} tokens and max_tokens {max_tokens} do not fit the KV pool"
                        await _reply(send, 400, _error(400, refusal))
                        return
                    choices.append(_Choice(index, choice_id, stream, len(prompt), sample == 0))
            chunks = _Chunks(kind, request_id, self.model)
            if request.stream:
                include_usage = request.stream_options is not None and request.stream_options.include_usage
                await self._stream(choices, chunks, include_usage, left, send)
            else:
                for choice in choices:
                    await _wait_done(choice.stream, left, self.worker)
                if self.worker.stopped and not all(choice.stream.done for choice in choices):
                    await _reply(send, 503, _error(503, f"mock worker {self.worker.worker_id} stopped"))
                elif not left.done():
                    extra = None
                    if params.get("do_remote_decode") is True:
                        blocks = -(-len(tokens) // self.worker.engine.block_size)
                        extra = {
                            "kv_transfer_params": remote_params(self.worker.worker_id, self.host, self.port, blocks)
                        }
                    await _reply(send, 200, chunks.whole(choices, extra))
            if prefill_leg and choices[0].stream.done:
                self.prefill_legs += 1
        finally:
            if left.done() and any(not choice.stream.done for choice in choices):
                self.aborted += 1
            if room is not None and prefill_leg:  # its decode worker learns how the prefill ended
                ok = bool(choices) and choices[0].stream.done
                self.rooms.done(room, -(-len(tokens) // self.worker.engine.block_size) if ok else None)
            left.cancel()
            for choice in choices:
                self.worker.close_stream(choice.request_id)

    async def _pull(self, request: _Body, tokens: list[int]) -> None:
        """A decode leg's KV: the blocks the prefill worker has (from its params, or its bootstrap
        room once prefilled), less those this worker holds, over the transfer's bandwidth. Raises
        `BootstrapFailed`, or ValueError for params that name no blocks."""
        if request.bootstrap_room is not None:
            if request.bootstrap_host is None or request.bootstrap_port is None:
                raise ValueError("bootstrap_room needs bootstrap_host and bootstrap_port")
            blocks = await await_room(request.bootstrap_host, request.bootstrap_port, request.bootstrap_room)
        else:
            block_ids = (request.kv_transfer_params or {}).get("remote_block_ids")
            if not isinstance(block_ids, list):
                raise ValueError("kv_transfer_params.remote_block_ids must be the list of the prefilled blocks")
            blocks = len(block_ids)
        engine = self.worker.engine
        # No more than the prompt's blocks come over, whatever the params claim (a million: 84 s asleep).
        blocks = min(blocks, -(-len(tokens) // engine.block_size))
        missing = max(blocks - engine.cached_prefix_blocks(tokens), 0)
        await asyncio.sleep(transfer_secs(self.transfer, missing, engine.block_size, engine.config.speedup_ratio))
        self.pulled_blocks += missing

    async def _stream(
        self,
        choices: list[_Choice],
        chunks: _Chunks,
        include_usage: bool,
        left: asyncio.Future[None],
        send: Send,
    ) -> None:
        started = False
        pending = choices
        while pending:
            await _wait_change([choice.stream for choice in pending], left)
            if left.done():
                return
            if self.worker.stopped and not all(choice.stream.done for choice in pending):  # no token will come
                # Cut short as a stopping engine cuts its streams: the client sees them end in an error (a
                # stream its last pass completed, as the worker stopped, is whole: it goes out).
                message = f"mock worker {self.worker.worker_id} stopped"
                if not started:
                    await _reply(send, 503, _error(503, message))
                    return
                error = b"data: " + _error(503, message) + b"\n\n"
                await send({"type": "http.response.body", "body": error})
                return
            pieces = []
            for choice in pending:
                stream = choice.stream
                count = stream.tokens
                pieces += [chunks.token(choice.index, index, index == count and stream.done) for index in
                           range(choice.sent + 1, count + 1)]  # fmt: skip
                choice.sent = max(choice.sent, count)
            pending = [choice for choice in pending if not choice.stream.done]
            if pieces or not pending:
                events = b"".join(pieces)
                if not started:
                    started = True
                    events = chunks.start() + events
                    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": events, "more_body": True})
        await send({"type": "http.response.body", "body": chunks.end(choices, include_usage)})


class _Choice:
    """One choice of an answer: its engine request (one per prompt and per sample) and what of it was sent."""

    __slots__ = ("first", "index", "prompt_tokens", "request_id", "sent", "stream")

    def __init__(self, index: int, request_id: str, stream: TokenStream, prompt_tokens: int, first: bool) -> None:
        self.index = index
        self.request_id = request_id
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.first = first  # its prompt's first sample: the prompt counts once in the usage
        self.sent = 0  # tokens streamed


class _Chunks:
    """The bytes of one request's answers (``kind``: completion, chat or responses); token texts are
    plain ASCII, so templates need no escaping."""

    def __init__(self, kind: str, request_id: str, model: str) -> None:
        chat = kind == "chat"
        self.chat = chat
        self.responses = kind == "responses"
        self.created = int(time.time())
        self.id = {"chat": "chatcmpl-", "responses": "resp_"}.get(kind, "cmpl-") + request_id
        self.model = model
        object_ = "chat.completion.chunk" if chat else "text_completion"
        fields = f'"id":"{self.id}","object":"{object_}","created":{self.created},"model":{_encode(model).decode()},'
        self._head = b"data: {" + fields.encode()

    def start(self) -> bytes:
        """What a stream opens with before its first token (the Responses API's response.created)."""
        if not self.responses:
            return b""
        created = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                   "status": "in_progress", "output": []}  # fmt: skip
        return _event("response.created", {"type": "response.created", "response": created, "sequence_number": 0})

    def end(self, choices: list[_Choice], include_usage: bool) -> bytes:
        """What a stream ends with: the usage (if asked for) and [DONE]; the Responses API's
        response.completed, carrying the whole response (its one choice)."""
        if self.responses:
            whole = msgspec.json.decode(self.whole(choices))
            completed = {
                "type": "response.completed",
                "response": whole,
                "sequence_number": choices[0].stream.tokens + 1,
            }
            return _event("response.completed", completed)
        return (self.usage(choices) if include_usage else b"") + b"data: [DONE]\n\n"

    def token(self, choice: int, index: int, last: bool) -> bytes:
        """The chunk of token ``index`` (from 1) of choice ``choice``."""
        if self.responses:
            delta = {"type": "response.output_text.delta", "item_id": "msg_" + self.id, "output_index": 0,
                     "content_index": 0, "delta": _word(index), "sequence_number": index}  # fmt: skip
            return _event("response.output_text.delta", delta)
        finish = b'"length"' if last else b"null"
        text = _word(index).encode()
        head = b'{"index":' + str(choice).encode()
        if self.chat:
            role = b'"role":"assistant",' if index == 1 else b""
            choice_bytes = head + b',"delta":{' + role + b'"content":"' + text + b'"},"finish_reason":' + finish + b"}"
        else:
            choice_bytes = head + b',"text":"' + text + b'","logprobs":null,"finish_reason":' + finish + b"}"
        return self._head + b'"choices":[' + choice_bytes + b"]}\n\n"

    def _usage(self, choices: list[_Choice]) -> dict[str, Any]:
        """As vLLM sums a batch's: each prompt once, every choice's tokens; the cached tokens of each
        prompt's first request."""
        prompt = sum(choice.prompt_tokens for choice in choices if choice.first)
        completion = sum(choice.stream.tokens for choice in choices)
        cached = sum(max(choice.stream.seq.cached_tokens, 0) for choice in choices if choice.first)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage(self, choices: list[_Choice]) -> bytes:
        return self._head + b'"choices":[],"usage":' + _encode(self._usage(choices)) + b"}\n\n"

    def whole(self, choices: list[_Choice], extra: dict[str, Any] | None = None) -> bytes:
        usage = self._usage(choices)
        if self.responses:
            text = _text(choices[0].stream)
            content = [{"type": "output_text", "text": text, "annotations": []}]
            message = {"type": "message", "id": "msg_" + self.id, "status": "completed", "role": "assistant",
                       "content": content}  # fmt: skip
            return _encode(
                {
                    "id": self.id,
                    "object": "response",
                    "created_at": self.created,
                    "model": self.model,
                    "status": "completed",
                    "output": [message],
                    "usage": {
                        "input_tokens": usage["prompt_tokens"],
                        "input_tokens_details": usage["prompt_tokens_details"],
                        "output_tokens": usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": usage["total_tokens"],
                    },
                }
            )
        answers: list[dict[str, Any]] = []
        for choice in choices:
            text = _text(choice.stream)
            if self.chat:
                answer: dict[str, Any] = {"index": choice.index, "message": {"role": "assistant", "content": text}}
            else:
                answer = {"index": choice.index, "text": text, "logprobs": None}
            answer["finish_reason"] = "length"
            answers.append(answer)
        return _encode(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": answers,
                "usage": usage,
                **(extra or {}),
            }
        )


def _text(stream: TokenStream) -> str:
    return "".join(_word(index) for index in range(1, stream.tokens + 1))


_POSTS = ("/tokenize", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/rerank")
_KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


def _event(name: str, data: dict[str, Any]) -> bytes:
    """One named SSE event (the Responses API's shape)."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


async def _wait_change(streams: list[TokenStream], left: asyncio.Future[None]) -> None:
    """Until one of ``streams`` changed (or the client left); their changes are then taken."""
    if not any(stream.changed.is_set() for stream in streams):
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stream.changed.wait()) for stream in streams]
        await asyncio.wait((*waiters, left), return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
    for stream in streams:
        stream.changed.clear()


async def _wait_done(stream: TokenStream, left: asyncio.Future[None], worker: MockWorker) -> None:
    while not stream.done and not worker.stopped and not left.done():
        await _wait_change([stream], left)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _error(status: int, message: str) -> bytes:
    return _encode({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}})


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are the worker's: it stops the server with itself


@contextlib.asynccontextmanager
async def serve_openai(
    worker: MockWorker,
    model: str,
    host: str,
    port: int,
    *,
    startup_timeout_s: float = 10.0,
    transfer: KvTransfer | None = None,
    sock: socket.socket | None = None,
) -> AsyncIterator[MockOpenAI]:
    """Serve the worker's OpenAI API on ``host:port`` on this loop for the duration of the block
    (``transfer``: what a decode leg's KV pull costs, `mocker.handoff`; ``sock``: that address bound
    beforehand, `api.listen.listening_socket`, so that a port in use was told before anything started)."""
    api = MockOpenAI(worker, model, host=host, port=port, transfer=transfer)
    config = uvicorn.Config(
        api, host=host, port=port, loop="none", http="httptools", ws="none", lifespan="off", log_level="warning",
        access_log=False, server_header=False, date_header=False,
    )  # fmt: skip
    server = _Server(config)
    serving = asyncio.create_task(
        server.serve(sockets=None if sock is None else [sock]), name=f"mock-worker-{worker.worker_id}-http"
    )
    try:
        async with asyncio.timeout(startup_timeout_s):
            while not server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError("the mock worker's HTTP server stopped while starting")
                await asyncio.sleep(0.01)
        yield api
    finally:
        server.should_exit = True
        await serving
