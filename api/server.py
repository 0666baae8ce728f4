"""Run the app under uvicorn: uvloop event loop, kv-router's HTTP protocol on httptools' parser (the
hot routes answered before ASGI, `api.http_protocol`), graceful shutdown on SIGTERM.

uvicorn owns the signals: on SIGTERM (or SIGINT) it stops accepting connections, closes idle
keep-alive connections, lets requests in flight finish for up to ``shutdown_timeout_secs``, then
runs the app's lifespan shutdown and exits 0.

Once its socket listens (the app started), each serving process logs one INFO line with the address:
``serving HTTP on http://HOST:PORT`` (``https://`` with TLS; with ``--processes N`` each child its own).
A ``--processes`` child started again beside a serving sibling listens only once its event plane has
caught up (`serve_child`): the kernel would hand it its share of the port's connections at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging.config
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Literal

import msgspec
import uvicorn

from api.app import RouterApp, create_app
from api.config import Settings
from api.http_protocol import fast_protocol
from api.listen import listening_socket
from api.logs import log_config
from api.plane_lifecycle import embedded_nats
from api.process_metrics import ProcessGroup
from api.processes import CHILD_CATCH_UP_ENV, CHILD_SETTINGS_ENV, run_children
from router.event_plane.embedded_server import ServerKeeper

__all__ = ["serve", "serve_child", "uvicorn_config"]

logger = logging.getLogger(__name__)


def uvicorn_config(
    settings: Settings, process_group: ProcessGroup | None = None, embedded: ServerKeeper | None = None
) -> uvicorn.Config:
    """uvicorn's configuration for ``settings``; ``process_group``: one process of ``--processes N``;
    ``embedded``: the keeper of the embedded nats-server this process runs."""
    service = settings.service
    app = create_app(settings, process_group=process_group, embedded=embedded)
    # The hot and proxy routes are answered by our HTTP protocol, before ASGI (`api.http_protocol`,
    # through uvicorn's public http= setting); with fast_protocol off, uvicorn's own httptools
    # protocol runs every request on the app, FastAPI's routes included.
    http: type[asyncio.Protocol] | Literal["httptools"] = "httptools"
    if service.fast_protocol:
        http = fast_protocol(app.hot)
    return uvicorn.Config(
        app,
        host=service.host,
        port=service.port,
        loop="uvloop",
        http=http,
        ws="none",  # no WebSocket route: an upgrade request is answered as plain HTTP
        lifespan="on",
        access_log=service.access_log,
        log_config=log_config(service.log_level, service.log_format),
        timeout_graceful_shutdown=service.shutdown_timeout_secs,
        # Clients are gateways calling for a decision; no address from X-Forwarded-For is used.
        proxy_headers=False,
        # Routing decisions are small and answered in well under a millisecond; the server header
        # and date stamp are bytes on every reply that no client of this API reads.
        server_header=False,
        date_header=False,
        # HTTPS when configured: the TLS layer sits under the protocol, so it serves HTTPS too.
        ssl_certfile=settings.security.ssl_certfile,
        ssl_keyfile=settings.security.ssl_keyfile,
    )


def serve(
    settings: Settings,
    sock: socket.socket | None = None,
    *,
    catch_up: bool = False,
    process_group: ProcessGroup | None = None,
) -> None:
    """Serve until SIGTERM / SIGINT; returns once the last in-flight request has been answered.

    ``catch_up`` (with ``sock``, bound but not yet listening): the socket listens only once the event
    plane has started (the worker registry read, with replica sync the peers' bookings joined) and the
    full dumps it asked the workers for are in (`PlaneLifecycle.caught_up`), not as soon as the app has,
    or once no other process listens on the port any more; a signal meanwhile stops the process
    without it ever listening.

    Without ``nats_url`` (and unless ``embedded_nats`` is off) a private nats-server runs beside the
    service for its whole life, started again if it dies (`ServerKeeper`), and stops after it.

    After its graceful shutdown uvicorn raises the signal it caught again, with the handlers it found
    in place, so that the process ends as one killed by that signal. Those handlers are `_stop`'s: the
    signal comes back here as `_Stopped`, the embedded nats-server is stopped, and only then is it
    raised with the default handlers (a signal before uvicorn took over stops start-up the same way).
    """
    logging.config.dictConfig(log_config(settings.service.log_level, settings.service.log_format))
    service = settings.service
    if sock is None:
        # The address first: a port in use or a host that does not resolve stops the command before
        # anything starts (no embedded NATS left behind, no app started only to fail on the bind).
        sock = listening_socket(service.host, service.port, reuse_port=settings.ha.processes > 1)
        if settings.ha.processes > 1:
            sock.close()  # each child binds its own (SO_REUSEPORT); this one only proved the address free
            sock = None
    previous = {sig: signal.signal(sig, _stop) for sig in _SIGNALS}
    stopped_by: int | None = None
    try:
        with embedded_nats(settings.event_plane) as (event_plane, keeper):
            settings = msgspec.structs.replace(settings, event_plane=event_plane)
            if settings.ha.processes > 1:
                run_children(settings)  # each child comes back here with one process and its socket
            else:
                config = uvicorn_config(settings, process_group, keeper)
                _freeze_startup_objects(proxy=settings.proxy.proxy)
                plane = config.app.event_plane if isinstance(config.app, RouterApp) else None
                caught_up = plane.caught_up if catch_up and sock is not None and plane is not None else None
                _Server(config, caught_up).run(sockets=None if sock is None else [sock])
    except _Stopped as stopped:
        stopped_by = stopped.signal
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped_by is not None:
        # The default action, not Python's SIGINT handler (a KeyboardInterrupt traceback on exit).
        signal.signal(stopped_by, signal.SIG_DFL)
        signal.raise_signal(stopped_by)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, saying where it listens: uvicorn logs no address for sockets it is handed.

    With ``caught_up``, the sockets it is handed listen only once that has returned (after the app's
    start), or never if a signal comes first (it then shuts down as after any start)."""

    def __init__(self, config: uvicorn.Config, caught_up: Callable[[], Awaitable[object]] | None = None) -> None:
        super().__init__(config)
        self._caught_up = caught_up

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        held = sockets if self._caught_up is not None and sockets else None
        # With sockets held, uvicorn starts the app and listens on none of them (an empty list).
        await super().startup([] if held is not None else sockets)
        if held is not None and await self._until_caught_up(held[0]):
            await self._listen(held)
        if self.should_exit or not self.servers:  # the app failed to start, or stopped before it listened
            return
        for server in self.servers:
            for sock in server.sockets:
                logger.info("serving HTTP on %s", http_address(sock.getsockname(), tls=self.config.ssl is not None))

    async def _until_caught_up(self, held: socket.socket) -> bool:
        """Wait for ``caught_up``; False if a signal (``should_exit``) comes first. The wait ends sooner,
        the event plane not caught up, once no sibling listens on the port: the siblings that served when
        this process started have died since, or wait as it does (with NATS out of reach every process
        started again would wait, and none would answer)."""
        assert self._caught_up is not None
        logger.info("started again beside serving processes: listening once the event plane has caught up")
        loop = asyncio.get_running_loop()
        siblings = _SiblingProbe(held)
        waiting = asyncio.ensure_future(self._caught_up())
        next_probe = loop.time()
        try:
            while not waiting.done():
                if self.should_exit:  # uvicorn's signal handler only sets it (checked as its main loop does)
                    return False
                if loop.time() >= next_probe:
                    if not await siblings.serving():
                        return not self.should_exit
                    next_probe = loop.time() + SIBLING_PROBE_INTERVAL_S
                await asyncio.wait({waiting}, timeout=0.1)
            if not waiting.cancelled() and waiting.exception() is not None:
                logger.warning("the event plane did not catch up (%r): listening", waiting.exception())
            return not self.should_exit
        finally:
            waiting.cancel()

    async def _listen(self, sockets: list[socket.socket]) -> None:
        """Serve on ``sockets`` as uvicorn's own start-up does with sockets handed to it."""
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        loop = asyncio.get_running_loop()
        for sock in sockets:
            self.servers.append(
                await loop.create_server(create_protocol, sock=sock, ssl=config.ssl, backlog=config.backlog)
            )


# How often a process started again checks, while it waits for its event plane, that a sibling still
# serves the port; how long a check may take (a sibling's full accept queue makes it slow); and after
# how many checks in a row that cannot tell (an error other than a refusal) it listens anyway.
SIBLING_PROBE_INTERVAL_S = 0.5
SIBLING_PROBE_TIMEOUT_S = 1.0
SIBLING_PROBES_UNTOLD = 3


class _SiblingProbe:
    """Whether another process listens on the port a held socket is bound to, by connecting to it."""

    def __init__(self, held: socket.socket) -> None:
        address = held.getsockname()
        host, port = address[0], address[1]
        # The address itself (an IPv6 one with its scope); a wildcard's loopback (for ``::``, IPv6's, then
        # IPv4's: a dual-stack socket serves both, and a host may have IPv6's loopback off).
        self._addresses: list[tuple[socket.AddressFamily, tuple[object, ...]]] = [(held.family, tuple(address))]
        ipv4 = (socket.AF_INET, ("127.0.0.1", port))
        if host == "0.0.0.0":
            self._addresses = [ipv4]
        elif host == "::":
            self._addresses = [(socket.AF_INET6, ("::1", port, 0, 0)), ipv4]
        self._untold = 0  # probes in a row that could not tell

    async def serving(self) -> bool:
        """False once no sibling listens (a connection refused), or after `SIBLING_PROBES_UNTOLD` probes
        in a row that could not tell (an error other than a refusal); each is said in the log."""
        listening = await self._connect()
        if isinstance(listening, OSError):
            self._untold += 1
            given_up = self._untold == SIBLING_PROBES_UNTOLD
            logger.warning("cannot tell whether another process serves the port (%s)%s", listening,
                           ": listening" if given_up else "")  # fmt: skip
            return not given_up
        self._untold = 0
        if not listening:
            logger.warning("no other process serves the port: listening before the event plane has caught up "
                           "(workers, bookings and caches may be missing until it has)")  # fmt: skip
        return listening

    async def _connect(self) -> bool | OSError:
        """False: the connection was refused; True: it was made (and closed at once: the sibling sees a
        client that left without a request) or timed out (an accept queue full); else the last error
        of the addresses tried."""
        loop = asyncio.get_running_loop()
        error = OSError("no address to probe")
        for family, address in self._addresses:
            probe = socket.socket(family, socket.SOCK_STREAM)
            probe.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(probe, address), SIBLING_PROBE_TIMEOUT_S)
                return True
            except TimeoutError:
                return True
            except ConnectionRefusedError:
                return False
            except OSError as exc:
                error = exc
            finally:
                probe.close()
        return error


def http_address(sockname: tuple[str, int] | tuple[str, int, int, int], *, tls: bool = False) -> str:
    """``http(s)://HOST:PORT`` of a bound socket's address (an IPv6 host in brackets)."""
    host, port = sockname[0], sockname[1]
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


# The OpenAI proxy holds every stream's objects (coroutines, futures, its exchange) for the stream's
# life, and each young collection walks them all (~0.3 ms at 100 streams, whatever the threshold):
# at 10,000 allocations instead of 700 there are ~14x fewer. Measured: 0.45% of proxied requests
# over 1 ms of the proxy's own time -> 0.13% (docs/performance.md, issue 13).
PROXY_YOUNG_GC_THRESHOLD = 10_000


def _freeze_startup_objects(proxy: bool = False) -> None:
    """Take what start-up made (modules, the app, its routes: ~70k objects) out of the cyclic GC's
    walks: each full collection would otherwise walk them all, ~40-90 ms holding the loop on the
    shared 2-core machine, at any moment while serving (one landed in a snapshot's upload). They
    live as long as the process; the KV index's nodes are untracked anyway. A proxy's young
    generation collects less often (`PROXY_YOUNG_GC_THRESHOLD`)."""
    gc.collect()
    gc.freeze()
    if proxy:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(PROXY_YOUNG_GC_THRESHOLD, older, oldest)


class _Stopped(BaseException):
    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.signal = sig


def _stop(sig: int, frame: FrameType | None) -> None:
    raise _Stopped(sig)


def serve_child() -> None:
    """One process of ``--processes N``: settings from the parent, its own socket on the shared port. One
    started again while a sibling serves listens only once it has the fleet's workers, bookings and caches."""
    settings = msgspec.json.decode(os.environ[CHILD_SETTINGS_ENV], type=Settings)
    catch_up = os.environ.get(CHILD_CATCH_UP_ENV) == "1"
    sock = _reuse_port_socket(settings.service.host, settings.service.port)
    serve(settings, sock=sock, catch_up=catch_up, process_group=ProcessGroup.from_environment())


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    return listening_socket(host, port, reuse_port=True)
