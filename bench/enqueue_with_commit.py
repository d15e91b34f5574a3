"""Enqueue with the commit, straight on the SQLite stores (no HTTP), durable (WAL, FULL): what
one transaction for an apply and its work costs against the two calls it replaces.

Run: `.venv/bin/python -m bench.enqueue_with_commit [--writers 16] [--applies 200] [--rounds 3]`

Scenarios, each on a fresh SQLite file in a temporary directory, `--writers` concurrent tasks,
each doing `--applies` applies of one op (with an op_id) that each need one stage run:

- two calls: `append`, then `enqueue_many` of the one request (two writer jobs per apply, and a
  crash between them leaves the change without its work);
- one commit: `append_enqueuing` (one writer job per apply, docs/queue.md#start-work-with-the-
  change-that-needs-it).

Each line gives applies/s and the process CPU time per apply (all threads); the best of
`--rounds` rounds is kept. Inputs are prepared before the clock starts.
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

import sqlite_utils

from bench.oplog_store import _op
from cv_server.oplog import IncomingOp
from cv_server.queue.model import EnqueueAsk, NewRequest, random_request_id
from cv_server.sqlite import oplog, queue
from cv_server.sqlite.engine import SQLiteDatabase

__all__ = ["main"]

WS, DOC = "bench", "tree"
#: One apply: its ops and the requests it needs.
Work = tuple[list[IncomingOp], list[EnqueueAsk]]


@dataclass(frozen=True)
class Result:
    applies: int
    wall: float
    cpu: float

    def line(self, name: str) -> str:
        return (
            f"{name:<28} {self.applies:>6} applies {self.applies / self.wall:>8,.0f} applies/s"
            f"  {self.cpu / self.applies * 1e6:6.1f} us CPU/apply"
        )


def _schema(db: sqlite_utils.Database) -> None:
    oplog.create_schema(db)
    queue.create_schema(db)


def _ask(n: int) -> EnqueueAsk:
    return EnqueueAsk(NewRequest(WS, "evaluate", random_request_id(f"{n:040x}"), input={"n": n}))


async def _run(path: Path, writers: int, applies: int, together: bool) -> Result:
    db = await SQLiteDatabase.open(path, schema=_schema)
    requests = queue.SQLiteQueueStore(db)
    log = oplog.SQLiteOpLogStore(db, queue=requests)
    work: list[list[Work]] = [
        [([_op(w)], [_ask(w * applies + i)]) for i in range(applies)] for w in range(writers)
    ]

    def writer(items: list[Work]) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            for ops, asks in items:
                if together:
                    await log.append_enqueuing(WS, DOC, ops, asks)
                else:
                    await log.append(WS, DOC, ops)
                    await requests.enqueue_many(asks, now=None)

        return run

    try:
        gc.collect()
        gc.freeze()
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(writer(items)() for items in work))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        gc.unfreeze()
        assert await log.head(WS, DOC) == writers * applies
        assert len(await requests.list(workspace_id=WS, limit=writers * applies)) == (
            writers * applies
        )
        return Result(writers * applies, wall, cpu)
    finally:
        await log.close()
        await requests.close()
        await db.close()


async def _main(args: argparse.Namespace) -> None:
    two: list[Result] = []
    one: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            two.append(
                await _run(Path(tmp) / f"two-{round_}.db", args.writers, args.applies, False)
            )
            one.append(await _run(Path(tmp) / f"one-{round_}.db", args.writers, args.applies, True))
    best = max(two, key=lambda r: r.applies / r.wall)
    print(best.line(f"two calls, {args.writers} writers"))
    best = max(one, key=lambda r: r.applies / r.wall)
    print(best.line(f"one commit, {args.writers} writers"))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--applies", type=int, default=200, help="applies per writer")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
