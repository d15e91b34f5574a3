"""Server-wide settings in PostgreSQL (`migrations/002_server_meta.sql`): the token secret.

Every instance of a scale-out deployment must sign and check bearer tokens with the same secret,
and `cv-server token --database-url` must mint tokens they accept, so the secret lives in the
shared database, created once by whoever asks first.

`cv-server rotate-secret` replaces it and NOTIFYs `TOKEN_SECRET_CHANNEL` (scoped to the schema)
in the same transaction: each instance re-reads the secret when told, and whenever its LISTEN
connection comes back (a notification may have been lost meanwhile). The payload never carries
the secret: any role that can connect to the database may LISTEN.
"""

from __future__ import annotations

from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.auth import new_secret
from cv_server.pg.notifier import notify

__all__ = [
    "TOKEN_SECRET_CHANNEL",
    "postgres_token_secret",
    "probe_write",
    "replace_token_secret",
    "stored_token_secret",
]

_TOKEN_SECRET_KEY: Final = "token_secret"

#: Base name of the channel that announces a new token secret (`stores.channel_name` adds the
#: schema).
TOKEN_SECRET_CHANNEL: Final = "cv_token_secret"

_CREATE: Final = "INSERT INTO server_meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING"
_READ: Final = "SELECT value FROM server_meta WHERE key = $1"
_REPLACE: Final = "UPDATE server_meta SET value = $2 WHERE key = $1"
_PROBE: Final = (
    "INSERT INTO server_meta (key, value) VALUES ('write_probe', $1)"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


async def probe_write(pool: asyncpg.Pool) -> None:
    """One small committed write (a `write_probe` row of its own, which nothing reads): it
    succeeds only while PostgreSQL takes writes (`/readyz` after a storage fault)."""
    await pool.execute(_PROBE, new_secret())


async def postgres_token_secret(pool: asyncpg.Pool) -> bytes:
    """The secret stored in the database, created if there is none (atomically: of instances
    starting together, one insert wins and every one of them reads the winner's value)."""
    async with pool.acquire() as conn:
        # Two statements on purpose: the insert of a loser waits for the winner's commit, and
        # the read that follows takes a fresh snapshot (READ COMMITTED) that sees it.
        await conn.execute(_CREATE, _TOKEN_SECRET_KEY, new_secret())
        value = await conn.fetchval(_READ, _TOKEN_SECRET_KEY)
    return bytes(value)


async def stored_token_secret(pool: asyncpg.Pool) -> bytes | None:
    """The secret stored in the database, or None when it holds none (no `server_meta` table
    yet, or no secret in it): read only, for `cv-server token`, which must not set up a
    deployment in whatever database a mistyped DSN names."""
    try:
        value = await pool.fetchval(_READ, _TOKEN_SECRET_KEY)
    except asyncpg.UndefinedTableError:
        return None
    return None if value is None else bytes(value)


async def replace_token_secret(pool: asyncpg.Pool, channel: str) -> bool:
    """Replace the stored secret with a new one and announce it on `channel`, in one
    transaction: instances are told at its commit, never before the new value is readable, and
    not at all if it rolls back. False (nothing written) when there is no secret to replace:
    a rotation never sets up a deployment."""
    async with pool.acquire() as conn, conn.transaction():
        try:
            status = await conn.execute(_REPLACE, _TOKEN_SECRET_KEY, new_secret())
        except asyncpg.UndefinedTableError:
            return False
        if status != "UPDATE 1":
            return False
        await notify(conn, channel, "rotated")
    return True
