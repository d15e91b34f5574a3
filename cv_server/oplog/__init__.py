"""The op-log: dedupe, commit, read back (docs/concepts.md)."""

from cv_server.oplog.store import (
    Committed,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStore,
    Outcome,
    Rejected,
    SubDocHead,
)

__all__ = [
    "Committed",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStore",
    "Outcome",
    "Rejected",
    "SubDocHead",
]
