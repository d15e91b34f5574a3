"""How fast can one writer that awaits each durable ack go on this disk, whatever the server?

    python -m bench.durable_floor [--commits N] [--rounds R] [--no-peer] [--database-url DSN]

Issue 4 asks ours (durable) to match ShareDB 7 on its in-memory database with one writer awaiting
each ack. That writer's every op needs one durable commit before its ack, and nothing can be
batched: the next op is not sent before the ack. So the durable engine's own commit rate, with no
network, no parsing and no SDK around it, bounds any server built on it. This measures, in one
run on the bench's own disk (a temporary directory):

- `write(4 KiB) + fdatasync`, appending and overwriting: what the disk gives a log;
- SQLite, WAL, `synchronous=FULL` (our embedded default): `BEGIN IMMEDIATE; INSERT; COMMIT` in a
  loop on one connection;
- PostgreSQL (`synchronous_commit` as the server has it): one `INSERT` per transaction over
  asyncpg on loopback, one connection;
- ShareDB 7, memory database, 1 writer / 1 doc (`shared/peers/sharedb-bench.js`), whole round
  trips over its websocket.

Best of `--rounds` rounds for the engines (each round after a warm-up of the same size), so a
burst of load from other jobs lowers the floor's figure, never raises it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import asyncpg  # type: ignore[import-untyped]

from bench._client_peer import find_peer, run_peer
from bench.pg_instances import DEFAULT_DSN, fresh_schema, pg_setting, with_schema

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
_PAGE: Final = b"x" * 4096


def fdatasync_us(directory: Path, count: int, *, overwrite: bool) -> float:
    """p50 µs of one 4 KiB write plus fdatasync, appending to a file or overwriting its first
    100 pages in turn."""
    path = directory / ("overwrite.bin" if overwrite else "append.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if overwrite:
            for _ in range(100):
                os.write(fd, _PAGE)
            os.fsync(fd)
        times = []
        for i in range(count):
            if overwrite:
                os.lseek(fd, (i % 100) * len(_PAGE), os.SEEK_SET)
            began = time.perf_counter()
            os.write(fd, _PAGE)
            os.fdatasync(fd)
            times.append(time.perf_counter() - began)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1e6


def sqlite_commits_per_s(directory: Path, count: int) -> float:
    """One-row durable commits per second on a fresh SQLite file (WAL, synchronous=FULL)."""
    path = directory / "floor.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, op TEXT NOT NULL)")
        row = ("x" * 120,)  # about one `node.increment` op's text
        rate = 0.0
        for _ in range(2):  # the first round grows the WAL file; the second reuses it
            began = time.perf_counter()
            for _ in range(count):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO t (op) VALUES (?)", row)
                conn.execute("COMMIT")
            rate = count / (time.perf_counter() - began)
        return rate
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


def postgres_commits_per_s(dsn: str, count: int) -> float:
    """One-row commits per second on one asyncpg connection (autocommit: one transaction each)."""

    async def run() -> float:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE TABLE t (id bigserial PRIMARY KEY, op text NOT NULL)")
            rate = 0.0
            for _ in range(2):
                began = time.perf_counter()
                for _ in range(count):
                    await conn.execute("INSERT INTO t (op) VALUES ($1)", "x" * 120)
                rate = count / (time.perf_counter() - began)
            return rate
        finally:
            await conn.close()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.durable_floor", description=__doc__)
    parser.add_argument("--commits", type=int, default=3000, help="commits per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="do not run ShareDB")
    parser.add_argument("--database-url", default=DEFAULT_DSN)
    args = parser.parse_args(argv)

    print(
        f"durable floor: python {sys.version.split()[0]}; {os.cpu_count()} cores;"
        f" load {os.getloadavg()[0]:.1f}; {args.commits:,} commits x {args.rounds} rounds",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="cv-bench-floor-") as tmp:
        directory = Path(tmp)
        append = fdatasync_us(directory, args.commits, overwrite=False)
        overwrite = fdatasync_us(directory, args.commits, overwrite=True)
        print(
            f"disk      4 KiB write + fdatasync p50: append {append:.0f} us, overwrite"
            f" {overwrite:.0f} us",
            flush=True,
        )
        sqlite_rate = max(sqlite_commits_per_s(directory, args.commits) for _ in range(args.rounds))
    print(
        f"SQLite    WAL, synchronous=FULL, 1 row per commit: {sqlite_rate:,.0f} commits/s"
        f" ({1e6 / sqlite_rate:.0f} us each)",
        flush=True,
    )
    pg_rate: float | None = None
    try:
        setting = pg_setting(args.database_url, "synchronous_commit")
        rates = []
        for _ in range(args.rounds):
            with fresh_schema(args.database_url) as schema:
                rates.append(
                    postgres_commits_per_s(with_schema(args.database_url, schema), args.commits)
                )
        pg_rate = max(rates)
        print(
            f"Postgres  synchronous_commit={setting}, 1 row per commit over loopback:"
            f" {pg_rate:,.0f} commits/s ({1e6 / pg_rate:.0f} us each)",
            flush=True,
        )
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"Postgres  skipped: {exc}")
    peer = "--no-peer given" if args.no_peer else find_peer(REPO_ROOT)
    if isinstance(peer, str):
        print(f"ShareDB   skipped: {peer}")
        return 0
    figures = run_peer(peer, ops=10_000, writers=1, subs=0, docs=1)
    if figures.error:
        print(f"ShareDB   failed: {figures.error}")
        return 1
    print(
        f"ShareDB   {figures.version} memory DB, 1 writer awaiting each ack:"
        f" {figures.ops_per_s:,.0f} ops/s ({1e6 / figures.ops_per_s:.0f} us per round trip)"
    )
    print()
    ratio = sqlite_rate / figures.ops_per_s
    print(f"SQLite's bare commit loop / ShareDB's whole round trip: {ratio:.2f}x")
    if pg_rate is not None:
        print(
            f"PostgreSQL's bare commit loop / ShareDB's whole round trip:"
            f" {pg_rate / figures.ops_per_s:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
