"""The claim's cost with concurrency keys against without, directly on the store (no HTTP).

    .venv/bin/python -m bench.queue_keys [--backend sqlite|postgres] [--database-url URL]
                                         [--jobs 2000] [--held 5000] [--batch 16] [--dir DIR]

Each mode starts from a fresh database (SQLite file under `--dir`, or a fresh PostgreSQL schema
dropped afterwards) holding `--jobs` claimable requests, then one claimer drains them — first
one claim + complete at a time, then `claim_many` + `complete_many` of `--batch` — timing the
claim calls alone (µs per claimed request) and the whole drain (jobs/s):

- `no key`: requests without a concurrency key (what every claim paid before keys existed);
- `keys, never full`: each request with one of 100 keys and a limit no key reaches, so every
  keyed row pays its key's count (PostgreSQL: and the key's advisory lock);
- `keys, N held ahead`: `--held` requests of one key whose single slot is taken sit ahead of the
  drained (unkeyed) requests, so every claim walks past them (docs/queue.md, "Concurrency keys":
  no head-of-line blocking, at the cost of that walk).

Speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]

from cv_server.config import ServerConfig
from cv_server.pg import PostgresSettings, create_pool, migrate
from cv_server.pg.queue import PostgresQueueStore
from cv_server.queue import Completion, EnqueueAsk, NewRequest, QueueStore, random_request_id
from cv_server.sqlite import queue as queue_sqlite
from cv_server.sqlite.engine import SQLiteDatabase
from cv_server.sqlite.queue import SQLiteQueueStore

CONFIG = ServerConfig()
STAGE = "noop"
CHUNK = 1000
KEYS = 100

#: A mode: (name, the request for index i of the drained backlog, how many held rows go first).
Mode = tuple[str, Callable[[int], NewRequest], int]


def _request(i: int, key: str | None = None, limit: int | None = None) -> NewRequest:
    return NewRequest(
        workspace_id="ws",
        stage=STAGE,
        request_id=random_request_id(secrets.token_hex(20)),
        input={"i": i},
        concurrency_key=key,
        max_running_per_key=limit,
    )


@asynccontextmanager
async def sqlite_store(directory: str | None) -> AsyncIterator[QueueStore]:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        db = await SQLiteDatabase.open(Path(tmp) / "bench.db", schema=queue_sqlite.create_schema)
        try:
            yield SQLiteQueueStore(db)
        finally:
            await db.close()


@asynccontextmanager
async def postgres_store(url: str) -> AsyncIterator[QueueStore]:
    schema = f"cv_bench_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(url)
    await conn.execute(f"CREATE SCHEMA {schema}")
    await conn.close()
    pool = await create_pool(url, PostgresSettings(schema=schema, pool_min_size=1))
    try:
        await migrate(pool)
        store = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        yield store
        await store.close()
    finally:
        await pool.close()
        conn = await asyncpg.connect(url)
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await conn.close()


async def fill(store: QueueStore, requests: list[NewRequest], at: float) -> None:
    for start in range(0, len(requests), CHUNK):
        chunk = [EnqueueAsk(r) for r in requests[start : start + CHUNK]]
        await store.enqueue_many(chunk, at)


async def drain(store: QueueStore, jobs: int, batch: int) -> tuple[float, float]:
    """Claim and complete `jobs` requests, `batch` at a time; return (µs per claimed request
    spent in the claim calls, jobs per second of the whole drain)."""
    claiming = 0.0
    began = time.perf_counter()
    done = 0
    while done < jobs:
        take = min(batch, jobs - done)
        t0 = time.perf_counter()
        rows = await store.claim_many(STAGE, "bench", CONFIG.lease_seconds, None, limit=take)
        claiming += time.perf_counter() - t0
        if len(rows) != take:
            raise RuntimeError(f"expected {take} claimable requests, got {len(rows)}")
        await store.complete_many(
            [Completion(r.request_id, r.claim_token or "") for r in rows], None
        )
        done += take
    return claiming / jobs * 1e6, jobs / (time.perf_counter() - began)


async def run_mode(
    open_store: Callable[[], AbstractAsyncContextManager[QueueStore]],
    mode: Mode,
    jobs: int,
    batch: int,
) -> None:
    name, make, held = mode
    for size in (1, batch):
        async with open_store() as store:
            now = await store.clock()
            if held:
                # One key, one slot, taken: every request of it is held back, ahead of the rest.
                hot = [_request(-i, "hot", 1) for i in range(held + 1)]
                await fill(store, hot, now - 10)
                taken = await store.claim(STAGE, "holder", 3600.0, None)
                if taken is None or taken.concurrency_key != "hot":
                    raise RuntimeError(f"expected to hold the hot key, got {taken!r}")
            await fill(store, [make(i) for i in range(jobs)], now - 5)
            micros, rate = await drain(store, jobs, size)
            print(
                f"  {name:<26} batch {size:>3}: claim {micros:>7,.0f} µs/request,"
                f" {rate:>7,.0f} jobs/s"
            )


async def main(args: argparse.Namespace) -> None:
    held = args.held
    modes: list[Mode] = [
        ("no key", lambda i: _request(i), 0),
        ("keys, never full", lambda i: _request(i, f"k{i % KEYS}", 1_000_000), 0),
        (f"keys, {held:,} held ahead", lambda i: _request(i), held),
    ]
    if args.backend == "sqlite":

        def open_store() -> AbstractAsyncContextManager[QueueStore]:
            return sqlite_store(args.dir)
    else:
        if not args.database_url:
            raise SystemExit("--backend postgres needs --database-url")

        def open_store() -> AbstractAsyncContextManager[QueueStore]:
            return postgres_store(args.database_url)

    print(f"{args.backend}: {args.jobs:,} requests drained by one claimer per mode")
    for mode in modes:
        await run_mode(open_store, mode, args.jobs, args.batch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--held", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--dir", default=None, help="where the SQLite file goes (a tmpfs makes fsync free)"
    )
    asyncio.run(main(parser.parse_args()))
