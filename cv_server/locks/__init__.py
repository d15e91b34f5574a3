"""compute_lock, layer 2: one expensive call per `(workspace_id, job_id, task)` (docs/stages.md)."""

from cv_server.locks.store import (
    Acquired,
    AcquireOutcome,
    ComputeLockStore,
    Locked,
    LockInfo,
)

__all__ = ["AcquireOutcome", "Acquired", "ComputeLockStore", "LockInfo", "Locked"]
