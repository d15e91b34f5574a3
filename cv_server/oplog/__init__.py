"""The op-log: dedupe, commit, read back (docs/concepts.md)."""

from cv_server.oplog.store import OpLogStore
from cv_server.oplog.values import (
    Committed,
    Forgotten,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    Outcome,
    Rejected,
    SubDocHead,
)

__all__ = [
    "Committed",
    "Forgotten",
    "IncomingOp",
    "LogEntry",
    "OpLogCorrupted",
    "OpLogStore",
    "Outcome",
    "Rejected",
    "SubDocHead",
]
