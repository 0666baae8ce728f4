"""NATS subject and bucket names of one deployment namespace (design.md, "NATS layout")."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EPOCH_HEADER", "Subjects"]

# Header of event messages naming the publisher epoch (its start nonce), so a restarted publisher is
# seen as one; the RouterEvent payload itself stays Dynamo's shape.
EPOCH_HEADER = "Kv-Publisher-Epoch"


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in ". *>\t\r\n"):
            raise ValueError(f"namespace must be one NATS token (no '.', '*', '>' or spaces): {self.namespace!r}")

    def events(self, worker_id: int) -> str:
        return f"kv.{self.namespace}.events.{worker_id}"

    @property
    def all_events(self) -> str:
        return f"kv.{self.namespace}.events.>"

    def load(self, worker_id: int) -> str:
        return f"kv.{self.namespace}.load.{worker_id}"

    @property
    def all_loads(self) -> str:
        return f"kv.{self.namespace}.load.>"

    def heartbeat(self, worker_id: int) -> str:
        return f"kv.{self.namespace}.heartbeat.{worker_id}"

    @property
    def all_heartbeats(self) -> str:
        return f"kv.{self.namespace}.heartbeat.>"

    def resync(self, worker_id: int) -> str:
        return f"kv.{self.namespace}.resync.{worker_id}"

    @property
    def registry_bucket(self) -> str:
        return f"kv_router_workers_{self.namespace}"
