"""Connections to PostgreSQL: a pool for transactions, single connections for LISTEN.

Every connection carries the PostgreSQL session guards (docs/postgres.md) as session settings, so a
mistake that holds a transaction open or runs a runaway statement is killed by the server instead of
silently pinning a connection and its row locks:

- `statement_timeout` 5 s,
- `idle_in_transaction_session_timeout` 10 s.

`schema` puts one schema first on the `search_path`, so every unqualified table name resolves
there: tests isolate themselves in a fresh schema, and a deployment may keep cv-workspace's tables
out of `public`.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

__all__ = [
    "PostgresSettings",
    "close_pool",
    "connect",
    "connection_settings",
    "create_pool",
    "is_valid_schema_name",
]

_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def is_valid_schema_name(name: str) -> bool:
    """A lower-case identifier PostgreSQL accepts unquoted (so it can be interpolated safely)."""
    return _SCHEMA_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class PostgresSettings:
    """Session guards (docs/configuration.md, docs/postgres.md) and pool bounds. Tests may shrink
    the timeouts."""

    statement_timeout_seconds: float = 5.0
    idle_in_transaction_session_timeout_seconds: float = 10.0
    #: Schema searched first for unqualified names; None keeps the server's default path.
    schema: str | None = None
    #: Pool bounds (asyncpg's defaults): a deployment knob, not a documented constant.
    pool_min_size: int = 10
    pool_max_size: int = 10
    application_name: str = "cv-server"
    #: Plan every execution of a prepared statement for its parameters (see `connection_settings`).
    plan_cache_mode: str | None = "force_custom_plan"

    def __post_init__(self) -> None:
        if self.schema is not None and not is_valid_schema_name(self.schema):
            raise ValueError(f"invalid schema name {self.schema!r}")


def _millis(seconds: float) -> str:
    return str(round(seconds * 1000))


def connection_settings(settings: PostgresSettings) -> dict[str, str]:
    """The `server_settings` every connection is opened with (applied at connect, no round trip)."""
    server_settings = {
        "statement_timeout": _millis(settings.statement_timeout_seconds),
        "idle_in_transaction_session_timeout": _millis(
            settings.idle_in_transaction_session_timeout_seconds
        ),
        "application_name": settings.application_name,
    }
    if settings.schema is not None:
        server_settings["search_path"] = settings.schema
    if settings.plan_cache_mode is not None:
        # asyncpg prepares and caches every statement. After five executions PostgreSQL may
        # switch to a generic plan costed on the table as it was then: planned while the op-log
        # was nearly empty, a dedupe lookup kept its sequential scan as the table grew (20 ms per
        # lookup instead of 0.1 ms, measured). Our statements are tiny to plan; re-planning is
        # the cheap, robust choice.
        server_settings["plan_cache_mode"] = settings.plan_cache_mode
    return server_settings


async def _init_connection(conn: asyncpg.Connection) -> None:
    # JSON columns travel as Python objects; the codec lives in the driver, not at every call site.
    for type_name in ("json", "jsonb"):
        await conn.set_type_codec(
            type_name,
            encoder=_dumps,
            decoder=json.loads,
            schema="pg_catalog",
        )


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def create_pool(dsn: str, settings: PostgresSettings | None = None) -> asyncpg.Pool:
    """Open a pool whose every connection carries the guards and search path of `settings`."""
    settings = settings or PostgresSettings()
    pool = await asyncpg.create_pool(
        dsn,
        min_size=settings.pool_min_size,
        max_size=settings.pool_max_size,
        server_settings=connection_settings(settings),
        init=_init_connection,
    )
    assert pool is not None  # create_pool only returns None when awaited without a DSN loop bug
    return pool


async def close_pool(pool: asyncpg.Pool, timeout: float) -> None:  # noqa: ASYNC109
    """Close `pool` gracefully within `timeout` seconds, else terminate it.

    A graceful close waits for every connection to be released and for the server to see each
    one end: on a dead path (a half-open connection after a failover, a firewall that dropped
    the flow) that never comes, and the server's shutdown hung on it past any deadline.
    Terminated, the sockets are closed here and PostgreSQL ends the sessions by itself."""
    try:
        await asyncio.wait_for(pool.close(), timeout)
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        pool.terminate()


async def connect(dsn: str, settings: PostgresSettings | None = None) -> asyncpg.Connection:
    """One connection outside any pool (LISTEN needs a connection nobody else borrows)."""
    settings = settings or PostgresSettings()
    conn: asyncpg.Connection = await asyncpg.connect(
        dsn, server_settings=connection_settings(settings)
    )
    await _init_connection(conn)
    return conn
