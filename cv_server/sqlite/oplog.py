"""The op-log on the embedded SQLite engine (docs/concepts.md, docs/postgres.md).

Tables (composed into the server's schema by `create_schema`):

- `workspace_sub_doc_ops`: one row per committed op, keyed by `(workspace_id, sub_doc, clock)`,
  with `op_id` unique per sub-doc (SQLite lets several NULLs through a unique index, so ops
  without op_id need no partial index). `op` is the op as received; `committed_at` is unix
  milliseconds, read once per append, not once per op.
- `workspace_sub_doc_op_rejections`: the recorded reducer rejection of an op_id, so a retry gets
  the same answer even after the state changed.
- `workspace_sub_doc_client_marks`: per lane `(workspace_id, sub_doc, client_id)`, the highest
  `seq` decided (docs/ops.md#exactly-once), written by the append that decides it, in its job.
- `workspace_sub_doc_snapshots`: the latest state snapshot of a sub-doc and its clock. A cache of
  the log that bounds the rebuild after a restart to about `snapshot_every` ops (a snapshot is
  written by each commit that reaches or passes a multiple of it); the head clock is the log's
  max.

The state of each sub-doc touched since start-up is cached (clock, state) and lives on the
writer thread: it is read and changed only inside `SQLiteDatabase.write` jobs, which run one at a
time. An append is one job (look up its op_ids in one query, run the pure pipeline, insert with
`executemany`) and registers an undo with `tx.on_rollback`, so if the job's savepoint or the
group's COMMIT fails the cache is taken back with the disk. Concurrent appends become jobs of one
group transaction: one COMMIT, one fsync for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import orjson
import sqlite_utils

from cv_mutations import SubDocState
from cv_server.config import ServerConfig
from cv_server.oplog.pipeline import (
    Recorded,
    RecordedCommit,
    RecordedRejection,
    copy_state,
    op_ids_to_look_up,
    plan_commit,
    rebuild_from_log,
    snapshot_due,
)
from cv_server.oplog.store import (
    AppendEnqueued,
    Compaction,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStats,
    OpLogStore,
    Outcome,
    SubDocHead,
)
from cv_server.queue.model import EnqueueAsk, RequestEvent, caused_by
from cv_server.shielded import commit_then_announce
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.queue import SQLiteQueueStore, enqueue_rows

__all__ = ["OpLogCorrupted", "SQLiteOpLogStore", "create_schema"]

OPS_TABLE: Final = "workspace_sub_doc_ops"
REJECTIONS_TABLE: Final = "workspace_sub_doc_op_rejections"
SNAPSHOTS_TABLE: Final = "workspace_sub_doc_snapshots"
MARKS_TABLE: Final = "workspace_sub_doc_client_marks"

#: op_ids per lookup query: far below SQLite's smallest host-parameter limit (999).
_LOOKUP_CHUNK: Final = 400

_INSERT_OP: Final = (
    f"INSERT INTO {OPS_TABLE} (workspace_id, sub_doc, clock, op_id, op, fingerprint, committed_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_REJECTION: Final = (
    f"INSERT INTO {REJECTIONS_TABLE}"
    " (workspace_id, sub_doc, op_id, fingerprint, code, message, rejected_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_UPSERT_SNAPSHOT: Final = (
    f"INSERT INTO {SNAPSHOTS_TABLE} (workspace_id, sub_doc, clock, state, taken_at)"
    " VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (workspace_id, sub_doc)"
    " DO UPDATE SET clock = excluded.clock, state = excluded.state, taken_at = excluded.taken_at"
)
_SELECT_SNAPSHOT: Final = (
    f"SELECT clock, state FROM {SNAPSHOTS_TABLE} WHERE workspace_id = ? AND sub_doc = ?"
)
_SELECT_OPS_AFTER: Final = (
    f"SELECT clock, op_id, op FROM {OPS_TABLE}"
    " WHERE workspace_id = ? AND sub_doc = ? AND clock > ? ORDER BY clock"
)
# What `read_since` answers: `committed_at` as stored (ms), the same value `append` stamped.
_READ_OPS_AFTER: Final = (
    f"SELECT clock, op_id, op, committed_at FROM {OPS_TABLE}"
    " WHERE workspace_id = ? AND sub_doc = ? AND clock > ? ORDER BY clock LIMIT ?"
)
_UPSERT_MARK: Final = (
    f"INSERT INTO {MARKS_TABLE} (workspace_id, sub_doc, client_id, seq, decided_at)"
    " VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (workspace_id, sub_doc, client_id)"
    " DO UPDATE SET seq = max(seq, excluded.seq), decided_at = excluded.decided_at"
)
_SELECT_MARK: Final = (
    f"SELECT seq FROM {MARKS_TABLE} WHERE workspace_id = ? AND sub_doc = ? AND client_id = ?"
)
_SELECT_HEAD: Final = f"SELECT max(clock) FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc = ?"
# The workspace's sub-docs by name, each found by one seek of the primary key to the next name
# after the last (a loose index scan): a page costs `limit` seeks, not a scan of every op of the
# workspace. ?1 workspace, ?2 the name to start after ('' sorts before every valid id), ?3 limit.
_LIST_SUB_DOCS: Final = f"""
WITH RECURSIVE docs(sub_doc) AS (
    SELECT (SELECT min(sub_doc) FROM {OPS_TABLE} WHERE workspace_id = ?1 AND sub_doc > ?2)
    UNION ALL
    SELECT (SELECT min(sub_doc) FROM {OPS_TABLE} WHERE workspace_id = ?1 AND sub_doc > docs.sub_doc)
    FROM docs WHERE docs.sub_doc IS NOT NULL
    LIMIT ?3
)
SELECT d.sub_doc, o.clock, o.committed_at, (
    SELECT min(clock) FROM {OPS_TABLE} WHERE workspace_id = ?1 AND sub_doc = d.sub_doc
) AS horizon
FROM docs d
JOIN {OPS_TABLE} o ON o.workspace_id = ?1 AND o.sub_doc = d.sub_doc AND o.clock = (
    SELECT max(clock) FROM {OPS_TABLE} WHERE workspace_id = ?1 AND sub_doc = d.sub_doc
)
ORDER BY d.sub_doc
"""

_SELECT_SPAN: Final = (
    f"SELECT min(clock), max(clock) FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc = ?"
)
# Compaction (`compact`): the sub-docs that have a snapshot, in key order from a start key;
# only they have ops below a snapshot.
_SNAPSHOTS_FROM: Final = (
    f"SELECT workspace_id, sub_doc, clock FROM {SNAPSHOTS_TABLE}"
    " WHERE (workspace_id, sub_doc) >= (?, ?) ORDER BY workspace_id, sub_doc LIMIT ?"
)
_SELECT_HORIZON: Final = (
    f"SELECT min(clock) FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc = ?"
)
# The first op of the window [?3, ?4) that is too young to go: the prefix before it may go.
_FIRST_KEPT: Final = (
    f"SELECT min(clock) FROM {OPS_TABLE} WHERE workspace_id = ?1 AND sub_doc = ?2"
    " AND clock >= ?3 AND clock < ?4 AND committed_at >= ?5"
)
_DELETE_OPS_BELOW: Final = (
    f"DELETE FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc = ? AND clock < ?"
)
_EXPIRE_REJECTIONS: Final = (
    f"DELETE FROM {REJECTIONS_TABLE} WHERE rowid IN"
    f" (SELECT rowid FROM {REJECTIONS_TABLE} WHERE rejected_at < ? LIMIT ?)"
)
_STATS: Final = f"SELECT count(*), min(committed_at) FROM {OPS_TABLE}"

_DEFAULT_SNAPSHOT_EVERY: Final = ServerConfig().snapshot_every
_DEFAULT_CACHE_LIMIT: Final = ServerConfig().subdoc_cache_limit


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the op-log tables and indexes if missing (idempotent)."""
    db.table(OPS_TABLE).create(
        {
            "workspace_id": str,
            "sub_doc": str,
            "clock": int,
            "op_id": str,
            "op": str,
            "fingerprint": str,
            "committed_at": int,
        },
        pk=("workspace_id", "sub_doc", "clock"),
        not_null={"workspace_id", "sub_doc", "clock", "op", "fingerprint", "committed_at"},
        if_not_exists=True,
    )
    db.table(OPS_TABLE).create_index(
        ["workspace_id", "sub_doc", "op_id"],
        index_name=f"{OPS_TABLE}_op_id",
        unique=True,
        if_not_exists=True,
    )
    db.table(REJECTIONS_TABLE).create(
        {
            "workspace_id": str,
            "sub_doc": str,
            "op_id": str,
            "fingerprint": str,
            "code": str,
            "message": str,
            "rejected_at": int,
        },
        pk=("workspace_id", "sub_doc", "op_id"),
        not_null={"fingerprint", "code", "message", "rejected_at"},
        if_not_exists=True,
    )
    # What `expire_rejections` deletes by, oldest first.
    db.table(REJECTIONS_TABLE).create_index(
        ["rejected_at"], index_name=f"{REJECTIONS_TABLE}_rejected_at", if_not_exists=True
    )
    db.table(MARKS_TABLE).create(
        {"workspace_id": str, "sub_doc": str, "client_id": str, "seq": int, "decided_at": int},
        pk=("workspace_id", "sub_doc", "client_id"),
        not_null={"seq", "decided_at"},
        if_not_exists=True,
    )
    db.table(SNAPSHOTS_TABLE).create(
        {"workspace_id": str, "sub_doc": str, "clock": int, "state": str, "taken_at": int},
        pk=("workspace_id", "sub_doc"),
        not_null={"clock", "state", "taken_at"},
        if_not_exists=True,
    )


@dataclass(slots=True)
class _SubDoc:
    """The cached head of one sub-doc. Touched only by write jobs (the writer thread)."""

    clock: int
    state: SubDocState


def _dumps(value: Any) -> str:
    """Compact op text for the log (orjson: ~5x the standard library's speed)."""
    return orjson.dumps(value).decode()


class SQLiteOpLogStore(OpLogStore):
    """`OpLogStore` on a shared `SQLiteDatabase` whose schema includes `create_schema`.

    Make one store per database file: the cached states are its own, so a second store (or a
    second process) writing the same log would leave this cache behind the disk.

    `snapshot_every`: ops between two state snapshots. `cache_limit`: sub-doc states kept in
    memory, least recently used evicted first (an evicted one is rebuilt from its snapshot and
    the log on its next touch, so memory stays bounded however many sub-docs exist). `now`:
    wall clock in seconds (for `committed_at`). `await SQLiteOpLogStore.open(path)` gives a
    store that owns its database.
    """

    def __init__(
        self,
        db: SQLiteDatabase,
        *,
        snapshot_every: int = _DEFAULT_SNAPSHOT_EVERY,
        cache_limit: int = _DEFAULT_CACHE_LIMIT,
        now: Callable[[], float] = time.time,
        owns_db: bool = False,
        retention_seconds: float = 0.0,
        skew_seconds: float = 0.0,
        queue: SQLiteQueueStore | None = None,
    ) -> None:
        self._settings(
            snapshot_every=snapshot_every,
            cache_limit=cache_limit,
            retention_seconds=retention_seconds,
            skew_seconds=skew_seconds,
        )
        self.db = db
        self._now = now
        #: The queue of the same file, which `append_enqueuing` writes into (None: unbound).
        self._queue = queue
        self._owns_db = owns_db
        self._closed = False
        # Writer-thread only (see module docstring).
        # Evicting is safe at any moment on the writer thread: an evicted state that a rollback
        # would have undone is simply rebuilt from the (rolled back) disk on its next touch.
        self._docs: OrderedDict[tuple[str, str], _SubDoc] = OrderedDict()

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        snapshot_every: int = _DEFAULT_SNAPSHOT_EVERY,
        now: Callable[[], float] = time.time,
        retention_seconds: float = 0.0,
        skew_seconds: float = 0.0,
    ) -> SQLiteOpLogStore:
        """Open (or create) a database holding only the op-log; `close()` closes it too."""
        db = await SQLiteDatabase.open(path, schema=create_schema)
        return cls(
            db,
            snapshot_every=snapshot_every,
            now=now,
            owns_db=True,
            retention_seconds=retention_seconds,
            skew_seconds=skew_seconds,
        )

    # -- OpLogStore ------------------------------------------------------------------------------

    def observe_commits(self, observer: Callable[[float, int], None] | None) -> None:
        """Observed on the database's writer thread (its group commit is this store's)."""
        self.db.on_group_commit = observer

    #: One writer thread runs jobs in the order they were queued.
    appends_in_order = True

    def append_nowait(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> asyncio.Future[tuple[list[Outcome], list[LogEntry]]]:
        """`append` as the writer's own future: no task, and appends queued in order commit in
        order."""
        self._check_open()
        batch = list(ops)
        if not batch:
            done: asyncio.Future[tuple[list[Outcome], list[LogEntry]]] = (
                asyncio.get_running_loop().create_future()
            )
            done.set_result(([], []))
            return done
        return self.db.submit(
            lambda tx: self._append_job(tx, workspace_id, sub_doc, batch, atomic, if_clock)
        )

    async def append_enqueuing(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        enqueue: Sequence[EnqueueAsk],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> AppendEnqueued:
        """One writer job: the append, then (if it applied an op) the enqueues; a raise from
        either rolls back the job's savepoint, so neither is written."""
        self._check_open()
        queue = self._queue
        if queue is None:
            raise NotImplementedError("this op-log store is not bound to a queue store")
        batch, asks = list(ops), list(enqueue)

        def job(tx: Transaction) -> tuple[AppendEnqueued, list[RequestEvent]]:
            outcomes, entries = (
                self._append_job(tx, workspace_id, sub_doc, batch, atomic, if_clock)
                if batch
                else ([], [])
            )
            if not entries:
                return AppendEnqueued(outcomes, entries, None), []
            answers, events = enqueue_rows(tx, caused_by(asks, entries[-1].clock), self._now())
            return AppendEnqueued(outcomes, entries, answers), events

        return await commit_then_announce(self.db.submit(job), queue.announce_committed)

    async def read_since(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[LogEntry]]:
        self._check_open()

        def read(conn: sqlite3.Connection) -> tuple[int, list[LogEntry]]:
            # One read transaction, so the head is never behind the entries returned.
            conn.execute("BEGIN")
            try:
                rows = (
                    conn.execute(_READ_OPS_AFTER, (workspace_id, sub_doc, since, limit)).fetchall()
                    if limit > 0
                    else []
                )
                head = conn.execute(_SELECT_HEAD, (workspace_id, sub_doc)).fetchone()[0] or 0
            finally:
                conn.execute("COMMIT")
            return head, [
                LogEntry(clock, op_id, orjson.loads(op), at / 1000) for clock, op_id, op, at in rows
            ]

        return await self.db.read(read)

    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        """Served by a write job: the cache is the state, and it may only be read on the writer
        thread. The copy is O(tree) either way (the GIL makes a reader thread no cheaper), and a
        job resolves only after its group committed, so the answer never shows an op that is not
        yet durable."""
        self._check_open()
        key = (workspace_id, sub_doc)

        def job(tx: Transaction) -> tuple[int, SubDocState]:
            doc = self._docs.get(key)
            if doc is None:
                doc = _load(tx, key)
                if doc.clock == 0:
                    return 0, doc.state  # never written: not worth a cache entry
                self._cache(tx, key, doc)
            else:
                self._docs.move_to_end(key)
            return doc.clock, copy_state(doc.state)

        return await self.db.write(job)

    async def head(self, workspace_id: str, sub_doc: str) -> int:
        self._check_open()

        def read(conn: sqlite3.Connection) -> int:
            value = conn.execute(_SELECT_HEAD, (workspace_id, sub_doc)).fetchone()[0]
            return int(value or 0)

        return await self.db.read(read)

    async def list_sub_docs(
        self, workspace_id: str, *, after: str | None = None, limit: int
    ) -> list[SubDocHead]:
        self._check_open()
        if limit < 0:
            raise ValueError(f"limit must be >= 0: {limit!r}")
        if limit == 0:
            return []

        def read(conn: sqlite3.Connection) -> list[SubDocHead]:
            rows = conn.execute(_LIST_SUB_DOCS, (workspace_id, after or "", limit)).fetchall()
            # committed_at is stored in milliseconds.
            return [
                SubDocHead(name, clock, at / 1000, horizon) for name, clock, at, horizon in rows
            ]

        return await self.db.read(read)

    async def horizon(self, workspace_id: str, sub_doc: str) -> int:
        self._check_open()

        def read(conn: sqlite3.Connection) -> int:
            low, high = conn.execute(_SELECT_SPAN, (workspace_id, sub_doc)).fetchone()
            return int(low) if low is not None else int(high or 0) + 1

        return await self.db.read(read)

    async def compact(
        self, older_than: float, *, limit: int, start: tuple[str, str] | None = None
    ) -> Compaction:
        """One write job: it holds the writer for at most `limit` deleted rows and `limit`
        sub-docs visited (two index seeks each), so appends queue behind it only briefly."""
        self._check_open()
        if limit < 1:
            raise ValueError(f"limit must be >= 1: {limit!r}")
        cutoff = int(older_than * 1000)  # committed_at is stored in milliseconds
        first = start or ("", "")  # '' sorts before every valid id

        def job(tx: Transaction) -> Compaction:
            docs = tx.execute(_SNAPSHOTS_FROM, (*first, limit + 1)).fetchall()
            budget = limit
            for workspace_id, sub_doc, snapshot_clock in docs[:limit]:
                key = (workspace_id, sub_doc)
                low = tx.execute(_SELECT_HORIZON, key).fetchone()[0]
                if low is None or low >= snapshot_clock:
                    continue
                window_end = min(int(snapshot_clock), int(low) + budget)
                kept = tx.execute(_FIRST_KEPT, (*key, low, window_end, cutoff)).fetchone()[0]
                end = window_end if kept is None else int(kept)
                if end > low:
                    budget -= tx.execute(_DELETE_OPS_BELOW, (*key, end)).rowcount
                if budget == 0:
                    return Compaction(limit, key)  # this sub-doc may hold more: start there
            resume = (docs[limit][0], docs[limit][1]) if len(docs) > limit else None
            return Compaction(limit - budget, resume)

        return await self.db.write(job)

    async def expire_rejections(self, older_than: float, *, limit: int) -> int:
        self._check_open()
        if limit < 1:
            raise ValueError(f"limit must be >= 1: {limit!r}")
        cutoff = int(older_than * 1000)

        def job(tx: Transaction) -> int:
            return int(tx.execute(_EXPIRE_REJECTIONS, (cutoff, limit)).rowcount)

        return await self.db.write(job)

    async def stats(self) -> OpLogStats:
        """Exact, by one scan of the log on a reader connection (writers go on meanwhile)."""
        self._check_open()

        def read(conn: sqlite3.Connection) -> OpLogStats:
            rows, oldest = conn.execute(_STATS).fetchone()
            return OpLogStats(int(rows), None if oldest is None else oldest / 1000)

        return await self.db.read(read)

    async def client_mark(self, workspace_id: str, sub_doc: str, client_id: str) -> int:
        self._check_open()

        def read(conn: sqlite3.Connection) -> int:
            row = conn.execute(_SELECT_MARK, (workspace_id, sub_doc, client_id)).fetchone()
            return 0 if row is None else int(row[0])

        return await self.db.read(read)

    async def close(self) -> None:
        """Wait for every append queued before this call, drop the cache, and close the database
        if this store opened it."""
        if self._closed:
            return
        self._closed = True

        def drop_cache(tx: Transaction) -> None:
            self._docs.clear()

        # The writer runs jobs in order: once this one resolves, every earlier append is durable.
        # A shared database already closed by its owner has finished them all already.
        with contextlib.suppress(RuntimeError):
            await self.db.write(drop_cache)
        if self._owns_db:
            await self.db.close()

    # -- writer thread ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the op-log store is closed")

    def _cache(self, tx: Transaction, key: tuple[str, str], doc: _SubDoc) -> None:
        self._docs[key] = doc
        while len(self._docs) > self.cache_limit:
            self._docs.popitem(last=False)
        # What was just loaded may include this group's uncommitted rows: forget it if they
        # never reach disk (it is reloaded on next touch).
        tx.on_rollback(lambda: self._forget(key, doc))

    def _forget(self, key: tuple[str, str], doc: _SubDoc) -> None:
        if self._docs.get(key) is doc:
            del self._docs[key]

    def _append_job(
        self,
        tx: Transaction,
        workspace_id: str,
        sub_doc: str,
        ops: list[IncomingOp],
        atomic: bool,
        if_clock: int | None = None,
    ) -> tuple[list[Outcome], list[LogEntry]]:
        key = (workspace_id, sub_doc)
        doc = self._docs.get(key)
        if doc is None:
            doc = _load(tx, key)
            self._cache(tx, key, doc)
        else:
            self._docs.move_to_end(key)
        tx.count_ops(len(ops))
        op_ids = op_ids_to_look_up(ops)
        recorded = _look_up(tx, workspace_id, sub_doc, op_ids) if op_ids else {}
        clients = {op.op.client_id for op in ops if op.op.client_id is not None}
        # Read in this job: an earlier job of the same group transaction may have moved them.
        marks = {
            client_id: int(row[0])
            for client_id in clients
            if (row := tx.execute(_SELECT_MARK, (*key, client_id)).fetchone()) is not None
        }
        now = self._now()
        plan = plan_commit(
            doc.state,
            doc.clock,
            ops,
            recorded,
            atomic=atomic,
            marks=marks,
            expired_before=self.expired_before(now),
            latest_minted_at=self.latest_minted_at(now),
            if_clock=if_clock,
        )

        def undo() -> None:
            plan.revert()
            doc.clock = plan.base_clock

        # Registered before any write: if an insert below raises, the job's savepoint is rolled
        # back and this runs, so the cache never shows what the disk does not hold.
        tx.on_rollback(undo)
        doc.clock = plan.clock
        entries = plan.entries
        if plan.marks:
            tx.executemany(
                _UPSERT_MARK,
                [
                    (workspace_id, sub_doc, client_id, seq, int(now * 1000))
                    for client_id, seq in plan.marks.items()
                ],
            )
        if plan.entries or plan.rejections:
            at = int(now * 1000)
            # Stamped as stored, so a live frame and a later log read show the same time.
            entries = [replace(e, committed_at=at / 1000) for e in plan.entries]
            if plan.entries:
                tx.executemany(
                    _INSERT_OP,
                    [
                        (workspace_id, sub_doc, e.clock, e.op_id, _dumps(e.op), fingerprint, at)
                        for e, fingerprint in zip(plan.entries, plan.fingerprints, strict=True)
                    ],
                )
            if plan.rejections:
                tx.executemany(
                    _INSERT_REJECTION,
                    [
                        (workspace_id, sub_doc, r.op_id, r.fingerprint, r.code, r.message, at)
                        for r in plan.rejections
                    ],
                )
            if snapshot_due(plan.base_clock, plan.clock, self.snapshot_every):
                tx.execute(
                    _UPSERT_SNAPSHOT, (workspace_id, sub_doc, doc.clock, doc.state.dumps(), at)
                )
        return plan.outcomes, entries


def _load(tx: Transaction, key: tuple[str, str]) -> _SubDoc:
    """Rebuild a sub-doc from its latest snapshot plus the log after it."""
    row = tx.execute(_SELECT_SNAPSHOT, key).fetchone()
    if row is None:
        snapshot_clock, state = 0, SubDocState.empty()
    else:
        snapshot_clock, state = int(row[0]), SubDocState.loads(row[1])
    rows = tx.execute(_SELECT_OPS_AFTER, (*key, snapshot_clock))
    clock = rebuild_from_log(state, snapshot_clock, ((c, text) for c, _op_id, text in rows), key)
    if clock == snapshot_clock > 0:
        # No op after the snapshot: the log must still reach it. The log's max is the head
        # readers serve; a snapshot beyond it (a log that lost its tail) would give the cache a
        # clock and state no log entry backs, and the next op a clock after a gap.
        head = tx.execute(_SELECT_HEAD, key).fetchone()[0]
        if head is None or int(head) < snapshot_clock:
            raise OpLogCorrupted(
                f"{key}: snapshot at clock {snapshot_clock} is ahead of the log's head {head or 0}"
            )
    return _SubDoc(clock=clock, state=state)


@functools.lru_cache(maxsize=64)
def _look_up_sql(count: int) -> str:
    """The lookup query for `count` op_ids (cached: one text per size keeps SQLite's statement
    cache warm for the common sizes, 1 and a full batch)."""
    marks = ", ".join(["?"] * count)
    return (
        f"SELECT op_id, clock, fingerprint, NULL, NULL FROM {OPS_TABLE}"
        f" WHERE workspace_id = ? AND sub_doc = ? AND op_id IN ({marks})"
        " UNION ALL"
        f" SELECT op_id, NULL, fingerprint, code, message FROM {REJECTIONS_TABLE}"
        f" WHERE workspace_id = ? AND sub_doc = ? AND op_id IN ({marks})"
    )


def _look_up(
    tx: Transaction, workspace_id: str, sub_doc: str, op_ids: list[str]
) -> dict[str, Recorded]:
    """What the log holds for `op_ids`: committed clocks and recorded rejections."""
    recorded: dict[str, Recorded] = {}
    for start in range(0, len(op_ids), _LOOKUP_CHUNK):
        chunk = op_ids[start : start + _LOOKUP_CHUNK]
        params = (workspace_id, sub_doc, *chunk, workspace_id, sub_doc, *chunk)
        for op_id, clock, fingerprint, code, message in tx.execute(
            _look_up_sql(len(chunk)), params
        ):
            if clock is not None:
                recorded[op_id] = RecordedCommit(clock=int(clock), fingerprint=fingerprint)
            else:
                recorded[op_id] = RecordedRejection(code, message, fingerprint)
    return recorded
