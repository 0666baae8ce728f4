"""`EngineSpec`: one engine heard directly (``kv-router serve --engine``), parsed; light to import (the
CLI checks specs before anything starts)."""

from __future__ import annotations

from typing import NamedTuple

from router.engines.openai_server import openai_base

__all__ = ["ENGINE_SPEC_FORM", "EngineSpec", "parse_engine_spec"]


class EngineSpec(NamedTuple):
    """One ``--engine`` (``--engine-zmq``): ``WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]
    [,url=http://HOST:PORT[/v1]][,models=NAME+NAME]``."""

    worker_id: int
    endpoint: str
    replay: str | None = None
    url: str | None = None  # the engine's OpenAI server root (`openai_base`)
    models: tuple[str, ...] | None = None  # None: asked from the engine's /v1/models

    def __str__(self) -> str:
        options = [f"replay={self.replay}"] if self.replay else []
        options += [f"url={self.url}"] if self.url else []
        options += ["models=" + "+".join(self.models)] if self.models is not None else []
        return ",".join([f"{self.worker_id}={self.endpoint}", *options])


ENGINE_SPEC_FORM = "WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,url=http://HOST:PORT][,models=NAME+NAME]"


def parse_engine_spec(spec: str) -> EngineSpec:
    """An ``--engine`` spec (see `EngineSpec`); raises ``ValueError`` saying what is wrong, in one line."""
    worker, sep, rest = spec.partition("=")
    try:
        worker_id = int(worker.strip())
    except ValueError:
        raise ValueError(f"engine {spec!r}: expected {ENGINE_SPEC_FORM}") from None
    if not 0 <= worker_id < 1 << 64:
        raise ValueError(f"engine {spec!r}: the worker id must be a u64")
    parts = [part.strip() for part in rest.split(",")]
    if not sep or not parts[0]:
        raise ValueError(f"engine {spec!r}: no endpoint after {worker!r}=")
    endpoint = parts[0]
    if not endpoint.startswith(("tcp://", "ipc://")) or "=" in endpoint:
        raise ValueError(f"engine {spec!r}: the event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    options: dict[str, str] = {}
    for option in parts[1:]:
        key, _, value = option.partition("=")
        if key not in ("replay", "url", "models") or not value:
            raise ValueError(f"engine {spec!r}: unknown or empty option {option!r} (replay=, url=, models=)")
        if key in options:
            raise ValueError(f"engine {spec!r}: {key}= given twice")
        options[key] = value
    url = None
    if "url" in options:
        try:
            url = openai_base(options["url"])
        except ValueError as exc:
            raise ValueError(f"engine {spec!r}: url: {exc}") from None
    models = None
    if "models" in options:
        if url is None:
            raise ValueError(f"engine {spec!r}: models= needs url= (the models served there)")
        models = tuple(name for name in options["models"].split("+") if name)
    return EngineSpec(worker_id, endpoint, options.get("replay"), url, models)
