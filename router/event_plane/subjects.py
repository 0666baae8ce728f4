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

    def events_sender(self, subject: str) -> int | None:
        """The worker an events subject (`events`) names; None for a subject that names none."""
        prefix = f"kv.{self.namespace}.events."
        token = subject[len(prefix) :] if subject.startswith(prefix) else ""
        return int(token) if token.isascii() and token.isdigit() else None

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

    def refused(self, worker_id: int) -> str:
        """A router telling a worker it refused its registration (`messages.Refusal`)."""
        return f"kv.{self.namespace}.refused.{worker_id}"

    @property
    def router_sync(self) -> str:
        """Replica sync: every router's booking changes and heartbeats (`router.replicas`)."""
        return f"kv.{self.namespace}.router.sync"

    def router_sync_state(self, replica_id: str | None = None) -> str:
        """Request/reply for a replica's current bookings: one named replica, or any (a queue group)."""
        suffix = "" if replica_id is None else f".{replica_id}"
        return f"kv.{self.namespace}.router.sync.state{suffix}"

    @property
    def events_stream(self) -> str:
        """The JetStream stream over `all_events` (``--durable-events``)."""
        return f"KV_EVENTS_{self.namespace}"

    @property
    def snapshot_bucket(self) -> str:
        return f"kv_router_snapshots_{self.namespace}"

    @property
    def router_cursor_bucket(self) -> str:
        """Live routers' applied and snapshot stream sequences, expiring with them (``--durable-events``)."""
        return f"kv_router_cursors_{self.namespace}"

    @property
    def registry_bucket(self) -> str:
        return f"kv_router_workers_{self.namespace}"
