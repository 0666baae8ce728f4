"""Dynamo's ``query_instance_id`` on the proxy: the routing decision instead of the completion.

A request whose ``nvext.annotations`` ask for it (`api.wire.queries_instance`: Dynamo 1.6's
``query_instance_id:<phase>``, which its Gateway API endpoint picker sends with an empty phase, or
the bare ``query_instance_id`` of earlier releases) is routed like any other and then neither booked
nor sent to a worker. The answer is what Dynamo 1.6's frontend gives then: the route's usual
response object (a whole one, or when streaming one chunk and ``data: [DONE]``) with no text and a
response ``nvext`` holding

- ``worker_id``: Dynamo's `WorkerIdInfo`. On an aggregated fleet one worker runs both phases and
  is named for both, as Dynamo records an aggregated request; on a disaggregated fleet the prefill
  leg and the decode worker; when the decode worker prefills the prompt itself (no prefill leg),
  only the decode fields, so that the gateway's second call pins no prefill worker.
- ``token_ids``: the prompt's token ids, which the gateway hands back as ``nvext.token_data``.
"""

from __future__ import annotations

import time

import msgspec

from api.proxy.wire import InstanceQueryReply, QueryUsage
from api.wire import NvExtResponse, WorkerIdInfo
from indexer.hashing import unpack_tokens
from router.types import RouteDecision

__all__ = ["instance_reply"]

_encode = msgspec.json.Encoder().encode
_EVENT_STREAM = b"text/event-stream"
_JSON = b"application/json"


def instance_reply(
    route: str, model: str, packed: bytes, decision: RouteDecision, request_id: str, stream: bool
) -> tuple[bytes, bytes]:
    """The content type and body answering a ``query_instance_id`` request on ``route``
    (``completions`` or ``chat_completions``) whose prompt is ``packed`` (little-endian u32)."""
    tokens = unpack_tokens(packed)
    chat = route == "chat_completions"
    if stream:
        choice = {"index": 0, "delta": {"role": "assistant"}} if chat else {"index": 0, "text": ""}
        kind = "chat.completion.chunk" if chat else "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": ""}} if chat else {"index": 0, "text": ""}
        kind = "chat.completion" if chat else "text_completion"
    reply = InstanceQueryReply(
        id=("chatcmpl-" if chat else "cmpl-") + request_id,
        object=kind,
        created=int(time.time()),
        model=model,
        choices=[{**choice, "logprobs": None, "finish_reason": None}],
        usage=None if stream else QueryUsage(prompt_tokens=len(tokens), total_tokens=len(tokens)),
        nvext=NvExtResponse(worker_id=WorkerIdInfo.of(decision), token_ids=tokens),
    )
    if stream:
        return _EVENT_STREAM, b"data: " + _encode(reply) + b"\n\ndata: [DONE]\n\n"
    return _JSON, _encode(reply)
