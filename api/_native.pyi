# Types of the HTTP front's C accelerator built from api/_native.c (see api/native.py).
from typing_extensions import Buffer

def split_json_tokens(body: Buffer, /) -> tuple[bytes, int, int] | None: ...

# One whole plain POST request (api/http_protocol.py), or its Content-Length while the body is
# incomplete; None: httptools parses it.
def parse_post(
    data: bytes, /
) -> tuple[bytes, bytes, bytes | None, bytes | None, str | None, bytes | None, bytes] | int | None: ...
