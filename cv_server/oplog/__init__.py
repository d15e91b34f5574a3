"""The op-log: dedupe, commit, read back (docs/concepts.md)."""

from cv_server.oplog.store import AppendEnqueued, OpLogStore
from cv_server.oplog.values import (
    Committed,
    Compaction,
    Forgotten,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStats,
    Outcome,
    Rejected,
    SubDocHead,
)

__all__ = [
    "AppendEnqueued",
    "Committed",
    "Compaction",
    "Forgotten",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStats",
    "OpLogStore",
    "Outcome",
    "Rejected",
    "SubDocHead",
]
