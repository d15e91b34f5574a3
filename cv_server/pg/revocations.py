"""Token revocations in PostgreSQL (`migrations/011_token_revocations.sql`;
cv_server/revocations.py).

A revocation NOTIFYs `REVOCATIONS_CHANNEL` (scoped to the schema) in its own transaction:
every instance reads the new entries when told, so a revoked token is refused everywhere
within a notification's delay; the bounded poll covers a notification lost while an instance's
LISTEN connection was away. The payload carries nothing a listener could misuse.
"""

from __future__ import annotations

from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.pg.notifier import notify
from cv_server.queue.idempotency import check_sweep_limit
from cv_server.revocations import Revocation, RevocationStore

__all__ = ["REVOCATIONS_CHANNEL", "PostgresRevocationStore", "revoke_token"]

#: Base name of the channel that announces a revocation (`stores.channel_name` adds the schema).
REVOCATIONS_CHANNEL: Final = "cv_token_revoked"

_INSERT: Final = (
    "INSERT INTO token_revocations (token_id, expires_at) VALUES ($1, $2)"
    " ON CONFLICT (token_id) DO NOTHING"
)
_SINCE: Final = (
    "SELECT seq, token_id, expires_at FROM token_revocations WHERE seq > $1 ORDER BY seq"
)
_SWEEP: Final = (
    "DELETE FROM token_revocations WHERE seq IN"
    " (SELECT seq FROM token_revocations WHERE expires_at <= $1 LIMIT $2)"
)


async def revoke_token(
    pool: asyncpg.Pool, channel: str, token_id: str, expires_at: int | None
) -> bool:
    """Record the revocation and announce it on `channel`, in one transaction (told at commit,
    never before the entry is readable); False if it was revoked already."""
    async with pool.acquire() as conn, conn.transaction():
        status = await conn.execute(_INSERT, token_id, expires_at)
        if status != "INSERT 0 1":
            return False
        await notify(conn, channel, "revoked")
    return True


class PostgresRevocationStore(RevocationStore):
    """`RevocationStore` on a migrated pool."""

    def __init__(self, pool: asyncpg.Pool, *, channel: str) -> None:
        self._pool = pool
        self._channel = channel

    async def revoke(self, token_id: str, expires_at: int | None) -> bool:
        return await revoke_token(self._pool, self._channel, token_id, expires_at)

    async def revoked_since(self, seq: int) -> list[Revocation]:
        rows = await self._pool.fetch(_SINCE, seq)
        return [
            Revocation(
                int(r["seq"]),
                str(r["token_id"]),
                None if r["expires_at"] is None else int(r["expires_at"]),
            )
            for r in rows
        ]

    async def sweep(self, now: float, *, limit: int) -> int:
        check_sweep_limit(limit)
        status = await self._pool.execute(_SWEEP, int(now), limit)
        return int(status.split()[-1])
