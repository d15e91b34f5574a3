"""The op-log: dedupe, commit, read back (DESIGN §3, §4)."""

from cv_server.oplog.store import (
    Committed,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStore,
    Outcome,
    Rejected,
)

__all__ = [
    "Committed",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStore",
    "Outcome",
    "Rejected",
]
