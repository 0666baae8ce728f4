"""The private parts of uvicorn that `api.http_protocol` builds on, checked so that an uvicorn
release which changes them fails here, loudly and by name, rather than in production.

pyproject.toml pins uvicorn to the range this test (and tests/test_api_protocol.py) passed with.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from api.http_protocol import FastHttpProtocol

# Methods FastHttpProtocol overrides or calls on its base, with the parameters it passes.
OVERRIDDEN = {
    "__init__": ["self", "config", "server_state", "app_state", "_loop"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
    "connection_lost": ["self", "exc"],
    "resume_writing": ["self"],
    "shutdown": ["self"],
    "_unset_keepalive_if_required": ["self"],
    "timeout_keep_alive_handler": ["self"],
}
# Instance state of the base protocol that FastHttpProtocol reads or writes.
STATE = [
    "transport", "flow", "loop", "parser", "headers", "expect_100_continue", "cycle", "pipeline",
    "client", "timeout_keep_alive", "timeout_keep_alive_task", "tasks", "server_state", "logger",
    "access_logger", "access_log", "app", "scope",
]  # fmt: skip


def test_uvicorn_is_inside_the_pinned_range() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    [spec] = [d for d in pyproject["project"]["dependencies"] if d.startswith("uvicorn")]
    low, high = re.findall(r">=([\d.]+),<([\d.]+)", spec)[0]
    installed = tuple(int(p) for p in version("uvicorn").split(".")[:2])
    assert tuple(int(p) for p in low.split(".")[:2]) <= installed < tuple(int(p) for p in high.split(".")[:2])


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_overridden_methods_keep_their_signature(name: str) -> None:
    base = getattr(HttpToolsProtocol, name, None)
    assert base is not None, f"uvicorn's HttpToolsProtocol no longer has {name}"
    assert list(inspect.signature(base).parameters) == OVERRIDDEN[name]


def test_module_constants_and_cycle_are_still_there() -> None:
    assert isinstance(httptools_impl.STATUS_LINE[200], bytes)
    assert httptools_impl.STATUS_LINE[200].startswith(b"HTTP/1.1 200")
    assert httptools_impl.HEADER_VALUE_RE.search(b"bad\nvalue")
    assert hasattr(httptools_impl, "RequestResponseCycle")
    # FastHttpProtocol overrides it to send hot requests its own way.
    assert "_start_asgi_task" in inspect.getsource(FastHttpProtocol)
    assert hasattr(HttpToolsProtocol, "_start_asgi_task")


def test_the_base_protocol_sets_the_state_we_use() -> None:
    async def build() -> HttpToolsProtocol:
        config = Config(app=lambda scope, receive, send: None, http="httptools", log_config=None)
        config.load()
        protocol = HttpToolsProtocol(config, ServerState(), app_state={})

        class Transport(asyncio.Transport):
            def get_extra_info(self, name: str, default: object = None) -> object:
                return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

            def is_closing(self) -> bool:
                return False

        protocol.connection_made(Transport())
        return protocol

    protocol = asyncio.run(build())
    protocol.scope = {}  # set per request by on_headers_complete; the attribute itself is what we rely on
    missing = [name for name in STATE if not hasattr(protocol, name)]
    assert not missing, f"uvicorn's HttpToolsProtocol no longer sets {missing}"
