"""What the SDK hands back: `Commit` (the answer to an op), `Committed` (an op a subscription saw),
`SyncStatus` (what the client has not synced yet, and which workspaces it is connected to).

Pure value types: the sans-I/O core builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cv_mutations import Op, SubDocState

__all__ = ["Commit", "Committed", "Snapshot", "SyncStatus"]


@dataclass(frozen=True, slots=True)
class Commit:
    """The server committed the op at `clock` of its sub-doc.

    `duplicate` is true when this is the stored answer: an earlier send of the same `op_id` had
    already been committed (its answer was lost, or another process resent the outbox). The op
    was applied once either way. `clock` 0 with `duplicate` is an op the server decided long ago
    and no longer keeps the outcome of (docs/client.md#exactly-once): never applied again.
    """

    clock: int
    op_id: str
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed op of a subscribed sub-doc, in clock order, each clock exactly once.

    `committed_at` is when the server committed it (Unix seconds, on the server's clock, or the
    database's on PostgreSQL), whether it came live or from catch-up; None from a server that does
    not send it (docs/protocol.md). It takes no part in equality: the same op is the same
    `Committed` whether or not its time is known.
    """

    clock: int
    op_id: str | None
    op: Op
    committed_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The sub-doc's whole state at `clock`, yielded by a subscription in place of ops that
    compaction deleted (docs/client.md, "Behind the horizon"). Replace what was built from the
    earlier ops with `state`; the ops after `clock` follow, gap-free. The state is the
    subscription's to hand over: the app may keep and change it."""

    clock: int
    state: SubDocState = field(compare=False)


@dataclass(frozen=True, slots=True)
class SyncStatus:
    """What an app shows as "saved" / "saving" / "offline".

    `pending`: ops submitted (or restored from the outbox) that the server has not answered yet;
    they are safe in the outbox either way. `connected`: the workspaces whose websocket is open
    (ops to the others go over HTTP, and their subscriptions wait for the reconnect).
    `refused`: the workspaces for which the server refused the token (expired, revoked, not
    granted): their ops wait in the outbox until the app calls `set_token` — time to sign in.
    """

    pending: int
    connected: frozenset[str]
    refused: frozenset[str] = frozenset()

    @property
    def synced(self) -> bool:
        """Nothing pending: every op submitted has been answered."""
        return self.pending == 0
