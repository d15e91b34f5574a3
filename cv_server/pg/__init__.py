"""The PostgreSQL backend (docs/postgres.md, issue 7): several `cv-server` processes share one
database.

Needs the `postgres` extra (asyncpg). Connections carry the PostgreSQL session guards (`pool`), the
schema is versioned (`migrations`), transactions retry serialization failures only (`retry`), and
instances tell each other about commits with LISTEN/NOTIFY (`notifier`). Stores: `oplog`,
`queue`, `locks`, `idempotency`, `blobs`; `stores.open_postgres_stores` opens them all for one
server instance.
"""

from cv_server.pg.blobs import PostgresBlobStore
from cv_server.pg.errors import MigrationError, NotifyPayloadTooLarge, PostgresBackendError
from cv_server.pg.idempotency import PostgresIdempotencyStore
from cv_server.pg.locks import PostgresComputeLockStore
from cv_server.pg.meta import TOKEN_SECRET_CHANNEL
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
from cv_server.pg.queue import QUEUE_CHANNEL, PostgresQueueStore
from cv_server.pg.retry import (
    RETRYABLE_SQLSTATES,
    SerializationRetryPolicy,
    in_transaction,
    is_retryable,
    run_with_retry,
)
from cv_server.pg.stores import (
    NotSetUp,
    SchemaMissing,
    SetUp,
    open_postgres_stores,
    read_token_secret,
    rotate_token_secret,
    set_up_deployment,
)

__all__ = [
    "NOTIFY_PAYLOAD_LIMIT",
    "OPLOG_CHANNEL",
    "QUEUE_CHANNEL",
    "RETRYABLE_SQLSTATES",
    "TOKEN_SECRET_CHANNEL",
    "Migration",
    "MigrationError",
    "NotSetUp",
    "Notifier",
    "NotifyPayloadTooLarge",
    "OpLogCorrupted",
    "PostgresBackendError",
    "PostgresBlobStore",
    "PostgresComputeLockStore",
    "PostgresIdempotencyStore",
    "PostgresOpLogStore",
    "PostgresQueueStore",
    "PostgresSettings",
    "SchemaMissing",
    "SerializationRetryPolicy",
    "SetUp",
    "Subscription",
    "applied_versions",
    "connect",
    "create_pool",
    "in_transaction",
    "is_retryable",
    "load_migrations",
    "migrate",
    "notify",
    "open_postgres_stores",
    "oplog_payload",
    "parse_oplog_payload",
    "read_token_secret",
    "rotate_token_secret",
    "run_with_retry",
    "set_up_deployment",
]
