"""Storage faults as answers (docs/operating.md, "Storage faults"; docs/problems.md).

A full disk, a read-only database file or a PostgreSQL that refuses writes is not a bug of the
request that met it: the write is refused whole, nothing of it is kept, and it may succeed once
the operator makes room. Each backend translates its driver's fault into `StorageUnavailable`
(SQLite in `cv_server/sqlite/engine.py`, PostgreSQL by `cv_server/pg/errors.py`'s
`storage_fault`), the HTTP layer answers it `503 storage_unavailable` with `Retry-After`, and
`StorageFaults` remembers that a write was refused so `/readyz` can say so until a write
succeeds again. This module is a leaf: it imports nothing of the server but the error root.
"""

from __future__ import annotations

import threading
from typing import Final

from cv_server.errors import CvServerError

__all__ = ["STORAGE_UNAVAILABLE", "StorageFaults", "StorageUnavailable"]

#: The problem code of a write refused for storage (docs/problems.md).
STORAGE_UNAVAILABLE: Final = "storage_unavailable"


class StorageUnavailable(CvServerError):
    """The database refused a write for storage (disk full, read-only, I/O error): nothing of it
    was kept, and the same write may succeed later. Answered 503 `storage_unavailable`."""

    code: Final = STORAGE_UNAVAILABLE


class StorageFaults:
    """Whether the last write the backend tried was refused for storage, and how many were.

    Thread-safe: the SQLite writer thread records its outcomes here, the event loop reads them.
    `refused()` after a refusal, `wrote()` after a write reached disk: `fault` is the reason of
    the last refusal not yet followed by a successful write (None when writes work), which
    `/readyz` reports (tests/server/http/test_storage_faults_http.py).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fault: str | None = None
        self._refusals = 0

    def refused(self, reason: str) -> None:
        with self._lock:
            self._fault = reason or "the database refused a write"
            self._refusals += 1

    def wrote(self) -> None:
        with self._lock:
            self._fault = None

    @property
    def fault(self) -> str | None:
        return self._fault

    @property
    def refusals(self) -> int:
        """Writes refused for storage since start (`cv_storage_writes_refused_total`)."""
        return self._refusals
