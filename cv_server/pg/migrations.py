"""Versioned SQL migrations, applied at start by every server instance (issue 7).

Files live beside this module in `migrations/NNN_name.sql`, one per feature, applied in version
order. `migrate(pool)` runs in **one** transaction that first takes `pg_advisory_xact_lock` on a
fixed key: instances starting together queue on that lock, and each one that gets it sees the
versions its predecessors recorded in `schema_migrations`, so every migration runs exactly once.
The lock is transaction-scoped, so a crashed migrator cannot leave it held.

A migration already applied must not change: its checksum is recorded and compared, because an
edited file would otherwise leave databases that ran the old text silently different.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.pg.errors import MigrationError

__all__ = ["MIGRATION_LOCK_KEY", "Migration", "applied_versions", "load_migrations", "migrate"]

#: The advisory lock every migrator takes ("cv-migr" in ASCII): one fixed key per database.
MIGRATION_LOCK_KEY: Final = 0x63_76_2D_6D_69_67_72

_FILE_NAME: Final = re.compile(r"(\d{3})_([a-z0-9_]+)\.sql")

_CREATE_TABLE: Final = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations() -> list[Migration]:
    """The migrations shipped with the package, in version order."""
    folder = resources.files("cv_server.pg") / "migrations"
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        match = _FILE_NAME.fullmatch(entry.name)
        if match is None:
            continue
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share version {version:03d}")
        found[version] = Migration(version, match.group(2), entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


async def applied_versions(conn: asyncpg.Connection) -> list[int]:
    """The versions recorded in `schema_migrations` (empty if the table does not exist yet)."""
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return []
    rows = await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
    return [int(row["version"]) for row in rows]


async def migrate(pool: asyncpg.Pool, migrations: list[Migration] | None = None) -> list[int]:
    """Apply the migrations this database lacks; return the versions this call applied.

    Safe to call from many instances at once (see the module docstring).
    """
    migrations = load_migrations() if migrations is None else migrations
    applied: list[int] = []
    async with pool.acquire() as conn, conn.transaction():
        # Migrations are DDL run once at start, possibly behind another instance holding the
        # lock: the per-statement guard is meant for request-path transactions, not for them.
        await conn.execute("SET LOCAL statement_timeout = 0")
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
        await conn.execute(_CREATE_TABLE)
        rows = await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
        recorded = {int(row["version"]): (row["name"], row["checksum"]) for row in rows}
        for migration in migrations:
            if migration.version in recorded:
                name, checksum = recorded[migration.version]
                if checksum != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.version:03d}_{name} changed after it was applied"
                    )
                continue
            try:
                await conn.execute(migration.sql)
            except asyncpg.PostgresError as exc:
                raise MigrationError(
                    f"migration {migration.version:03d}_{migration.name} failed: {exc}"
                ) from exc
            await conn.execute(
                "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                migration.version,
                migration.name,
                migration.checksum,
            )
            applied.append(migration.version)
    return applied
