"""Claim + complete throughput of the SQLite queue store on a large backlog, directly on the store.

    .venv/bin/python -m bench.queue_store [--backlog 40000] [--drain 5000] [--or-drain 300]
                                          [--concurrency 8] [--batch 16] [--dir DIR]

Proves the claim walks its partial indexes: it prints the EXPLAIN QUERY PLAN of every claim
probe, then drains part of a `--backlog`-row backlog (the backlog never drops below it during the
measurement) on the same database file, at `synchronous=FULL`:

- `store, 1 claimer`: one task doing claim → complete, one commit (one fsync) each;
- `store, N claimers`: N tasks at once, so the writer's group commit shares fsyncs;
- `store, N claimers x batches`: `claim_many` + `complete_many`, one commit per batch;
- `one OR query`: the single-statement claim peers use ("pending and available OR lease lapsed"
  under one ORDER BY), with 1 and N claimers, for the ratio; its plan is printed too. It sorts the
  whole backlog per claim, so it drains only `--or-drain` jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import sqlite_utils

from cv_server.config import ServerConfig
from cv_server.queue import Completion, NewRequest, deterministic_request_id
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.queue import CLAIM_PROBES, TABLE, SQLiteQueueStore

CONFIG = ServerConfig()
STAGE = "noop"
ENQUEUE_CHUNK = 1000

#: The claim peers write: one statement, one ORDER BY over two OR-ed conditions.
OR_CLAIM = (
    f"UPDATE {TABLE} SET status = 'in_progress', claim_token = ?, claimed_by = ?, claimed_at = ?, "
    "lease_expires_at = ? + ?, dequeue_count = dequeue_count + 1 "
    f"WHERE request_id = (SELECT request_id FROM {TABLE} WHERE worker_class = ? AND "
    "((status = 'pending' AND available_at <= ?) "
    "OR (status = 'in_progress' AND lease_expires_at < ?))"
    " AND dequeue_count < max_dequeues ORDER BY created_at LIMIT 1) RETURNING request_id"
)


def schema(db: sqlite_utils.Database) -> None:
    queue_sqlite.create_schema(db)


async def fill(store: SQLiteQueueStore, count: int, start: int) -> float:
    """Enqueue `count` requests; return enqueues per second."""
    began = time.perf_counter()
    for chunk in range(start, start + count, ENQUEUE_CHUNK):
        now = time.time()
        await asyncio.gather(
            *(
                store.enqueue(
                    NewRequest(
                        workspace_id="ws",
                        stage=STAGE,
                        request_id=deterministic_request_id("ws", f"job-{i}", None, STAGE),
                        input={"i": i},
                        job_id=f"job-{i}",
                    ),
                    now,
                )
                for i in range(chunk, min(chunk + ENQUEUE_CHUNK, start + count))
            )
        )
    return count / (time.perf_counter() - began)


async def drain_with_store(store: SQLiteQueueStore, jobs: int, concurrency: int) -> float:
    """Claim and complete `jobs` requests with `concurrency` tasks; return jobs per second."""
    remaining = jobs

    async def worker(name: str) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            row = await store.claim(STAGE, name, CONFIG.lease_seconds, time.time())
            if row is None or row.claim_token is None:
                raise RuntimeError("the backlog ran dry: raise --backlog")
            await store.complete(row.request_id, row.claim_token, None, time.time())

    began = time.perf_counter()
    await asyncio.gather(*(worker(f"w{i}") for i in range(concurrency)))
    return jobs / (time.perf_counter() - began)


async def drain_in_batches(
    store: SQLiteQueueStore, jobs: int, concurrency: int, batch: int
) -> float:
    """Claim `batch` at a time and complete them in one call; return jobs per second."""
    remaining = jobs

    async def worker(name: str) -> None:
        nonlocal remaining
        while remaining > 0:
            take = min(batch, remaining)
            remaining -= take
            rows = await store.claim_many(
                STAGE, name, CONFIG.lease_seconds, time.time(), limit=take
            )
            if len(rows) != take:
                raise RuntimeError("the backlog ran dry: raise --backlog")
            done = [Completion(row.request_id, row.claim_token or "") for row in rows]
            await store.complete_many(done, time.time())

    began = time.perf_counter()
    await asyncio.gather(*(worker(f"w{i}") for i in range(concurrency)))
    return jobs / (time.perf_counter() - began)


async def drain_with_or_query(
    db: SQLiteDatabase, store: SQLiteQueueStore, jobs: int, concurrency: int
) -> float:
    """The same drain, claiming with the single OR-ed statement."""
    remaining = jobs
    tokens = iter(range(jobs))

    def claim(token: str) -> Callable[[Transaction], str]:
        def job(tx: Transaction) -> str:
            now = time.time()
            (request_id,) = tx.execute(
                OR_CLAIM, (token, "w", now, now, CONFIG.lease_seconds, STAGE, now, now)
            ).fetchone()
            return str(request_id)

        return job

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            token = f"or-{next(tokens)}"
            request_id = await db.write(claim(token))
            await store.complete(request_id, token, None, time.time())

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return jobs / (time.perf_counter() - began)


#: The row-picking part of `OR_CLAIM`, alone, to time it against the store's probes.
OR_PICK = OR_CLAIM[OR_CLAIM.index("(SELECT") + 1 : OR_CLAIM.index(") RETURNING")]


def probe_micros(conn: sqlite3.Connection, rounds: int) -> tuple[float, float]:
    """Microseconds to find the next row to claim: the store's two probes vs the OR query.

    No commit, no fsync: the cost of picking the row, which is what an index decides.
    """
    now = time.time()
    began = time.perf_counter()
    for _ in range(rounds):
        conn.execute(CLAIM_PROBES["pending"], (STAGE, now, 1)).fetchone()
        conn.execute(CLAIM_PROBES["lapsed"], (STAGE, now, 1)).fetchone()
    probes = (time.perf_counter() - began) / rounds * 1e6
    began = time.perf_counter()
    for _ in range(rounds):
        conn.execute(OR_PICK, (STAGE, now, now)).fetchone()
    naive = (time.perf_counter() - began) / rounds * 1e6
    return probes, naive


def plans(conn: sqlite3.Connection) -> dict[str, list[str]]:
    found = {}
    for name, sql in {**CLAIM_PROBES, "one OR query": OR_CLAIM}.items():
        rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", ["x"] * sql.count("?")).fetchall()
        found[name] = [str(row[3]) for row in rows]
    return found


async def timed(label: str, run: Awaitable[float]) -> float:
    rate = await run
    print(f"  {label:<48} {rate:>9,.0f} jobs/s")
    return rate


async def main(
    backlog: int, drain: int, or_drain: int, concurrency: int, batch: int, directory: str | None
) -> None:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        db = await SQLiteDatabase.open(Path(tmp) / "bench.db", schema=schema)
        try:
            store = SQLiteQueueStore(db)
            # The backlog stays >= `backlog` throughout the measurement.
            total = backlog + 3 * drain + 2 * or_drain
            rate = await fill(store, total, 0)
            print(f"enqueued {total:,} requests at {rate:,.0f}/s (chunks of {ENQUEUE_CHUNK})")
            print("EXPLAIN QUERY PLAN")
            for name, steps in (await db.read(plans)).items():
                for step in steps:
                    print(f"  {name:<22} {step}")
            probes, naive = await db.read(lambda conn: probe_micros(conn, 200))
            print(
                f"picking the next row, backlog {total:,}: store probes {probes:,.0f} µs, ", end=""
            )
            print(f"one OR query {naive:,.0f} µs ({naive / probes:,.0f}x)")
            print(f"claim + complete, backlog >= {backlog:,}:")
            n = concurrency
            single = await timed(
                f"store, 1 claimer, {drain:,} jobs", drain_with_store(store, drain, 1)
            )
            many = await timed(
                f"store, {n} claimers, {drain:,} jobs", drain_with_store(store, drain, n)
            )
            await timed(
                f"store, {n} claimers x batches of {batch}, {drain:,} jobs",
                drain_in_batches(store, drain, n, batch),
            )
            naive_single = await timed(
                f"one OR query, 1 claimer, {or_drain:,} jobs",
                drain_with_or_query(db, store, or_drain, 1),
            )
            naive_many = await timed(
                f"one OR query, {n} claimers, {or_drain:,} jobs",
                drain_with_or_query(db, store, or_drain, n),
            )
            print(f"store / OR query: {single / naive_single:.1f}x with 1 claimer, ", end="")
            print(f"{many / naive_many:.1f}x with {n}")
        finally:
            await db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backlog", type=int, default=40_000)
    parser.add_argument("--drain", type=int, default=5_000)
    parser.add_argument("--or-drain", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--dir", default=None, help="where the database file goes (a tmpfs makes fsync free)"
    )
    args = parser.parse_args()
    asyncio.run(
        main(args.backlog, args.drain, args.or_drain, args.concurrency, args.batch, args.dir)
    )
