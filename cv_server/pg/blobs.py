"""Result blobs on PostgreSQL (`surface_result_blobs`, bytea, 24 h expiry).

Tables come from `migrations/005_request_blobs.sql`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.queue.blobs import BlobStore, new_blob_ref
from cv_server.queue.idempotency import check_sweep_limit

__all__ = ["TABLE", "PostgresBlobStore"]

TABLE: Final = "request_blobs"

_PUT: Final = (
    f"INSERT INTO {TABLE} (workspace_id, blob_ref, data, size, created_at, expires_at)"
    " VALUES ($1, $2, $3, $4, $5, $6)"
)
_GET: Final = (
    f"SELECT data FROM {TABLE} WHERE workspace_id = $1 AND blob_ref = $2 AND expires_at > $3"
)
_SIZE: Final = (
    f"SELECT size FROM {TABLE} WHERE workspace_id = $1 AND blob_ref = $2 AND expires_at > $3"
)
_SWEEP: Final = f"""
DELETE FROM {TABLE} b USING (
    SELECT workspace_id, blob_ref FROM {TABLE} WHERE expires_at <= $1 LIMIT $2
    FOR UPDATE SKIP LOCKED
) dead
WHERE (b.workspace_id, b.blob_ref) = (dead.workspace_id, dead.blob_ref)
"""


def _random_ref() -> str:
    return new_blob_ref(secrets.token_hex(20))


class PostgresBlobStore(BlobStore):
    """`BlobStore` on a PostgreSQL pool whose schema has `005_request_blobs` applied.

    `retention` is `ServerConfig.blob_retention_seconds` (24 h, docs/configuration.md).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        retention: float,
        new_ref: Callable[[], str] = _random_ref,
    ) -> None:
        if not (math.isfinite(retention) and retention > 0):
            raise ValueError(f"retention must be a positive finite number: {retention!r}")
        self._pool = pool
        self._retention = retention
        self._new_ref = new_ref

    async def put(self, workspace_id: str, data: bytes, now: float) -> str:
        blob_ref = self._new_ref()
        payload = bytes(data)
        async with self._pool.acquire() as conn:
            await conn.execute(
                _PUT, workspace_id, blob_ref, payload, len(payload), now, now + self._retention
            )
        return blob_ref

    async def get(self, workspace_id: str, blob_ref: str, now: float) -> bytes | None:
        async with self._pool.acquire() as conn:
            data = await conn.fetchval(_GET, workspace_id, blob_ref, now)
        return None if data is None else bytes(data)

    async def size(self, workspace_id: str, blob_ref: str, now: float) -> int | None:
        async with self._pool.acquire() as conn:
            size = await conn.fetchval(_SIZE, workspace_id, blob_ref, now)
        return None if size is None else int(size)

    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        check_sweep_limit(limit)
        async with self._pool.acquire() as conn:
            status: str = await conn.execute(_SWEEP, now, limit)  # LIMIT NULL: no limit
        return int(status.rsplit(" ", 1)[1])

    async def close(self) -> None:
        """Nothing to do: the pool belongs to whoever opened it."""
