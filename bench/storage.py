"""Storage over time: a steady workload with op-log compaction on and off, printing the database
size at intervals (docs/operating.md, "Storage over time").

    .venv/bin/python -m bench.storage --quick                 # SQLite, then PostgreSQL if set
    .venv/bin/python -m bench.storage --seconds 300 --backend sqlite

Time is compressed: the retention is seconds, not days, so a run of a minute or two shows what
a deployment sees over weeks: with compaction on, the size plateaus once the oldest ops pass the
retention; off, it grows with every op. PostgreSQL runs in a fresh schema of
`CV_TEST_DATABASE_URL` (skipped when unset), with the per-table autovacuum settings the docs
recommend; its deleted rows come back only when autovacuum visits (every `autovacuum_naptime`,
one minute by default), so short runs show its plateau late.

Workloads are a list (`WORKLOADS`): each is started with the stores and a rate, and runs until
cancelled. Another workload (queue requests, say) is one more entry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server.backends import open_stores
from cv_server.cli import _with_schema
from cv_server.compaction import compact_once
from cv_server.config import ServerConfig
from cv_server.oplog import IncomingOp
from cv_server.stores import Stores

#: `await workload(stores, ops_per_second)`: writes until cancelled.
Workload = Callable[[Stores, float], Coroutine[Any, Any, None]]

SUB_DOCS = 20
BATCH = 10
PAD = "x" * 200


async def steady_writer(stores: Stores, ops_per_second: float) -> None:
    """Batches of `BATCH` `node.update` ops, round robin over `SUB_DOCS` sub-docs, paced to
    `ops_per_second`."""
    interval = BATCH / ops_per_second
    began = time.monotonic()
    for n in range(1_000_000_000):
        ops = []
        for _ in range(BATCH):
            raw = {"type": "node.update", "node_id": "root", "set": {"pad": PAD}}
            raw["op_id"] = new_op_id()
            ops.append(IncomingOp(parse_op(raw), raw, fingerprint(raw)))
        await stores.oplog.append("bench", f"doc{n % SUB_DOCS}", ops)
        delay = began + (n + 1) * interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


WORKLOADS: list[Workload] = [steady_writer]


@dataclass
class Backend:
    name: str
    config: ServerConfig
    size: Callable[[], Awaitable[int]]
    rows: Callable[[], Awaitable[int]]
    #: Run after each compaction pass: what the database's own maintenance would do meanwhile
    #: (PostgreSQL with autovacuum off: a plain VACUUM of the op tables, as autovacuum would).
    after_pass: Callable[[], Awaitable[None]] | None = None


def _sqlite_rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM workspace_sub_doc_ops").fetchone()[0])


def _sqlite_size(path: Path) -> int:
    """The file once the WAL is folded into it (where SQLite truncates a shrunk file)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


@contextlib.asynccontextmanager
async def sqlite_backend(base: ServerConfig) -> AsyncIterator[Backend]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cv.db"

        async def size() -> int:
            return await asyncio.to_thread(_sqlite_size, path)

        async def rows() -> int:
            return await asyncio.to_thread(_sqlite_rows, path)

        yield Backend("sqlite", replace(base, db_path=path), size, rows)


@contextlib.asynccontextmanager
async def postgres_backend(base: ServerConfig, url: str) -> AsyncIterator[Backend]:
    schema = f"bench_storage_{os.getpid()}_{int(time.time() * 1000) % 1_000_000}"
    admin = await asyncpg.connect(url)
    await admin.execute(f"CREATE SCHEMA {schema}")
    tuned = False

    async def size() -> int:
        nonlocal tuned
        if not tuned and await admin.fetchval(
            "SELECT to_regclass($1)", f"{schema}.workspace_sub_doc_ops"
        ):
            for table in ("workspace_sub_doc_ops", "workspace_sub_doc_op_outcomes"):
                await admin.execute(
                    f"ALTER TABLE {schema}.{table} SET (autovacuum_vacuum_scale_factor = 0.01,"
                    " autovacuum_vacuum_insert_scale_factor = 0.01)"
                )
            tuned = True
        value = await admin.fetchval(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = $1 AND c.relkind = 'r'",
            schema,
        )
        return int(value)

    async def rows() -> int:
        return int(await admin.fetchval(f"SELECT count(*) FROM {schema}.workspace_sub_doc_ops"))

    vacuum: Callable[[], Awaitable[None]] | None = None
    if await admin.fetchval("SHOW autovacuum") == "off":
        print("postgres: autovacuum is off on this server: the bench VACUUMs after each pass")
        vacuumer = await asyncpg.connect(url)

        async def vacuum() -> None:
            for table in ("workspace_sub_doc_ops", "workspace_sub_doc_op_outcomes"):
                await vacuumer.execute(f"VACUUM {schema}.{table}")

    try:
        config = replace(base, database_url=_with_schema(url, schema))
        yield Backend("postgres", config, size, rows, vacuum)
    finally:
        if vacuum is not None:
            await vacuumer.close()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


async def run(backend: Backend, *, seconds: float, every: float, rate: float) -> list[int]:
    """Run every workload for `seconds`, compacting as the server would (when the config's
    retention is not 0); print and return the size every `every` seconds."""
    stores = await open_stores(backend.config)
    config = backend.config
    tasks = [asyncio.create_task(workload(stores, rate)) for workload in WORKLOADS]

    async def compactor() -> None:
        if config.oplog_retention_seconds == 0:
            return
        while True:
            await asyncio.sleep(config.compact_seconds)
            await compact_once(stores, config)
            if backend.after_pass is not None:
                await backend.after_pass()

    tasks.append(asyncio.create_task(compactor()))
    sizes: list[int] = []
    mode = "on " if config.oplog_retention_seconds else "off"
    began = time.monotonic()
    try:
        while (elapsed := time.monotonic() - began) < seconds:
            await asyncio.sleep(every)
            for task in tasks:
                if task.done():
                    task.result()  # a failed workload fails the run
            sizes.append(await backend.size())
            rows = await backend.rows()
            print(
                f"{backend.name:8} compaction {mode} t={elapsed + every:5.0f}s"
                f" size={sizes[-1] / 2**20:8.2f} MiB op rows={rows:8,}",
                flush=True,
            )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await stores.close()
    return sizes


async def _main(args: argparse.Namespace) -> None:
    base = ServerConfig(
        token_secret=b"bench-storage-secret-0123456789ab",
        snapshot_every=100,
        oplog_retention_seconds=args.retention,
        # The bench's ops carry no minted_at; the skew must only stay below the short retention.
        minted_at_skew_seconds=min(ServerConfig().minted_at_skew_seconds, args.retention / 2),
        compact_seconds=args.compact_every,
    )
    url = os.environ.get("CV_TEST_DATABASE_URL")
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    for name in backends:
        if name == "postgres" and not url:
            print("postgres: skipped (set CV_TEST_DATABASE_URL)")
            continue
        for retention in (args.retention, 0.0):
            config = replace(base, oplog_retention_seconds=retention)
            opened = (
                sqlite_backend(config) if name == "sqlite" else postgres_backend(config, url or "")
            )
            async with opened as backend:
                sizes = await run(backend, seconds=args.seconds, every=args.every, rate=args.rate)
            half = sizes[len(sizes) // 2] if sizes else 0
            print(
                f"{name:8} compaction {'on ' if retention else 'off'}"
                f" final={sizes[-1] / 2**20:.2f} MiB, at half time {half / 2**20:.2f} MiB\n",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=300.0, help="per run")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between sizes")
    parser.add_argument("--rate", type=float, default=1000.0, help="ops per second written")
    parser.add_argument("--retention", type=float, default=20.0, help="oplog_retention_seconds")
    parser.add_argument("--compact-every", type=float, default=5.0, help="compact_seconds")
    parser.add_argument("--quick", action="store_true", help="60 s runs, a size every 5 s")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.every = 60.0, 5.0
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
