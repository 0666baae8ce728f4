"""Dynamo's routing hints (a `PreprocessedRequest`'s ``routing``, ``mm_routing_info`` and
``router_config_override``, or the OpenAI proxy's ``nvext``) turned into one `KvRouter.decide` call.

Every hint is checked against the registered workers before the router is called, so a refused
request changes nothing, and every refusal names its field:

- ``backend_instance_id`` with ``dp_rank`` pins the request to that rank, booked like any other;
  without ``dp_rank`` it needs a worker with one rank (Dynamo 1.6.1 refuses to guess among several,
  and so does this: 422); an unregistered worker or rank is a 404 ``unknown_worker``; ``dp_rank``
  without ``backend_instance_id`` is ignored (reported unused), as Dynamo 1.6.1 ignores it;
- ``allowed_worker_ids`` limits the candidates (ids the router does not know are left out, as
  Dynamo scores only discovered workers); a pinned worker outside it is a 422;
- ``prefill_worker_id`` / ``prefill_dp_rank`` / ``decode_worker_id`` are checked like a pin. On a
  disaggregated fleet (a worker registered with role ``prefill`` or ``decode``) they pin the prefill
  leg and the decode worker, and a worker whose role cannot run that leg is a 422; a decode worker
  pin and a different ``backend_instance_id`` are a 422. On an aggregated fleet there are no legs:
  they are reported back as unused and the request is routed as an aggregated one;
- ``priority`` is the engine's scheduling priority, forwarded to it: the router does not read it.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from api.errors import InvalidBody, UnknownRoutingTarget
from api.wire import MmRoutingInfo, RoutingHints
from indexer.slots import WorkerRank
from router.errors import NoEligibleWorker
from router.kv_router import KvRouter
from router.types import RouterConfigOverride, RouteRequest, Tokens, WorkerConfig

__all__ = ["RoutingCall", "routing_call"]


@dataclass(slots=True)
class RoutingCall:
    """The arguments of one `KvRouter.decide`, and the hints accepted without effect."""

    request: RouteRequest
    pinned: WorkerRank | None = None
    pinned_prefill: WorkerRank | None = None
    among: AbstractSet[int] | None = None
    isl_tokens: int | None = None
    unused_hints: list[str] = field(default_factory=list)
    # One leg on a disaggregated fleet too: a request with no KV to hand over (the proxy's pooling routes).
    one_leg: bool = False


def _worker(router: KvRouter, worker_id: int, name: str) -> WorkerConfig:
    worker = router.worker(worker_id)
    if worker is None:
        raise UnknownRoutingTarget(f"{name}: worker {worker_id} is not registered", field=name, worker_id=worker_id)
    return worker


def _rank(worker: WorkerConfig, dp_rank: int, name: str) -> None:
    if dp_rank not in worker.dp_ranks:
        ranks = worker.dp_ranks
        raise UnknownRoutingTarget(
            f"{name}: worker {worker.worker_id} has dp ranks {ranks.start}..{ranks.stop - 1}, not {dp_rank}",
            field=name,
            worker_id=worker.worker_id,
            dp_rank=dp_rank,
        )


def routing_call(
    router: KvRouter,
    tokens: Tokens,
    hints: RoutingHints | None,
    *,
    request_id: str | None,
    model: str = "",
    mm_routing_info: MmRoutingInfo | None = None,
    router_config_override: RouterConfigOverride | None = None,
    field_prefix: str = "routing.",
    serving: AbstractSet[int] | None = None,
) -> RoutingCall:
    """Check the hints and build the call; raises `UnknownRoutingTarget` (404) or `InvalidBody`
    (422) naming the field (``field_prefix`` + its name: ``routing.`` on a `PreprocessedRequest`,
    ``nvext.`` on the proxy's bodies). The request's candidates are the workers serving ``model``, or
    ``serving`` when the caller has them already (the proxy), within the hints' allowed ids."""
    hints = hints or RoutingHints()
    block_mm_infos = None
    isl_tokens = None
    if mm_routing_info is not None and mm_routing_info.routing_token_ids:
        # The seed's block_mm_routing_info / expanded_prompt_token_count.
        block_mm_infos = msgspec.to_builtins(mm_routing_info.block_mm_infos)
        if mm_routing_info.expanded_prompt_len > 0:
            isl_tokens = mm_routing_info.expanded_prompt_len
        else:
            isl_tokens = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
        tokens = mm_routing_info.routing_token_ids
    call = RoutingCall(
        RouteRequest(
            tokens=tokens,
            block_mm_infos=block_mm_infos,
            routing_constraints=hints.routing_constraints,
            priority_jump=hints.priority_jump or 0.0,
            strict_priority=hints.strict_priority or 0,
            lora_name=hints.lora_name,
            cache_namespace=hints.cache_namespace,
            request_id=request_id,
            expected_output_tokens=hints.expected_output_tokens,
            router_config_override=router_config_override,
        ),
        isl_tokens=isl_tokens,
    )
    among: AbstractSet[int] | None = hints.allowed_worker_ids
    if model:
        workers = router.workers()
        serving = frozenset(w.worker_id for w in workers if not w.models or model in w.models)
        if workers and not serving:  # the error names the model (with no worker yet, routing waits for one)
            raise NoEligibleWorker(model=model)
    if serving is not None:
        among = serving if among is None else among & serving
    pinned_id = hints.backend_instance_id
    if pinned_id is not None:
        worker = _worker(router, pinned_id, field_prefix + "backend_instance_id")
        if hints.allowed_worker_ids is not None and pinned_id not in hints.allowed_worker_ids:
            raise InvalidBody(
                f"{field_prefix}backend_instance_id: worker {pinned_id} is not among {field_prefix}allowed_worker_ids"
            )
        if hints.dp_rank is not None:
            _rank(worker, hints.dp_rank, field_prefix + "dp_rank")
            call.pinned = (pinned_id, hints.dp_rank)
        elif worker.dp_size == 1:
            call.pinned = (pinned_id, worker.dp_start_rank)
        else:  # as Dynamo refuses it: which rank is the caller's to say
            raise InvalidBody(
                f"{field_prefix}dp_rank: worker {pinned_id} has dp ranks {worker.dp_start_rank}.."
                f"{worker.dp_ranks[-1]}; pinning it needs one of them"
            )
    elif hints.dp_rank is not None:
        call.unused_hints.append("dp_rank")  # Dynamo 1.6.1 ignores a rank without a worker too
    call.among = among
    legs = router.two_legs(among)
    if hints.prefill_worker_id is not None:
        name = field_prefix + "prefill_worker_id"
        prefill = _worker(router, hints.prefill_worker_id, name)
        if hints.prefill_dp_rank is not None:
            _rank(prefill, hints.prefill_dp_rank, field_prefix + "prefill_dp_rank")
        if not legs:
            call.unused_hints.append("prefill_worker_id")
            if hints.prefill_dp_rank is not None:
                call.unused_hints.append("prefill_dp_rank")
        else:
            _serves(prefill, "prefill", name)
            call.pinned_prefill = (
                prefill.worker_id,
                _one_rank(prefill, hints.prefill_dp_rank, field_prefix + "prefill_dp_rank"),
            )
    elif hints.prefill_dp_rank is not None:
        raise InvalidBody(f"{field_prefix}prefill_dp_rank: a dp rank needs {field_prefix}prefill_worker_id")
    if hints.decode_worker_id is not None:
        name = field_prefix + "decode_worker_id"
        decode = _worker(router, hints.decode_worker_id, name)
        if not legs:
            call.unused_hints.append("decode_worker_id")
        else:
            _serves(decode, "decode", name)
            if call.pinned is None:
                call.pinned = (decode.worker_id, _one_rank(decode, None, field_prefix + "dp_rank"))
            elif call.pinned[0] != decode.worker_id:
                raise InvalidBody(
                    f"{name}: worker {decode.worker_id} differs from {field_prefix}backend_instance_id {call.pinned[0]}"
                )
    return call


def _serves(worker: WorkerConfig, leg: Literal["prefill", "decode"], name: str) -> None:
    if not worker.serves(leg):
        raise InvalidBody(f"{name}: worker {worker.worker_id} has role {worker.role}: it cannot run the {leg} leg")


def _one_rank(worker: WorkerConfig, dp_rank: int | None, name: str) -> int:
    """The rank named, or the worker's only one (several and none named: the caller must say, as for a pin)."""
    if dp_rank is not None:
        return dp_rank
    if worker.dp_size == 1:
        return worker.dp_start_rank
    raise InvalidBody(
        f"{name}: worker {worker.worker_id} has dp ranks {worker.dp_start_rank}..{worker.dp_ranks[-1]}; "
        "pinning it needs one of them"
    )
