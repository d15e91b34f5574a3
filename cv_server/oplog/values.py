"""The op-log's values: what an append takes and answers, what a read returns, and the error a
broken log raises. Pure (no asyncio, no storage): the commit pipeline (`pipeline.py`), the seam
(`store.py`) and both backends share them, and the architecture contract keeps this module and
the pipeline free of I/O imports ([tool.importlinter] in pyproject.toml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cv_mutations import Op
from cv_server.errors import CvServerError

__all__ = [
    "Committed",
    "Compaction",
    "Forgotten",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStats",
    "Outcome",
    "Rejected",
    "SubDocHead",
]


@dataclass(frozen=True, slots=True)
class IncomingOp:
    """One op as the server received it: parsed, plus what dedupe needs.

    `raw` is the JSON object as received (stored in the log and sent to subscribers verbatim);
    `fingerprint` is `cv_mutations.fingerprint(raw)`.
    """

    op: Op
    raw: dict[str, Any]
    fingerprint: str

    @property
    def op_id(self) -> str | None:
        return self.op.op_id


@dataclass(frozen=True, slots=True)
class Committed:
    """The op is in the log at `clock`. `duplicate` is true when this is the stored answer of an
    earlier send of the same op."""

    op_id: str | None
    clock: int
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"op_id": self.op_id, "clock": self.clock, "duplicate": self.duplicate}


@dataclass(frozen=True, slots=True)
class Rejected:
    """The op was not applied. Reducer rejections are recorded and answered verbatim again on retry
    (`duplicate: true`); `op_id_reuse` and `atomic_aborted` are answers, never recorded."""

    op_id: str | None
    code: str
    message: str
    duplicate: bool = False
    #: `seq_gap`: the seq the lane expects next (docs/ops.md#exactly-once).
    expected_seq: int | None = None
    #: `op_expired`: the sub-doc's head clock when the op was refused.
    clock: int | None = None

    def to_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.expected_seq is not None:
            error["expected_seq"] = self.expected_seq
        if self.clock is not None:
            error["clock"] = self.clock
        return {"op_id": self.op_id, "error": error, "duplicate": self.duplicate}


@dataclass(frozen=True, slots=True)
class Forgotten:
    """The op was decided before (its `seq` is at or below its lane's mark) but its outcome is no
    longer on record (compacted): a duplicate whose clock is unknown, `clock: null` on the wire
    (docs/ops.md#exactly-once). Never applied again."""

    op_id: str | None

    @property
    def duplicate(self) -> bool:
        return True

    def to_json(self) -> dict[str, Any]:
        return {"op_id": self.op_id, "clock": None, "duplicate": True}


Outcome = Committed | Rejected | Forgotten


class OpLogCorrupted(CvServerError):
    """The stored log cannot be rebuilt into a state (a gap, an op its own history rejects, or a
    snapshot ahead of the log). Every backend raises this one class; the server answers it as
    an internal error and never serves the half-built state."""

    code = "internal"


@dataclass(frozen=True, slots=True)
class LogEntry:
    """A committed op as subscribers see it.

    `committed_at` is when its transaction committed (epoch seconds, on the clock that stamped the
    row: the server's on SQLite, the database's on PostgreSQL), the same value whether the entry
    comes back from `append` or from `read_since`
    (`test_an_entry_carries_its_commit_time_alike_from_append_and_read_since`). None only for an
    entry the pipeline planned and no backend stamped yet.
    """

    clock: int
    op_id: str | None
    op: dict[str, Any]
    committed_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"clock": self.clock, "op_id": self.op_id}
        if self.committed_at is not None:
            body["committed_at"] = self.committed_at
        body["op"] = self.op
        return body


@dataclass(frozen=True, slots=True)
class SubDocHead:
    """A written sub-doc as a listing shows it: its head clock, when that op committed (epoch
    seconds, on the committing server's clock) and its horizon (`OpLogStore.horizon`: the lowest
    clock still in its log)."""

    sub_doc: str
    clock: int
    committed_at: float
    horizon: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "sub_doc": self.sub_doc,
            "clock": self.clock,
            "committed_at": self.committed_at,
            "horizon": self.horizon,
        }


@dataclass(frozen=True, slots=True)
class Compaction:
    """What one `OpLogStore.compact` batch did: `deleted` op rows (with their op_id records),
    and where the next batch of the same pass starts (`resume`, a `(workspace_id, sub_doc)` to
    pass back as `start`; None: every sub-doc was visited, the pass is over)."""

    deleted: int
    resume: tuple[str, str] | None


@dataclass(frozen=True, slots=True)
class OpLogStats:
    """The size of the log as `/metrics` shows it (docs/observability.md): `op_rows` (exact on
    SQLite, the planner's estimate on PostgreSQL: see `estimated`) and when the oldest op still
    in the log committed (epoch seconds; None when the log is empty)."""

    op_rows: int
    oldest_committed_at: float | None
    estimated: bool = False
