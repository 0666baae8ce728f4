"""Our structs for Dynamo's `PreprocessedRequest` against the Rust source they mirror: field names,
serde renames, which fields may be absent, which are skipped when empty.

The seeds in ``shared/reference/seeds/`` are dynamo-llm's and dynamo-kv-router's own source; their
serde attributes are read here, so a struct of ours that drifts from them fails by name. Dynamo's
Python bindings do not expose these structs' serde, so the source is the reference. The seed's own
unit tests for this wire (packed token ids, ``cache_salt``, ``_HEALTH_CHECK``, the minimal canary
payload) are replayed on our decoder.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from api.wire import (
    BlockExtraInfo,
    BlockMmObjectInfo,
    MmRoutingInfo,
    PreprocessedRequest,
    RouteBody,
    RoutingHints,
)
from router.types import RoutingConstraints


@dataclass(frozen=True)
class SeedField:
    wire_name: str
    optional: bool  # may be absent: serde(default) or an Option
    skipped_when: str | None  # serde(skip_serializing_if = ...)


def seed_struct(source: str, name: str) -> dict[str, SeedField]:
    """The serialized fields of ``pub struct name`` in a Rust source, by Rust field name."""
    match = re.search(rf"pub struct {name} \{{\n(.*?)\n\}}", source, re.S)
    assert match, f"struct {name} not in the seed"
    fields: dict[str, SeedField] = {}
    attributes = ""
    for line in match.group(1).splitlines():
        stripped = line.strip()
        if stripped.startswith("///") or not stripped:
            continue
        field = re.match(r"pub(?:\(crate\))? (\w+): (.+),$", stripped)
        if field is None:
            attributes += stripped
            continue
        serde = " ".join(re.findall(r"#\[serde\((.*?)\)\]", attributes.replace("\n", " ")))
        attributes = ""
        if re.search(r"\bskip\b(?!_)", serde):
            continue  # never on the wire
        rename = re.search(r'\brename = "([^"]+)"', serde)
        skipped = re.search(r'skip_serializing_if = "([^"]+)"', serde)
        rust_name, rust_type = field.groups()
        fields[rust_name] = SeedField(
            wire_name=rename.group(1) if rename else rust_name,
            optional=bool(re.search(r"\bdefault\b", serde)) or rust_type.startswith("Option<"),
            skipped_when=skipped.group(1) if skipped else None,
        )
    return fields


@pytest.fixture(scope="module")
def seeds(shared_dir: Path) -> str:
    folder = shared_dir / "reference" / "seeds"
    return "".join(
        (folder / name).read_text()
        for name in ("dynamo-llm-preprocessed-request.rs.txt", "dynamo-kv-router-protocols.rs.txt")
    )


def ours(struct_type: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    return {field.encode_name: field for field in msgspec.structs.fields(struct_type)}


@pytest.mark.parametrize(
    ("rust", "struct_type", "complete"),
    [
        ("RoutingHints", RoutingHints, True),
        ("MmRoutingInfo", MmRoutingInfo, True),
        ("BlockExtraInfo", BlockExtraInfo, True),
        ("BlockMmObjectInfo", BlockMmObjectInfo, True),
        ("RoutingConstraints", RoutingConstraints, True),
        ("PreprocessedRequest", PreprocessedRequest, False),  # only what routing reads
    ],
)
def test_our_structs_have_the_seeds_wire_names_and_optionality(
    seeds: str, rust: str, struct_type: type[msgspec.Struct], complete: bool
) -> None:
    theirs = {field.wire_name: field for field in seed_struct(seeds, rust).values()}
    mine = ours(struct_type)
    assert set(mine) <= set(theirs), f"{rust}: fields Dynamo does not have: {set(mine) - set(theirs)}"
    if complete:
        assert set(mine) == set(theirs), f"{rust}: Dynamo's fields we lack: {set(theirs) - set(mine)}"
    for wire_name, field in mine.items():
        assert field.required is not theirs[wire_name].optional, f"{rust}.{wire_name}: required differs"
    skipped = {name for name, field in theirs.items() if field.skipped_when and name in mine}
    if skipped and complete:  # skipped when empty in Rust: omitted when at their default here
        # (PreprocessedRequest mixes both and is never encoded here: it goes back as it came.)
        assert struct_type.__struct_config__.omit_defaults, rust
        assert all(not mine[name].required for name in skipped)


def test_the_renames_and_what_is_skipped(seeds: str) -> None:
    hints = seed_struct(seeds, "RoutingHints")
    assert hints["cache_namespace"].wire_name == "cache_salt"
    assert all(field.skipped_when == "Option::is_none" for field in hints.values())
    request = seed_struct(seeds, "PreprocessedRequest")
    assert request["is_probe"].wire_name == "_HEALTH_CHECK"
    assert "migration_state" not in request and "tracker" not in request  # serde(skip): never sent
    # Ours encode the same way: the salt under its wire name, absent hints not written at all.
    assert msgspec.json.encode(RoutingHints(cache_namespace="tenant-a")) == b'{"cache_salt":"tenant-a"}'
    assert msgspec.json.encode(RoutingHints()) == b"{}"
    assert msgspec.json.decode(b'{"cache_salt": "tenant-a"}', type=RoutingHints).cache_namespace == "tenant-a"


# The seed's own unit tests of the token_ids wire (dynamo-llm-preprocessed-request.rs.txt, `mod tests`).
def _packed(ids: list[int]) -> bytes:
    return msgspec.msgpack.encode({"token_ids": b"".join(struct.pack("<I", i) for i in ids)})


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (_packed([0, 1, 128_000, 2**31 - 1]), [0, 1, 128_000, 2**31 - 1]),  # packed_token_ids_deserialize...
        (msgspec.msgpack.encode({"token_ids": [7, 8, 9]}), [7, 8, 9]),  # sequence_token_ids_still_deserialize
        (msgspec.msgpack.encode({"token_ids": [7, 2**31]}), [7, 2**31]),  # ids_above_i32_max_keep_the_sequence
    ],
)
def test_the_seeds_token_ids_payloads(payload: bytes, expected: list[int]) -> None:
    token_ids = msgspec.msgpack.decode(payload, type=PreprocessedRequest).token_ids
    as_list = list(struct.unpack(f"<{len(token_ids) // 4}I", token_ids)) if isinstance(token_ids, bytes) else token_ids
    assert as_list == expected


def test_the_seeds_minimal_canary_payload_decodes() -> None:
    request: Any = msgspec.json.decode(b'{"token_ids": [1], "_HEALTH_CHECK": true}', type=RouteBody)
    assert (request.token_ids, request.is_probe, request.model) == ([1], True, "")
