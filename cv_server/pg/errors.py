"""The PostgreSQL backend's exceptions: one hierarchy, each with a stable string `code`.

Driver errors that callers must branch on are translated here (STYLE: eventsourcing), so code
above the backend never imports asyncpg to understand what went wrong. The errors that mean
"this database cannot be served" (refused, not migrated, not set up) are also the seam's
`DatabaseUnusable`, which `cv-server` reports in one line whichever backend raised it.
"""

from __future__ import annotations

from typing import Final

from cv_server.errors import CvServerError
from cv_server.storage_faults import StorageUnavailable
from cv_server.stores import DatabaseUnusable

__all__ = [
    "STORAGE_SQLSTATES",
    "MigrationError",
    "NotifyPayloadTooLarge",
    "PostgresBackendError",
    "PostgresRefused",
    "storage_fault",
]

#: SQLSTATEs that mean "the storage refuses writes", not "this write is wrong": disk_full
#: (53100), insufficient_resources (53000), read_only_sql_transaction (25006: a standby, or
#: `default_transaction_read_only` set on the database or role), io_error (58030). Each is
#: answered 503 `storage_unavailable` (docs/problems.md).
STORAGE_SQLSTATES: Final = frozenset({"53100", "53000", "25006", "58030"})


def storage_fault(exc: BaseException) -> StorageUnavailable | None:
    """`exc` as a `StorageUnavailable` (the driver's error chained) if PostgreSQL refused it for
    storage, else None. Duck-typed on `sqlstate`, as asyncpg's errors carry it, so the seam
    never imports the driver (tests/server/http/test_storage_faults_http.py)."""
    if isinstance(exc, StorageUnavailable):
        return exc
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate not in STORAGE_SQLSTATES:
        return None
    fault = StorageUnavailable(f"PostgreSQL refused the write ({sqlstate}): {exc}")
    fault.__cause__ = exc
    return fault


class PostgresBackendError(CvServerError):
    """Base of every error the PostgreSQL backend raises on purpose."""

    code: str = "postgres_error"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message


class MigrationError(PostgresBackendError, DatabaseUnusable):
    """The migration files are inconsistent (duplicate or malformed versions) or one failed."""

    code = "migration_failed"


class NotifyPayloadTooLarge(PostgresBackendError):
    """A NOTIFY payload reaches PostgreSQL's 8000-byte limit: send ids and clocks, not bodies."""

    code = "notify_payload_too_large"


class PostgresRefused(PostgresBackendError, DatabaseUnusable):
    """PostgreSQL refused to open or set up a deployment: no such database or role, no right to
    create the tables, a bad setting. The message is the server's own; `cv-server` prints it in
    one line and exits (pinned by
    `test_a_postgresql_database_role_or_schema_that_is_missing_is_one_line`)."""

    code = "postgres_refused"
