"""Opening every store of one server instance on PostgreSQL (docs/postgres.md, issue 7).

One pool for transactions, one dedicated LISTEN connection (`Notifier`) shared by the op-log,
the queue and the token secret, migrations applied at start under the advisory lock, the token
secret read from (or created in) `server_meta` and read again whenever it is rotated. The
schema comes from the DSN's `search_path` (for example `?options=-csearch_path%3Dname`, or
`cv-server serve --schema name`); it must exist.

Notification channels are per database, not per schema, so each channel name carries the schema:
deployments (and test runs) that share a database in separate schemas never wake each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Final, NamedTuple

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.config import ServerConfig
from cv_server.pg import meta
from cv_server.pg.blobs import PostgresBlobStore
from cv_server.pg.errors import PostgresBackendError, PostgresRefused
from cv_server.pg.errors import storage_fault as pg_storage_fault
from cv_server.pg.idempotency import PostgresIdempotencyStore
from cv_server.pg.locks import PostgresComputeLockStore
from cv_server.pg.meta import (
    TOKEN_SECRET_CHANNEL,
    postgres_token_secret,
    replace_token_secret,
    stored_token_secret,
)
from cv_server.pg.migrations import migrate
from cv_server.pg.notifier import Notifier, reconnect_delays
from cv_server.pg.oplog import OPLOG_CHANNEL, PostgresOpLogStore, parse_oplog_payload
from cv_server.pg.pool import PostgresSettings, close_pool, create_pool
from cv_server.pg.queue import QUEUE_CHANNEL, PostgresQueueStore
from cv_server.pg.revocations import REVOCATIONS_CHANNEL, PostgresRevocationStore, revoke_token
from cv_server.pg.schedules import PostgresScheduleStore
from cv_server.storage_faults import StorageFaults, StorageUnavailable
from cv_server.stores import DatabaseUnusable, Stores, translating

__all__ = [
    "NotSetUp",
    "SchemaMissing",
    "SetUp",
    "channel_name",
    "listen_application_name",
    "open_postgres_stores",
    "read_token_secret",
    "revoke_token_in",
    "rotate_token_secret",
    "set_up_deployment",
]

logger = logging.getLogger(__name__)

#: The opening verbs' server errors (`asyncpg.PostgresError`), as `PostgresRefused`: callers
#: that open or set up a deployment (the CLI, the app's start-up) never import asyncpg.
_refusals_translated = translating(asyncpg.PostgresError, PostgresRefused)


#: How long a commit notification waits before it reaches the hub (see `follow_commits`): a
#: delivery delay for other instances' ops, traded for not re-reading the log on our own.
OWN_PUBLISH_GRACE_SECONDS: Final = 0.005

#: PostgreSQL truncates identifiers (channel names included) at 63 bytes.
_MAX_CHANNEL_BYTES: Final = 63


class SchemaMissing(PostgresBackendError, DatabaseUnusable):
    """The DSN's search_path names no schema that exists: create it first."""

    code = "schema_missing"


def channel_name(base: str, schema: str) -> str:
    """`base` scoped to `schema`; a schema too long for the identifier limit is hashed."""
    name = f"{base}_{schema}"
    if len(name.encode("utf-8")) <= _MAX_CHANNEL_BYTES:
        return name
    return f"{base}_{hashlib.sha256(schema.encode('utf-8')).hexdigest()[:24]}"


def listen_application_name(queue: PostgresQueueStore) -> str:
    """The `application_name` of an instance's LISTEN connection (see `pg_stat_activity`)."""
    return f"cv-server-listen-{queue.instance_id}"


async def _current_schema(pool: asyncpg.Pool) -> str:
    schema = await pool.fetchval("SELECT current_schema()")
    if schema is None:
        search_path = await pool.fetchval("SHOW search_path")
        raise SchemaMissing(f"no schema of search_path {search_path!r} exists; create it first")
    return str(schema)


async def _prepared_pool(dsn: str, settings: PostgresSettings) -> tuple[asyncpg.Pool, str]:
    """A pool on a migrated database, and the schema it works in."""
    pool = await create_pool(dsn, settings)
    try:
        schema = await _current_schema(pool)
        await migrate(pool)
    except BaseException:
        await pool.close()
        raise
    return pool, schema


class NotSetUp(PostgresBackendError, DatabaseUnusable):
    """The database holds no cv-server deployment (no token secret): `cv-server init` first."""

    code = "not_set_up"


class SetUp(NamedTuple):
    """What `set_up_deployment` did: the schema, and whether it held no deployment before."""

    schema: str
    created: bool


@_refusals_translated
async def set_up_deployment(dsn: str) -> SetUp:
    """Migrate the database at `dsn` and create its token secret unless it has one, as an
    instance does at start (`cv-server init`). Idempotent."""
    pool, schema = await _prepared_pool(dsn, PostgresSettings(pool_min_size=1, pool_max_size=1))
    try:
        # Read first for the report only: of two `init`s at once, both may say "set up", and
        # both end with the one secret `postgres_token_secret` keeps.
        created = await stored_token_secret(pool) is None
        await postgres_token_secret(pool)
    finally:
        await pool.close()
    return SetUp(schema, created)


@_refusals_translated
async def read_token_secret(dsn: str) -> bytes:
    """The token secret of the deployment at `dsn`, for `cv-server token`: read only. Raises
    `NotSetUp` where there is none, and creates nothing: a mistyped DSN never gets tables, a
    secret or a token no instance accepts (pinned by
    `test_token_reads_a_deployment_and_sets_none_up_where_there_is_none`)."""
    pool = await create_pool(dsn, PostgresSettings(pool_min_size=1, pool_max_size=1))
    try:
        schema = await _current_schema(pool)
        secret = await stored_token_secret(pool)
    finally:
        await pool.close()
    if secret is None:
        raise NotSetUp(
            f"schema {schema!r} holds no cv-server deployment: run `cv-server init` with this"
            " --database-url first (an instance's start sets it up too)"
        )
    return secret


@_refusals_translated
async def rotate_token_secret(dsn: str) -> str:
    """Replace the token secret of the deployment at `dsn` with a new one, for `cv-server
    rotate-secret`; returns the schema. Every running instance is told (NOTIFY, at commit) and
    refuses tokens of the old secret from then on. Raises `NotSetUp` where there is no secret:
    like `token`, a rotation never sets up a deployment in whatever a mistyped DSN names."""
    pool = await create_pool(dsn, PostgresSettings(pool_min_size=1, pool_max_size=1))
    try:
        schema = await _current_schema(pool)
        rotated = await replace_token_secret(pool, channel_name(TOKEN_SECRET_CHANNEL, schema))
    finally:
        await pool.close()
    if not rotated:
        raise NotSetUp(
            f"schema {schema!r} holds no cv-server deployment, so no token secret to rotate"
            " (a mistyped --database-url or --schema?)"
        )
    return schema


@_refusals_translated
async def revoke_token_in(dsn: str, token_id: str, expires_at: int | None) -> tuple[str, bool]:
    """Revoke `token_id` in the deployment at `dsn` (`cv-server token revoke`); returns the
    schema and whether it was new. Every running instance is told at commit (NOTIFY). Raises
    `NotSetUp` where there is no deployment: a mistyped DSN gets no table."""
    pool = await create_pool(dsn, PostgresSettings(pool_min_size=1, pool_max_size=1))
    try:
        schema = await _current_schema(pool)
        if await stored_token_secret(pool) is None:
            raise NotSetUp(f"schema {schema!r} holds no cv-server deployment: nothing to revoke")
        channel = channel_name(REVOCATIONS_CHANNEL, schema)
        try:
            created = await revoke_token(pool, channel, token_id, expires_at)
        except asyncpg.UndefinedTableError:
            raise NotSetUp(
                f"schema {schema!r} predates token revocation: start this cv-server on it once"
                " (or run `cv-server init`) to migrate it"
            ) from None
    finally:
        await pool.close()
    return schema, created


class _SecretFollower:
    """Reads the stored token secret again each time `wake` is called, and hands it on.

    One reading task: wakes that come during a read make one more read, so the last value
    handed on is never older than the last wake. A read that fails (the database away) is
    retried on the notifier's reconnect schedule: until it succeeds, the instance would keep
    accepting tokens of a secret that may have leaked.
    """

    def __init__(
        self, pool: asyncpg.Pool, delays: Callable[[], Iterator[float]] = reconnect_delays
    ) -> None:
        self._pool = pool
        self._delays = delays
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, on_secret: Callable[[bytes], None]) -> None:
        self._task = asyncio.create_task(self._run(on_secret), name="pg-token-secret")

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, on_secret: Callable[[bytes], None]) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()  # before the read: a wake during it reads once more
            secret = await self._read()
            if secret is None:  # the row was deleted by hand: keep checking with the last one
                logger.error("server_meta holds no token secret; the last one read stays in use")
                continue
            on_secret(secret)

    async def _read(self) -> bytes | None:
        delays = self._delays()
        while True:
            try:
                return await stored_token_secret(self._pool)
            except Exception as exc:
                delay = next(delays)
                logger.warning("reading the token secret failed (%r); retry in %.2fs", exc, delay)
                await asyncio.sleep(delay)


@_refusals_translated
async def open_postgres_stores(config: ServerConfig) -> Stores:
    """Every store of one instance, sharing one pool and one LISTEN connection."""
    if not config.database_url:
        raise ValueError("ServerConfig.database_url is required for the PostgreSQL backend")
    dsn = config.database_url
    settings = PostgresSettings()
    pool, schema = await _prepared_pool(dsn, settings)
    queue = PostgresQueueStore(pool, channel=channel_name(QUEUE_CHANNEL, schema))
    # Named after the instance, so an operator (or a test) can tell the listeners apart.
    notifier = Notifier(
        dsn,
        PostgresSettings(application_name=listen_application_name(queue)),
        check_every=config.sweep_seconds,
    )
    oplog_channel = channel_name(OPLOG_CHANNEL, schema)
    try:
        await notifier.start()
        oplog = PostgresOpLogStore(
            pool,
            snapshot_every=config.snapshot_every,
            channel=oplog_channel,
            max_group_ops=config.max_ops_per_request,
            cache_limit=config.subdoc_cache_limit,
            retention_seconds=config.oplog_retention_seconds,
            skew_seconds=config.minted_at_skew_seconds,
            queue=queue,  # an apply's `enqueue` commits with its ops (docs/queue.md)
        )
        await queue.listen(notifier)
        secret = config.token_secret or await postgres_token_secret(pool)
    except BaseException:
        await notifier.close()
        await pool.close()
        raise
    idempotency = PostgresIdempotencyStore(pool, retention=config.idempotency_retention_seconds)
    blobs = PostgresBlobStore(pool, retention=config.blob_retention_seconds)
    locks = PostgresComputeLockStore(pool)
    secret_follower = _SecretFollower(pool)
    revocations_channel = channel_name(REVOCATIONS_CHANNEL, schema)
    revocations = PostgresRevocationStore(pool, channel=revocations_channel)

    async def follow_revocations(on_revoked: Callable[[], None]) -> None:
        """Call `on_revoked()` whenever a token may have been revoked by any instance or by
        `cv-server token revoke` (NOTIFY), or such news may have been lost (reconnect)."""
        await notifier.listen(revocations_channel, lambda _payload: on_revoked(), on_revoked)
        on_revoked()  # LISTEN is active: one revoked before it is read now

    async def follow_secret(on_secret: Callable[[bytes], None]) -> None:
        """Call `on_secret(secret)` with the stored secret each time it may have changed."""
        secret_follower.start(on_secret)
        await notifier.listen(
            channel_name(TOKEN_SECRET_CHANNEL, schema),
            lambda _payload: secret_follower.wake(),
            secret_follower.wake,  # the LISTEN connection was away: a rotation may be unheard
        )
        # LISTEN is active now: a rotation since the read at start is no longer missed, but
        # one before it was, so read once more.
        secret_follower.wake()

    async def follow_commits(
        on_head: Callable[[str, str, int], None], on_reconnect: Callable[[], None]
    ) -> None:
        """Tell `on_head(ws, sub_doc, clock)` of every commit (ours included: a subscriber that
        already has it ignores it), and `on_reconnect()` when notifications may have been lost."""

        loop = asyncio.get_running_loop()

        def on_payload(payload: str) -> None:
            try:
                workspace_id, sub_doc, clock = parse_oplog_payload(payload)
            except ValueError:
                logger.warning("ignoring a malformed op-log notification %r", payload[:200])
                return
            # Our own commits are announced too, and their notification usually arrives a few
            # event-loop turns before the handler that committed publishes them: handled at
            # once, it would send every subscriber to the log for ops already on their way.
            # A short grace lets our publish land first: a subscriber that already has the
            # head then ignores it.
            loop.call_later(OWN_PUBLISH_GRACE_SECONDS, on_head, workspace_id, sub_doc, clock)

        await notifier.listen(oplog_channel, on_payload, on_reconnect)

    faults = StorageFaults()

    def storage_fault(exc: BaseException) -> StorageUnavailable | None:
        fault = pg_storage_fault(exc)
        if fault is not None and fault is not exc:
            faults.refused(str(fault))
        return fault

    return Stores(
        faults=faults,
        storage_fault=storage_fault,
        probe_write=functools.partial(meta.probe_write, pool),
        oplog=oplog,
        queue=queue,
        idempotency=idempotency,
        blobs=blobs,
        locks=locks,
        revocations=revocations,
        schedules=PostgresScheduleStore(pool),
        secret=secret,
        follow_commits=follow_commits,
        follow_secret=follow_secret,
        follow_revocations=follow_revocations,
        # Closed in reverse: the stores first (finishing queued appends), the secret's reader,
        # then the LISTEN connection, the pool last.
        _closers=[
            # Bounded like a statement: on a dead path a graceful close never ends (and with
            # it the server's shutdown); past the bound the pool is terminated.
            functools.partial(close_pool, pool, settings.statement_timeout_seconds),
            notifier.close,
            secret_follower.close,
            locks.close,
            blobs.close,
            idempotency.close,
            queue.close,
            oplog.close,
        ],
    )
