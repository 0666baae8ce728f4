"""Every error the indexer raises: payloads that do not decode, and events the index could not apply
(fully). The index stays consistent in every case."""

from __future__ import annotations

from typing import Final

import msgspec

from indexer.slots import WorkerRank

__all__ = [
    "UNDECODABLE",
    "BlockNotFound",
    "EventDecodeError",
    "InvalidBlockSequence",
    "KvIndexError",
    "ParentBlockNotFound",
]

# What msgspec raises for bytes it cannot decode. Besides DecodeError (ValidationError is one), it gives up
# on nesting too deep with a RecursionError (unknown members and Raw values are skipped recursively): a
# sender must not turn either into a crash of the handler that reads its message.
UNDECODABLE: Final = (msgspec.DecodeError, RecursionError)


class KvIndexError(Exception):
    """An event that could not be applied (fully). ``label`` names it in metrics (Dynamo's status)."""

    label = "index_error"


class ParentBlockNotFound(KvIndexError):
    """A store's parent is not held by the sending worker: nothing of the event was applied."""

    label = "parent_block_not_found"


class BlockNotFound(KvIndexError):
    """Some removed hashes were not held by the sender; all the others were removed."""

    label = "block_not_found"

    def __init__(self, worker: WorkerRank, missing: list[int]) -> None:
        shown = ", ".join(str(h) for h in missing[:8]) + (", ..." if len(missing) > 8 else "")
        super().__init__(f"worker {worker[0]} dp_rank {worker[1]}: {len(missing)} unknown block(s): {shown}")
        self.missing = missing


class InvalidBlockSequence(KvIndexError):
    """A store whose block list contains its own parent: rejected whole."""

    label = "invalid_block"


class EventDecodeError(ValueError):
    """A KV-event payload that is not a valid ``RouterEvent`` or list of them; says what and where."""
