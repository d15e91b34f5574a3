"""The PostgreSQL backend (DESIGN §9, issue 7): several `cv-server` processes share one database.

Needs the `postgres` extra (asyncpg). Connections carry the DESIGN §10 guards (`pool`), the schema
is versioned (`migrations`), transactions retry serialization failures only (`retry`), and
instances tell each other about commits with LISTEN/NOTIFY (`notifier`). Stores: `oplog`.
"""

from cv_server.pg.errors import MigrationError, NotifyPayloadTooLarge, PostgresBackendError
from cv_server.pg.migrations import Migration, applied_versions, load_migrations, migrate
from cv_server.pg.notifier import NOTIFY_PAYLOAD_LIMIT, Notifier, Subscription, notify
from cv_server.pg.oplog import (
    OPLOG_CHANNEL,
    OpLogCorrupted,
    PostgresOpLogStore,
    oplog_payload,
    parse_oplog_payload,
)
from cv_server.pg.pool import PostgresSettings, connect, create_pool
from cv_server.pg.retry import (
    RETRYABLE_SQLSTATES,
    SerializationRetryPolicy,
    in_transaction,
    is_retryable,
    run_with_retry,
)

__all__ = [
    "NOTIFY_PAYLOAD_LIMIT",
    "OPLOG_CHANNEL",
    "RETRYABLE_SQLSTATES",
    "Migration",
    "MigrationError",
    "Notifier",
    "NotifyPayloadTooLarge",
    "OpLogCorrupted",
    "PostgresBackendError",
    "PostgresOpLogStore",
    "PostgresSettings",
    "SerializationRetryPolicy",
    "Subscription",
    "applied_versions",
    "connect",
    "create_pool",
    "in_transaction",
    "is_retryable",
    "load_migrations",
    "migrate",
    "notify",
    "oplog_payload",
    "parse_oplog_payload",
    "run_with_retry",
]
