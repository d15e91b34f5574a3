"""The outbox machine's vocabulary: the frozen values it takes in and the decisions it gives out.

`OutboxRow` (an op as the outbox stores it) and `LaneBacklog` (what the outbox holds for a lane
at start) are what the shell feeds `OutboxMachine`; `Persist`, `Send`, `Resolve`, `Forget`,
`CountAttempt`, `Wait`, `Load` and `Discard` (together `Decision`) are what it drains from it
and carries out. See `machine` for which event leads to which decision, and the rules the
machine keeps.

They live apart from the machine because they are a different concept with different readers:
the outbox storage and the I/O shells build and consume these values without needing the
machine's lane, batch and retry logic. Plain data, sans-I/O like the machine (STYLE habit 1).
`machine` re-exports every name, so its users import from it alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.models import Commit

__all__ = [
    "BacklogRange",
    "CountAttempt",
    "Decision",
    "Discard",
    "Forget",
    "LaneBacklog",
    "LanePending",
    "Load",
    "OutboxRow",
    "Persist",
    "Resolve",
    "Restamp",
    "Send",
    "Wait",
]


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One op as the outbox stores it. `op_json` is sent verbatim on every attempt, so the server
    fingerprints the same bytes each time (docs/concepts.md). `atomic_group` is the seq of the first
    op of an atomic `apply_ops` call (its ops always travel together), None otherwise.
    `lane_seq` is the op's `seq` in its server lane (docs/client.md#exactly-once), set when it
    was minted (None for a row read back from the file: its op text carries it)."""

    seq: int
    workspace_id: str
    sub_doc: str
    op_id: str
    op_json: str
    created_at: float
    attempts: int = 0
    atomic_group: int | None = None
    lane_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LaneBacklog:
    """What the outbox holds for one `(workspace, sub_doc)` when a client starts: `count` rows,
    the highest of them `last_seq`."""

    workspace_id: str
    sub_doc: str
    count: int
    last_seq: int


# -- decisions -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Persist:
    """Write these rows to the outbox durably, then call `persisted(seqs)` (or `persist_failed`)."""

    rows: tuple[OutboxRow, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """Send these rows as one request (`{"ops": [...], "atomic": atomic}`); report the outcome with
    `batch_answered(batch_id, results)` or `batch_failed(batch_id, error)`."""

    batch_id: int
    workspace_id: str
    sub_doc: str
    rows: tuple[OutboxRow, ...]
    atomic: bool

    def body(self) -> str:
        """The HTTP body / websocket `ops` array, built from the stored op texts unchanged."""
        ops = ",".join(row.op_json for row in self.rows)
        return f'{{"ops":[{ops}],"atomic":{"true" if self.atomic else "false"}}}'

    def ops_json(self) -> str:
        return "[" + ",".join(row.op_json for row in self.rows) + "]"


@dataclass(frozen=True, slots=True)
class Resolve:
    """Settle the app's awaiters: `(seq, Commit | WorkspaceError)` per op somebody awaits."""

    outcomes: tuple[tuple[int, Commit | WorkspaceError], ...]


@dataclass(frozen=True, slots=True)
class Forget:
    """The server answered these rows: delete them from the outbox (no hurry, no fsync needed:
    a row that survives a crash is resent and answered as a duplicate)."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CountAttempt:
    """A send of these rows failed: bump their `attempts` column (diagnostics only)."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Call `timer_fired(workspace_id, sub_doc, token)` after `delay` seconds."""

    workspace_id: str
    sub_doc: str
    delay: float
    token: int


@dataclass(frozen=True, slots=True)
class Load:
    """Read the lane's restored rows with `after_seq < seq <= up_to_seq`, in seq order: the first
    `limit`, plus the rest of the last one's atomic group (a group never straddles two pages).
    Then call `loaded(workspace_id, sub_doc, rows)` (or `load_failed`)."""

    workspace_id: str
    sub_doc: str
    after_seq: int
    up_to_seq: int
    limit: int


@dataclass(frozen=True, slots=True)
class BacklogRange:
    """A lane's rows still on disk only: `after_seq < seq <= up_to_seq`."""

    workspace_id: str
    sub_doc: str
    after_seq: int
    up_to_seq: int


@dataclass(frozen=True, slots=True)
class Discard:
    """The app gave up on these ops (`discard_pending`): delete rows `seqs` and the lanes' rows
    in `backlog`, durably (fsync before the app is told): unlike an answered row, a discarded
    one that came back after a power loss would be sent."""

    seqs: tuple[int, ...]
    backlog: tuple[BacklogRange, ...]


@dataclass(frozen=True, slots=True)
class Restamp:
    """Rewrite these rows' op text in the outbox (same `seq`, a new lane `seq` in the op) and set
    the lanes' last minted seq to `lane_seqs` (absent lanes keep theirs), durably; then call
    `restamped(seqs, None)` (or with the error). The rows are not sent before."""

    rows: tuple[OutboxRow, ...]
    lane_seqs: tuple[tuple[str, str, int], ...] = ()


Decision = Persist | Send | Resolve | Forget | CountAttempt | Wait | Load | Discard | Restamp


@dataclass(frozen=True, slots=True)
class LanePending:
    """A lane's unanswered ops as the machine holds them (`OutboxMachine.lane_pending`): `rows`
    in memory (a batch in flight among them, once), and the restored rows still on disk only
    (`on_disk`, None when there are none), which the shell reads through the outbox."""

    rows: tuple[OutboxRow, ...]
    on_disk: BacklogRange | None

    def with_disk(self, read: Iterable[OutboxRow]) -> list[OutboxRow]:
        """Every unanswered op of the lane in the order the server will get them (seq order:
        restored rows first, new ops after), given rows the shell `read` from disk. Rows read
        outside `on_disk` are left out: a read made before the machine loaded (or answered,
        or discarded) them, when this is a fresh `lane_pending` taken after the read."""
        rows = list(self.rows)
        if self.on_disk is not None:
            rows.extend(
                row
                for row in read
                if self.on_disk.after_seq < row.seq <= self.on_disk.up_to_seq
                and (row.workspace_id, row.sub_doc)
                == (self.on_disk.workspace_id, self.on_disk.sub_doc)
            )
        return sorted(rows, key=lambda row: row.seq)
