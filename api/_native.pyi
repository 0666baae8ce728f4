# Types of the HTTP front's C accelerator built from api/_native.c (see api/native.py).
from collections.abc import Sequence

from typing_extensions import Buffer

# The signatures' version (api/native.py runs the Python paths when it is not the one expected).
INTERFACE: int

# A JSON body's array of token ids under the top-level ``member`` as packed u32, and its byte span.
def split_json_tokens(body: Buffer, member: bytes = ..., /) -> tuple[bytes, int, int] | None: ...

# One whole plain POST request (api/http_protocol.py), or its Content-Length while the body is
# incomplete; None: httptools parses it.
def parse_post(
    data: bytes, /
) -> tuple[bytes, bytes, bytes | None, bytes | None, str | None, bytes | None, bytes] | int | None: ...

# One whole HTTP/1.1 response: head (up to the content-length value), the length, x-request-id
# (omitted when it holds a control character), the other header lines, the body. None: request_id
# is not latin-1.
def response(head: bytes, body: bytes, request_id: str | None, lines: bytes, /) -> bytes | None: ...

# One histogram series (api/metrics.py's `_Histogram`, the same counts and sum).
class Histogram:
    created: float
    def __init__(self, bounds: Sequence[float], /) -> None: ...
    def observe(self, value: float, /) -> None: ...
    @property
    def counts(self) -> list[int]: ...
    @property
    def bounds(self) -> tuple[float, ...]: ...
    @property
    def total(self) -> float: ...
