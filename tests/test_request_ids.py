"""Ids given to requests that came without one: uuid4's shape, never repeated, not even by a fork."""

from __future__ import annotations

import os
import re
import warnings

from router.request_ids import new_request_id


def test_ids_are_32_hex_digits_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", request_id) for request_id in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_ids_of_its_own() -> None:
    """`serve --processes N` and replica sync share bookings between processes: ids must not collide."""
    new_request_id()
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 warns of forking a process with threads; the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, " ".join(new_request_id() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 4096).decode().split()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    parent = [new_request_id() for _ in range(3)]
    assert len(child) == 3
    assert {request_id[:16] for request_id in child}.isdisjoint({request_id[:16] for request_id in parent})
