"""The cost of one page of `GET /v1/workspaces/{ws}/docs` on SQLite, against the log's size.

Run: `.venv/bin/python -m bench.sub_doc_listing [--docs 5000] [--ops 10 100] [--rounds 5]`

For each `--ops` (ops per sub-doc), a fresh SQLite file holds two workspaces of `--docs` sub-docs
each, then the listing's first and last pages of 1000 are read straight from the store
(`SQLiteOpLogStore.list_sub_docs`, through its reader thread), its SQL alone on a connection of
the bench's own, and for reference the plain `GROUP BY sub_doc` it avoids. Its SQL seeks a few
times per listed sub-doc (a loose index scan), so a page costs the same however long each
sub-doc's log is; the `GROUP BY` reads every op of the page's sub-docs, which is cheaper for
short logs and grows with them.
The best of `--rounds` reads is kept (a shared machine's noise only ever adds).
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cv_server.sqlite.oplog import _LIST_SUB_DOCS, OPS_TABLE, SQLiteOpLogStore

__all__ = ["main"]

PAGE = 1000
_GROUP_BY = (
    f"SELECT sub_doc, max(clock) FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc > ?"
    " GROUP BY sub_doc ORDER BY sub_doc LIMIT ?"
)


def _fill(path: Path, docs: int, ops: int) -> None:
    conn = sqlite3.connect(path)
    rows = (
        (f"ws{w}", f"doc-{d:06d}", clock, None, "{}", "fp", 0)
        for w in range(2)
        for d in range(docs)
        for clock in range(1, ops + 1)
    )
    conn.executemany(
        f"INSERT INTO {OPS_TABLE}"
        " (workspace_id, sub_doc, clock, op_id, op, fingerprint, committed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    conn.commit()
    conn.close()


def _best_ms(rounds: int, read: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - started)
    return best * 1000


async def _run(docs: int, ops: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "oplog.db"
        store = await SQLiteOpLogStore.open(path)  # creates the schema
        await store.close()
        _fill(path, docs, ops)
        store = await SQLiteOpLogStore.open(path)
        conn = sqlite3.connect(path)
        try:
            last_after = f"doc-{max(0, docs - PAGE - 1):06d}"
            for name, after in (("first page", None), ("last page", last_after)):
                timings = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    page = await store.list_sub_docs("ws1", after=after, limit=PAGE)
                    timings.append(time.perf_counter() - started)
                assert len(page) == min(PAGE, docs), len(page)
                listed_ms = min(timings) * 1000

                def query(sql: str, after: str | None = after) -> Callable[[], object]:
                    return lambda: conn.execute(sql, ("ws1", after or "", PAGE)).fetchall()

                loose = _best_ms(rounds, query(_LIST_SUB_DOCS))
                group_by = _best_ms(rounds, query(_GROUP_BY))
                print(
                    f"{docs} sub-docs x {ops:>4} ops, {name}: list_sub_docs {listed_ms:6.1f} ms"
                    f" (its SQL alone {loose:5.1f} ms)   GROUP BY {group_by:7.1f} ms"
                )
        finally:
            conn.close()
            await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0] if __doc__ else None)
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--ops", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for ops in args.ops:
        asyncio.run(_run(args.docs, ops, args.rounds))


if __name__ == "__main__":
    main()
