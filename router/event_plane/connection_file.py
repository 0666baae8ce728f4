"""How local tools find the embedded nats-server of a ``kv-router serve`` on this host, and its token.

The service writes one small JSON file per embedded server (``nats-<port>.json``: URL, token, the
service's PID) in this user's ``$XDG_RUNTIME_DIR/kv-router`` (a tmpfs that the login session owns),
else ``~/.cache/kv-router`` (made 0700 when the service makes it; one already there keeps its mode);
``--nats-connection-file`` (or ``KV_ROUTER_NATS_CONNECTION_FILE``) names another file. The file is
0600 (no other user reads it, whatever the directory's mode) and removed when the service stops.
``kv-router mock-worker``, ``replay --online`` and ``bridge`` read it when they are given no
credentials of their own: without a URL they take the server on port 4222 (or the only one running;
several running and none on 4222 is an error listing them), with a loopback URL the one on its port.
A file left by a killed service names a dead PID and is ignored; a file another user owns is never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from router.event_plane.connection import NatsOptions

__all__ = [
    "CONNECTION_FILE_ENV",
    "DEFAULT_URL",
    "ConnectionFileError",
    "LocalServer",
    "SeveralLocalServers",
    "connection_file_path",
    "find_local_server",
    "loopback_port",
    "remove_connection_file",
    "runtime_directory",
    "with_local_credentials",
    "write_connection_file",
]

DEFAULT_URL = "nats://127.0.0.1:4222"
CONNECTION_FILE_ENV = "KV_ROUTER_NATS_CONNECTION_FILE"
_DEFAULT_PORT = 4222


class ConnectionFileError(Exception):
    """A connection file that was asked for explicitly cannot be used, or which one is meant is unclear."""


class SeveralLocalServers(ConnectionFileError):
    """No URL was given and several services of this user run an embedded server, none on the default
    port: which one is meant only the user can say (the message lists them and asks for --nats-url)."""

    def __init__(self, servers: list[LocalServer]) -> None:
        self.servers = servers
        listed = ", ".join(f"{server.url} (PID {server.pid})" for server in servers)
        super().__init__(
            f"{len(servers)} kv-router serve of this user are running, none on port {_DEFAULT_PORT}: {listed}; "
            "pass --nats-url with the URL of the one to use (GET /v1/info on that router returns it)"
        )


class LocalServer(msgspec.Struct, frozen=True):
    """What one connection file holds."""

    url: str
    token: str
    pid: int

    def __repr__(self) -> str:  # never the token
        return f"LocalServer(url={self.url!r}, pid={self.pid})"


def runtime_directory() -> Path | None:
    """This user's directory for connection files; None for a user without a home (a container's)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "kv-router"
    home = Path(os.path.expanduser("~"))
    # Never a shared directory such as /tmp: another user could own the directory there.
    return home / ".cache" / "kv-router" if home.is_absolute() and home != Path("/") else None


def connection_file_path(port: int, configured: str | None = None) -> Path | None:
    """Where the service writes the file for its embedded server on ``port`` (None: nowhere)."""
    if configured:
        return Path(configured)
    directory = runtime_directory()
    return None if directory is None else directory / f"nats-{port}.json"


def write_connection_file(path: Path, server: LocalServer) -> None:
    """Write ``server`` to ``path`` (0600, atomically; its directory made 0700 if it is new), and
    drop the files that services killed without cleaning up left beside it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for other in path.parent.glob("nats-*.json"):
        left = _read(other)
        if left is not None and not _alive(left):
            with contextlib.suppress(OSError):
                other.unlink()
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".nats-", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(msgspec.json.encode(server))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def remove_connection_file(path: Path, server: LocalServer) -> None:
    """Remove the file if it still describes ``server`` (a later service may have taken the path)."""
    if _read(path) == server:
        with contextlib.suppress(OSError):
            path.unlink()


def _read(path: Path) -> LocalServer | None:
    """The file's content, or None when it is absent, not ours, or not a connection file."""
    try:
        with path.open("rb") as file:
            if os.fstat(file.fileno()).st_uid != os.getuid():
                return None  # planted by another user: it could point us at their server
            return msgspec.json.decode(file.read(), type=LocalServer)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _alive(server: LocalServer) -> bool:
    try:
        os.kill(server.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loopback_port(url: str) -> int | None:
    """The port of a NATS URL on this host's loopback (localhost or a loopback address), else None."""
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host, port = parts.hostname, parts.port or _DEFAULT_PORT
    except ValueError:
        return None
    if host == "localhost":
        return port
    try:
        return port if host is not None and ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def find_local_server(url: str | None, connection_file: str | None = None) -> LocalServer | None:
    """The running embedded server that ``url`` means (None: the default one), if any.

    An explicit ``connection_file`` must be readable (`ConnectionFileError` otherwise). Without a
    URL: the server on port 4222, else the only one running (`SeveralLocalServers` when more run);
    with a loopback URL: the one on its port.
    """
    if connection_file:
        server = _read(Path(connection_file))
        if server is None:
            raise ConnectionFileError(f"{connection_file} is not a readable kv-router connection file of this user")
        return server
    directory = runtime_directory()
    if directory is None:
        return None
    if url is not None:
        port = loopback_port(url)
        if port is None:
            return None
        server = _read(directory / f"nats-{port}.json")
        return server if server is not None and _alive(server) else None
    running = [server for path in sorted(directory.glob("nats-*.json")) if (server := _read(path)) and _alive(server)]
    preferred = [server for server in running if loopback_port(server.url) == _DEFAULT_PORT]
    if preferred:
        return preferred[0]
    if len(running) > 1:
        raise SeveralLocalServers(running)
    return running[0] if running else None


def with_local_credentials(url: str | None, options: NatsOptions, connection_file: str | None = None) -> NatsOptions:
    """``options`` for a local tool given ``url`` (None: none was given): when they carry no
    credentials of their own, the URL and token of the embedded server that URL means, if one runs."""
    connection_file = connection_file or os.environ.get(CONNECTION_FILE_ENV) or None
    if options.user is not None or options.token is not None or options.creds_file is not None:
        return options
    server = find_local_server(url, connection_file)
    if server is None:
        return options
    return dataclasses.replace(options, url=url or server.url, token=server.token)
