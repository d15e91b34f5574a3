"""Server-wide settings in PostgreSQL (`migrations/002_server_meta.sql`): the token secret.

Every instance of a scale-out deployment must sign and check bearer tokens with the same secret,
and `cv-server token --database-url` must mint tokens they accept, so the secret lives in the
shared database, created once by whoever asks first.
"""

from __future__ import annotations

from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.auth import new_secret

__all__ = ["postgres_token_secret", "stored_token_secret"]

_TOKEN_SECRET_KEY: Final = "token_secret"

_CREATE: Final = "INSERT INTO server_meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING"
_READ: Final = "SELECT value FROM server_meta WHERE key = $1"


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
