"""How an online replay talks to mock workers over NATS (ours; engines proper are reached otherwise).

The replayer, acting as the gateway, sends each routed request to the worker the router chose on
``mocker.{ns}.generate.{worker_id}`` as a msgpack `GenerateRequest` naming a ``reply`` subject. The
worker answers on it with `GenerateUpdate`s: ``first_token`` when the first token is out, ``output``
each time the output opens a new KV block (``generated_tokens`` so far: what a gateway streaming the
tokens would tell the router), then ``done`` with the engine's own cache accounting (or ``rejected`` if
the prompt can never fit its pool).

A request on ``mocker.{ns}.reset.{worker_id}`` resets the worker's prefix cache (vLLM's
``reset_prefix_cache``); the reply is ``ok``, or ``busy`` while requests are in flight.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from router.event_plane.subjects import Subjects

__all__ = ["GenerateRequest", "GenerateUpdate", "UpdateKind", "generate_subject", "reply_prefix", "reset_subject"]

UpdateKind = Literal["first_token", "output", "done", "rejected"]


class GenerateRequest(msgspec.Struct, kw_only=True, frozen=True):
    request_id: str
    tokens: bytes  # packed little-endian u32
    max_tokens: int
    reply: str


class GenerateUpdate(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    request_id: str
    kind: UpdateKind
    cached_tokens: int = 0
    cached_blocks: int = 0
    prompt_blocks: int = 0
    queued: bool = False
    preemptions: int = 0
    generated_tokens: int = 0


def generate_subject(namespace: str, worker_id: int) -> str:
    Subjects(namespace)  # validates the namespace
    return f"mocker.{namespace}.generate.{worker_id}"


def reset_subject(namespace: str, worker_id: int) -> str:
    Subjects(namespace)
    return f"mocker.{namespace}.reset.{worker_id}"


def reply_prefix(namespace: str, client_id: str) -> str:
    return f"mocker.{namespace}.replies.{client_id}"
