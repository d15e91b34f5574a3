"""Which backend serves a configuration: PostgreSQL (scale-out) when it names a database URL,
else the embedded SQLite file. The stores' seam (`Stores`, `DatabaseUnusable`) is
`cv_server/stores.py`, re-exported here; each backend opens its stores in its own `stores.py`.
"""

from __future__ import annotations

from cv_server.config import ServerConfig
from cv_server.sqlite.stores import open_sqlite_stores
from cv_server.stores import DatabaseUnusable, FollowCommits, FollowSecret, Stores

__all__ = ["DatabaseUnusable", "FollowCommits", "FollowSecret", "Stores", "open_stores"]


async def open_stores(config: ServerConfig) -> Stores:
    """Every store of one server, on the backend `config` names. Raises `DatabaseUnusable` for
    a database the backend cannot serve."""
    if config.database_url:
        # Imported here: asyncpg is needed only where PostgreSQL is used (the `postgres` extra).
        from cv_server.pg.stores import open_postgres_stores

        return await open_postgres_stores(config)
    if config.db_path is None:
        raise ValueError("ServerConfig needs db_path (SQLite) or database_url (PostgreSQL)")
    return await open_sqlite_stores(config)
