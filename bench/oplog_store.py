"""Op-log store throughput, straight on `SQLiteOpLogStore` (no HTTP), durable (WAL, FULL).

Run: `.venv/bin/python -m bench.oplog_store [--writers 64] [--ops 300] [--batch 100] [--rounds 3]`

Scenarios, each on a fresh SQLite file in a temporary directory, `--writers` concurrent tasks:

- single-op: each task appends `--ops` ops, one `append` per op;
- batched: each task appends `--batches` batches of `--batch` ops;
- engine floor: the single-op scenario with each job inserting one row into a bare table: the
  rate of the shared writer itself, which no store on it can beat (a same-run reference, because
  on a shared machine a ratio holds where an absolute figure does not).

Ops are parsed and fingerprinted before the clock starts: this measures the store, not pydantic.
Every op carries an op_id (the SDK always sends one), so every append pays the dedupe lookup.
The inputs are frozen out of the garbage collector while timing (as a server's start-up objects
would be). Besides wall-clock ops/s, each line gives the process CPU time per op (all threads),
which other load on the machine disturbs much less. The best of `--rounds` rounds is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server.oplog import IncomingOp
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.oplog import SQLiteOpLogStore

__all__ = ["main"]


@dataclass(frozen=True)
class Result:
    ops: int
    appends: int
    wall: float
    cpu: float
    groups: int

    def line(self, name: str) -> str:
        return (
            f"{name:<32} {self.ops:>6} ops {self.ops / self.wall:>9,.0f} ops/s"
            f"  {self.cpu / self.ops * 1e6:6.1f} us CPU/op"
            f"  {self.appends / self.groups:5.1f} appends/commit"
        )


def _op(writer: int) -> IncomingOp:
    raw: dict[str, Any] = {
        "type": "node.increment",
        "op_id": new_op_id(),
        "node_id": "root",
        "field": f"w{writer}",
        "by": 1,
    }
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


async def _timed(
    db: SQLiteDatabase, writers: list[Callable[[], Awaitable[None]]], ops: int, appends: int
) -> Result:
    groups = db.groups_committed
    # The prepared inputs are long-lived, like a server's start-up objects: keep them out of the
    # collector's full passes, which would otherwise be charged to the store.
    gc.collect()
    gc.freeze()
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(writer() for writer in writers))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gc.unfreeze()
    return Result(ops, appends, wall, cpu, db.groups_committed - groups)


async def _store_run(path: Path, per_writer: list[list[list[IncomingOp]]]) -> Result:
    store = await SQLiteOpLogStore.open(path)
    try:

        def writer(batches: list[list[IncomingOp]]) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                for batch in batches:
                    await store.append("bench", "tree", batch)

            return run

        ops = sum(len(batch) for batches in per_writer for batch in batches)
        appends = sum(len(batches) for batches in per_writer)
        result = await _timed(store.db, [writer(b) for b in per_writer], ops, appends)
        assert await store.head("bench", "tree") == ops
        return result
    finally:
        await store.close()


async def _engine_run(path: Path, writers: int, jobs: int) -> Result:
    def schema(db: sqlite_utils.Database) -> None:
        db.table("rows").create({"id": int, "body": str}, pk="id", if_not_exists=True)

    body = "x" * 100  # about the size of an op's row

    def job(tx: Transaction) -> None:
        tx.execute("INSERT INTO rows (body) VALUES (?)", (body,))

    db = await SQLiteDatabase.open(path, schema=schema)
    try:

        async def writer() -> None:
            for _ in range(jobs):
                await db.write(job)

        return await _timed(db, [writer] * writers, writers * jobs, writers * jobs)
    finally:
        await db.close()


def _best(results: list[Result]) -> Result:
    return max(results, key=lambda r: r.ops / r.wall)


async def _main(args: argparse.Namespace) -> None:
    single, batched, floor = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            ops = [[[_op(w)] for _ in range(args.ops)] for w in range(args.writers)]
            single.append(await _store_run(Path(tmp) / f"single-{round_}.db", ops))
            ops = [
                [[_op(w) for _ in range(args.batch)] for _ in range(args.batches)]
                for w in range(args.writers)
            ]
            batched.append(await _store_run(Path(tmp) / f"batched-{round_}.db", ops))
            floor.append(
                await _engine_run(Path(tmp) / f"floor-{round_}.db", args.writers, args.ops)
            )
    print(_best(single).line(f"single-op, {args.writers} writers"))
    print(_best(batched).line(f"batches of {args.batch}, {args.writers} writers"))
    print(_best(floor).line(f"engine floor, {args.writers} writers"))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--writers", type=int, default=64)
    parser.add_argument("--ops", type=int, default=300, help="single-op appends per writer")
    parser.add_argument("--batch", type=int, default=100, help="ops per batch")
    parser.add_argument("--batches", type=int, default=10, help="batches per writer")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
