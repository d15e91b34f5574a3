"""The client's outbox: ops written down before their first send, deleted once answered.

Two implementations behind one small seam: `SQLiteOutbox` (a file: survives crashes and restarts;
the default whenever the app passes a path) and `MemoryOutbox` (`outbox=None`: retries and
reconnects are still safe, a process restart loses what was pending).

How the SQLite file is written, and why:

- Every write is one short transaction committed **on the calling (event-loop) thread**, in WAL
  mode with `synchronous=NORMAL`: an append to the WAL in the OS page cache, a few microseconds,
  no fsync. Once it returns, the op survives the client process dying (SIGKILL, OOM, a crash):
  the next client on the file finds it. A thread hand-off per write (the loop waking a writer
  thread and being woken back, and both fighting over the GIL while the app is busy) cost more
  than the write itself. The price: SQLite's automatic checkpoint (every ~1,000 WAL pages) runs
  inside such a commit, two fsyncs on the loop — measured: an insert and a delete take 15 us
  p50, 83 us p99, up to ~0.5 ms when a checkpoint lands.
- The fsync that makes the op survive the *machine* losing power runs on a **syncer thread**,
  off the critical path (`outbox_sync="alongside"`, the default): it covers every commit made
  before it started (group sync), while the op's first round trip is under way. Nothing the app
  is told depends on it before it is done: `apply_op` returns only on the server's answer (the
  op is then durable on the server), and an op is reported as waiting in the outbox
  (`StillPendingError`, `close()`) only after its fsync (`sync(seq)`). Power lost in between
  loses an op nobody was told about, exactly as if it had been lost a moment before the call.
- `outbox_sync="before_send"` waits for that fsync before the op may be sent (a write's `done`
  runs after it): the strict order, one fsync on every op's path.

`locking_mode=EXCLUSIVE` keeps a second client (another process) from replaying the same rows
concurrently: it fails to open with `outbox_locked` instead.

A large backlog (a client offline for long: a million ops) is not read whole at start. `open`
with `page_rows` reads each lane's count (`backlog`) and first page; the rest is read a page at
a time (`read_lane`, in the executor, on the same connection: `locking_mode=EXCLUSIVE` keeps
any second connection out, even in this process). A partial index on `(workspace_id, sub_doc,
seq)` over the backlog's seqs makes the counts and each page range reads, whatever other lanes
hold; rows written later are above its bound, so it costs the op path nothing (a full index
measured +50% per single-row commit).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cv_workspace_client._machine_effects import BacklogRange, LaneBacklog, OutboxRow
from cv_workspace_client.errors import OutboxError

__all__ = ["MemoryOutbox", "Outbox", "OutboxSync", "OutboxWrite", "SQLiteOutbox"]

#: Bumped when the table changes shape; an outbox from a newer SDK is refused, not misread.
SCHEMA_VERSION = 1

#: Marks the file as an outbox (SQLite's `PRAGMA application_id`, the bytes "cvob"), so that a
#: database of another application passed as `outbox=` is refused instead of taken over.
APPLICATION_ID = 0x63766F62

#: When an op's outbox fsync happens: while its first send is under way, or before it.
OutboxSync = Literal["alongside", "before_send"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq          INTEGER PRIMARY KEY,
    workspace_id TEXT    NOT NULL,
    sub_doc      TEXT    NOT NULL,
    op_id        TEXT    NOT NULL,
    op           TEXT    NOT NULL,
    created_at   REAL    NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    atomic_group INTEGER
)
"""

#: The backlog found at open, by lane, made when it is more than a page: `WHERE seq <= last`,
#: so the rows written afterwards are not in it. An index is no change of schema: SDKs of
#: schema 1 open the file as before (and ignore it).
_BACKLOG_INDEX = "outbox_backlog"

_COLUMNS = [
    "seq",
    "workspace_id",
    "sub_doc",
    "op_id",
    "op",
    "created_at",
    "attempts",
    "atomic_group",
]

_INSERT = (
    "INSERT OR REPLACE INTO outbox (seq, workspace_id, sub_doc, op_id, op, created_at, attempts,"
    " atomic_group) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)

#: How long opening waits for another connection's lock before reporting `outbox_locked`
#: (the previous client of a restart may still be closing its file).
_BUSY_TIMEOUT_MS = 5000


@dataclass(slots=True)
class OutboxWrite:
    """One unit of work for the outbox: rows to insert, seqs to delete, seqs whose attempt count
    grows, lanes' on-disk rows to delete (`discard_pending`). `done(error)` runs once the write
    is applied (error None) or failed; it may run before `write` returns."""

    inserts: list[OutboxRow] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    ranges: list[BacklogRange] = field(default_factory=list)
    done: Callable[[BaseException | None], None] | None = None

    def __bool__(self) -> bool:
        return bool(self.inserts or self.deletes or self.attempts or self.ranges)


class Outbox(abc.ABC):
    """Where pending ops live. `rows` is what a previous client left, in seq order (or, when
    opened with a page size, the first page of each lane); `backlog` counts them per lane."""

    durable: bool = False

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        self.backlog: list[LaneBacklog] = []

    @abc.abstractmethod
    def write(self, job: OutboxWrite) -> None:
        """Apply `job` (in the order writes are made); never blocks on a disk flush."""

    def synced(self, seq: int) -> bool:
        """True once the insert of row `seq` survives a power loss (if this outbox can)."""
        return True

    async def sync(self, seq: int | None = None) -> None:
        """Return once the inserts up to row `seq` (default: all so far) survive a power loss."""
        return None

    async def flush(self) -> None:
        """Return once every write made so far (deletes too) survives a power loss."""
        return None

    @abc.abstractmethod
    async def close(self, *, abort: bool = False) -> None:
        """Release the outbox (with `abort`, without waiting for anything, as a crash would)."""

    @abc.abstractmethod
    async def pending(self) -> list[OutboxRow]:
        """The rows currently stored, in seq order (for diagnostics and tests)."""

    @abc.abstractmethod
    async def read_lane(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        """The lane's rows with `after_seq < seq <= up_to_seq` in seq order: the first `limit`,
        and the rest of the last one's atomic group (a group never straddles two pages)."""


class MemoryOutbox(Outbox):
    """`outbox=None`: the same contract, in a dict. Writes are applied immediately."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[int, OutboxRow] = {}

    def write(self, job: OutboxWrite) -> None:
        for row in job.inserts:
            self._rows[row.seq] = row
        for seq in job.attempts:
            stored = self._rows.get(seq)
            if stored is not None:
                self._rows[seq] = _with_attempt(stored)
        for seq in job.deletes:
            self._rows.pop(seq, None)
        for lane in job.ranges:
            for seq, row in list(self._rows.items()):
                if _in_range(row, lane):
                    del self._rows[seq]
        if job.done is not None:
            job.done(None)

    async def close(self, *, abort: bool = False) -> None:
        return None

    async def pending(self) -> list[OutboxRow]:
        return [self._rows[seq] for seq in sorted(self._rows)]

    async def read_lane(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        rows = (
            self._rows[seq]
            for seq in sorted(self._rows)
            if after_seq < seq <= up_to_seq
            and (self._rows[seq].workspace_id, self._rows[seq].sub_doc) == (workspace_id, sub_doc)
        )
        return _page(rows, limit)


def _in_range(row: OutboxRow, lane: BacklogRange) -> bool:
    same_lane = row.workspace_id == lane.workspace_id and row.sub_doc == lane.sub_doc
    return same_lane and lane.after_seq < row.seq <= lane.up_to_seq


def _with_attempt(row: OutboxRow) -> OutboxRow:
    return OutboxRow(
        row.seq,
        row.workspace_id,
        row.sub_doc,
        row.op_id,
        row.op_json,
        row.created_at,
        row.attempts + 1,
        row.atomic_group,
    )


#: Queued to the syncer by `close()`: finish what was requested before it, then stop.
_STOP_SYNCER = -1


class SQLiteOutbox(Outbox):
    """A SQLite file outbox. Open with `await SQLiteOutbox.open(path)`."""

    durable = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync: OutboxSync = "alongside",
        busy_timeout_ms: int = _BUSY_TIMEOUT_MS,
    ) -> None:
        super().__init__()
        if sync not in ("alongside", "before_send"):
            raise ValueError(f"outbox sync must be 'alongside' or 'before_send', not {sync!r}")
        self.path = str(path)
        self.sync_mode: OutboxSync = sync
        self.busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._error: OutboxError | None = None
        #: (st_dev, st_ino) of the file as opened: a file removed or replaced under the open
        #: connection takes every row with it (the connection goes on writing to the unlinked
        #: inode, and its close does not bring them back), however durable they were.
        self._identity: tuple[int, int] | None = None
        self._lost = False
        #: Highest seq inserted by a committed write.
        self._written_seq = 0
        #: (seq, future) waiting for `_durable >= seq`; touched on the loop thread only.
        self._sync_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: (seq, done) writes whose `done` runs after their fsync (`before_send`).
        self._after_sync: list[tuple[int, Callable[[BaseException | None], None]]] = []
        # The syncer thread: `_requested` is the highest seq handed to it (loop thread only); it
        # takes requests from `_requests` (a C-level queue: putting never blocks the loop on the
        # syncer, as a Condition's Python-level lock could, the syncer holding it between GIL
        # switches); `_durable` is the highest seq it has made durable. It wakes the event loop
        # only when `_wanted` (somebody waits), so a client that waits for nothing pays no loop
        # wake-up per fsync. `_lock` makes "durable, and was anyone waiting" one step on both
        # sides; nothing inside it calls out or blocks, so either side waits on it for a few
        # bytecodes at most.
        self._requests: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._requested = 0
        self._durable = 0
        self._wanted = False
        self._thread: threading.Thread | None = None
        #: Held by a `read_lane` in the executor, and by `close` around closing the connection.
        self._reading = threading.Lock()
        #: The descriptor holding `<path>.lock` (see `_take_file_lock`), closed last.
        self._lock_fd: int | None = None
        #: Transactions committed, writes they carried, and fsyncs made (a group sync covers many
        #: commits: fsyncs < groups under load).
        self.groups_committed = 0
        self.writes_committed = 0
        self.fsyncs = 0

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        sync: OutboxSync = "alongside",
        busy_timeout_ms: int = _BUSY_TIMEOUT_MS,
        page_rows: int | None = None,
    ) -> SQLiteOutbox:
        """Create the file if needed, load what is pending (with `page_rows`: each lane's first
        `page_rows` rows, the rest through `read_lane`), and start the syncer thread.

        Raises `OutboxError("outbox_locked")` if another client holds the file for longer than
        `busy_timeout_ms`."""
        self = cls(path, sync=sync, busy_timeout_ms=busy_timeout_ms)
        self._loop = loop = asyncio.get_running_loop()
        # Opening may wait up to busy_timeout_ms for the lock: not on the event loop.
        opening = loop.run_in_executor(None, self._open_file, page_rows)
        try:
            # Shielded so that a cancelled open (an app's timeout around `start()`) can still
            # see what its thread opens: the thread cannot be stopped, and the connection and
            # file lock it returned to nobody kept the outbox locked for every later client of
            # this process.
            opened = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._abandon_open)
            raise
        except BaseException as exc:
            raise _as_outbox_error(exc, self.path) from None
        self._conn, self.rows, self.backlog, self._identity = opened
        self._written_seq = self._durable = max((lane.last_seq for lane in self.backlog), default=0)
        self._thread = threading.Thread(target=self._sync_loop, name="cv-outbox-sync", daemon=True)
        self._thread.start()
        return self

    def _open_file(
        self, page_rows: int | None
    ) -> tuple[sqlite3.Connection, list[OutboxRow], list[LaneBacklog], tuple[int, int]]:
        # Inside the error translation of `open`: a directory that cannot be made (a file in the
        # way, no permission) is an `outbox_open_failed`, not a bare OSError out of `start()`.
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        lock_existed = os.path.exists(f"{self.path}.lock")
        self._lock_fd = _take_file_lock(self.path, self.busy_timeout_ms)
        try:
            conn = _connect(self.path, self.busy_timeout_ms)
        except BaseException as exc:
            if isinstance(exc, OutboxError) and exc.code == "outbox_foreign" and not lock_existed:
                # Refused untouched, but the `.lock` we made stayed beside the app's database.
                # Removed while we hold it: whoever waits on it would be refused the same way.
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}.lock")
            self._release_file_lock()
            raise
        try:
            identity = _identity(self.path)
            assert identity is not None  # just opened, under our lock
            if page_rows is None:
                rows = _load(conn)
                backlog = _backlog(conn, rows[-1].seq if rows else 0)
            else:
                last = _index_backlog(conn, page_rows)
                backlog = _backlog(conn, last)
                rows = [
                    row
                    for lane in backlog
                    for row in _read_lane(conn, lane.workspace_id, lane.sub_doc, 0, last, page_rows)
                ]
            # The WAL file was just created: make its directory entry durable once.
            _fsync_path(os.path.dirname(os.path.abspath(self.path)))
        except BaseException:
            conn.close()
            self._release_file_lock()
            raise
        return conn, rows, backlog, identity

    def _abandon_open(self, opening: asyncio.Future[Any]) -> None:
        """The open was cancelled: close what its thread opened once it is done."""
        if opening.cancelled() or opening.exception() is not None:
            return  # it released the lock itself
        opening.result()[0].close()
        self._release_file_lock()

    def _release_file_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    # -- API (event loop side) ---------------------------------------------------------------------

    def write(self, job: OutboxWrite) -> None:
        conn = self._conn
        if self._closed or conn is None or self._error is not None:
            error = self._error or OutboxError("outbox_closed", "the outbox is closed")
            if job.done is not None:
                job.done(error)
            return
        try:
            _apply(conn, job)
        except sqlite3.Error as exc:
            if job.done is not None:
                job.done(OutboxError("outbox_write_failed", str(exc)))
            return
        self.groups_committed += 1
        self.writes_committed += 1
        if not job.inserts:
            # Deletes and attempt counts need no fsync of their own: a delete lost in a power
            # failure only means a replay the server answers from its dedupe record. The next
            # fsync carries them along.
            if job.done is not None:
                job.done(None)
            return
        seq = max(row.seq for row in job.inserts)
        self._written_seq = max(self._written_seq, seq)
        if self.sync_mode == "before_send" and job.done is not None:
            self._after_sync.append((seq, job.done))
            self._request_sync(wanted=True)
            return
        if job.done is not None:
            job.done(None)
        self._request_sync(wanted=False)

    def synced(self, seq: int) -> bool:
        return self._durable >= seq and not self._lost

    async def sync(self, seq: int | None = None) -> None:
        # Nothing past the last committed insert can become durable: don't wait for it.
        target = self._written_seq if seq is None else min(seq, self._written_seq)
        if self._lost:
            assert self._error is not None
            raise self._error
        if self._durable >= target:
            return
        if self._error is not None:
            raise self._error
        if self._closed:
            raise OutboxError("outbox_closed", "the outbox is closed")
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._sync_waiters.append((target, future))
        self._request_sync(wanted=True)
        await future

    async def flush(self) -> None:
        # Deletes are committed without an fsync of their own (see `write`), and `sync` tracks
        # inserts only: one fsync of the WAL now covers everything committed before it, from
        # whichever thread (as in `_sync_loop`). Off the loop: it waits on the disk.
        if self._error is not None:
            raise self._error
        if self._closed:
            raise OutboxError("outbox_closed", "the outbox is closed")
        try:
            await asyncio.to_thread(self._flush_off_loop)
        except OSError as exc:
            raise OutboxError("outbox_sync_failed", f"fsync of the outbox failed: {exc}") from exc
        if self._file_lost():
            raise _lost_error(self.path)

    def _flush_off_loop(self) -> None:
        # Under `_reading`, which `close` holds to close the connection (a checkpoint of the WAL
        # into the file, fsynced, then the WAL deleted): the WAL is either still there to fsync,
        # or gone with everything in it durable. A close that won the race made the fsync fail
        # on the missing WAL, and a durable discard was reported as failed.
        with self._reading:
            try:
                _fsync_path(self.path + "-wal")
            except FileNotFoundError:
                if not self._closed or self._conn is not None:
                    raise

    async def pending(self) -> list[OutboxRow]:
        if self._conn is None or self._closed:
            raise OutboxError("outbox_closed", "the outbox is closed")
        return _load(self._conn)

    async def read_lane(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        """Read in the executor (a page of a large backlog takes milliseconds), on the owning
        connection: the event loop's writes go on meanwhile, SQLite serializes the calls."""
        assert self._loop is not None
        return await self._loop.run_in_executor(
            None, self._read_lane_off_loop, workspace_id, sub_doc, after_seq, up_to_seq, limit
        )

    def _read_lane_off_loop(
        self, workspace_id: str, sub_doc: str, after_seq: int, up_to_seq: int, limit: int
    ) -> list[OutboxRow]:
        # `close` takes the lock before closing the connection: never closed under a read.
        with self._reading:
            conn = self._conn
            if conn is None or self._closed:
                raise OutboxError("outbox_closed", "the outbox is closed")
            try:
                return _read_lane(conn, workspace_id, sub_doc, after_seq, up_to_seq, limit)
            except sqlite3.Error as exc:
                raise OutboxError("outbox_read_failed", str(exc)) from None

    async def settings(self) -> dict[str, Any]:
        """The durability settings the connection runs with (journal_mode, synchronous,
        locking_mode), as SQLite reports them."""
        if self._conn is None or self._closed:
            raise OutboxError("outbox_closed", "the outbox is closed")
        return {
            name: self._conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "locking_mode")
        }

    async def close(self, *, abort: bool = False) -> None:
        if self._closed:
            return
        assert self._loop is not None
        if not abort:
            with contextlib.suppress(OutboxError):
                await self.sync()
            # What is left pending is reported as waiting in the file: it must still be there
            # (the last fsync may have been long ago).
            self._check_identity()
        self._closed = True
        self._requests.put(_STOP_SYNCER)
        conn, self._conn = self._conn, None

        def finish() -> None:
            if self._thread is not None:
                self._thread.join()
            if conn is not None:
                # Closing checkpoints the WAL into the file (synced before and after).
                with self._reading:
                    conn.close()
            self._release_file_lock()  # last: the file is ours until the connection is gone

        await self._loop.run_in_executor(None, finish)
        closed = OutboxError("outbox_closed", "the outbox closed before the fsync")
        self._settle_synced(self._durable, closed)

    # -- the syncer thread -------------------------------------------------------------------------

    def _request_sync(self, *, wanted: bool) -> None:
        if wanted:
            with self._lock:
                done = self._durable >= self._written_seq
                if not done:
                    self._wanted = True
            if done:
                # Done meanwhile: settle now, the syncer has nothing left to report.
                self._loop_call(self._settle_synced, self._durable, None)
                return
        if self._written_seq > self._requested:
            self._requested = self._written_seq
            self._requests.put(self._requested)

    def _loop_call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
            self._loop.call_soon_threadsafe(fn, *args)

    def _sync_loop(self) -> None:
        wal = self.path + "-wal"
        done = self._durable
        stopping = False
        while not stopping:
            # Every request queued meanwhile is covered by the one fsync below (seqs only grow;
            # the stop marker is below any seq).
            requests = [self._requests.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    requests.append(self._requests.get_nowait())
            stopping = _STOP_SYNCER in requests
            target = max(requests)
            if target <= done:
                continue
            # Everything committed before this point is covered: fsync(2) flushes the file's
            # pages whichever descriptor wrote them. The WAL file lives as long as the
            # connection, which outlives this thread.
            error: OutboxError | None = None
            try:
                _fsync_path(wal)
            except OSError as exc:
                error = OutboxError("outbox_sync_failed", f"fsync of the outbox failed: {exc}")
            self.fsyncs += 1
            if self._file_lost():
                # Set before `_durable` moves: `synced()` never says yes for a row of a file
                # that is gone.
                self._lost = True
                error = _lost_error(self.path)
            with self._lock:
                if error is None:
                    done = self._durable = target
                wanted, self._wanted = self._wanted, False
            if wanted or error is not None:
                self._loop_call(self._settle_synced, target, error)
            if error is not None:
                return

    def _file_lost(self) -> bool:
        return _identity(self.path) != self._identity

    def _check_identity(self) -> None:
        if not self._lost and self._file_lost():
            self._lost = True
            self._settle_synced(self._durable, _lost_error(self.path))

    def _settle_synced(self, seq: int, error: OutboxError | None) -> None:
        if error is not None:
            self._error = self._error or error
        seq = self._durable
        if self._after_sync:
            ready = [(s, d) for s, d in self._after_sync if error is not None or s <= seq]
            self._after_sync = [(s, d) for s, d in self._after_sync if error is None and s > seq]
            for _, done in ready:
                done(error)
        if self._sync_waiters:
            waiting: list[tuple[int, asyncio.Future[None]]] = []
            for target, future in self._sync_waiters:
                if future.done():
                    continue
                if error is not None:
                    future.set_exception(error)
                elif target <= seq:
                    future.set_result(None)
                else:
                    waiting.append((target, future))
            self._sync_waiters = waiting
        if self._after_sync or self._sync_waiters:
            self._request_sync(wanted=True)  # more was written meanwhile: one more round


def _apply(conn: sqlite3.Connection, job: OutboxWrite) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        if job.inserts:
            conn.executemany(
                _INSERT,
                [
                    (
                        r.seq,
                        r.workspace_id,
                        r.sub_doc,
                        r.op_id,
                        r.op_json,
                        r.created_at,
                        r.attempts,
                        r.atomic_group,
                    )
                    for r in job.inserts
                ],
            )
        if job.attempts:
            conn.executemany(
                "UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?",
                [(seq,) for seq in job.attempts],
            )
        if job.deletes:
            conn.executemany("DELETE FROM outbox WHERE seq = ?", [(seq,) for seq in job.deletes])
        for lane in job.ranges:
            conn.execute(
                "DELETE FROM outbox WHERE workspace_id = ? AND sub_doc = ? AND seq > ?"
                " AND seq <= ?",
                (lane.workspace_id, lane.sub_doc, lane.after_seq, lane.up_to_seq),
            )
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


def _connect(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # One client per outbox file: two would replay the same rows side by side. The lock is a
        # POSIX lock on the file: the kernel drops it when its holder dies, even by SIGKILL.
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        # Takes (and, in EXCLUSIVE mode, keeps) the exclusive lock before anything is read or
        # written. The file is identified first: a file that is not an outbox (the app's own
        # database passed by mistake) is refused before it is changed in any way; the switch to
        # WAL below would rewrite its header and lock the app out of it.
        # EXCLUSIVE, not IMMEDIATE: two clients starting at once on a new file each took a
        # shared lock, one the write lock; in EXCLUSIVE locking mode the other keeps its shared
        # lock while it waits, so the first could not commit either, and both failed with
        # `outbox_locked` (an app started twice, nobody running).
        conn.execute("BEGIN EXCLUSIVE")
        _claim(conn)
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = WAL")
        # A commit is in the WAL (survives the process) without an fsync; the syncer thread
        # fsyncs the WAL for power loss. NORMAL still syncs around every checkpoint.
        conn.execute("PRAGMA synchronous = NORMAL")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        conn.close()
        raise
    return conn


def _claim(conn: sqlite3.Connection) -> None:
    """Inside the open's transaction: make a new file an outbox, or check that it is one.

    Raises `OutboxError("outbox_foreign")` for another application's database and
    `OutboxError("outbox_version")` for an outbox from a newer SDK, having written nothing."""
    application_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    ours = tables - {_BACKLOG_INDEX} == {"outbox"}
    if application_id == APPLICATION_ID or (application_id == 0 and ours):
        if version > SCHEMA_VERSION:
            raise OutboxError(
                "outbox_version",
                f"outbox schema {version} is newer than this SDK ({SCHEMA_VERSION})",
            )
        columns = [row[1] for row in conn.execute("PRAGMA table_info(outbox)")]
        if application_id == 0 and (version != SCHEMA_VERSION or columns != _COLUMNS):
            raise OutboxError(
                "outbox_foreign",
                f"the file holds a table 'outbox' that is not this SDK's (columns {columns})",
            )
    elif application_id != 0 or version != 0 or tables:
        raise OutboxError(
            "outbox_foreign",
            f"the file is a SQLite database of another application (application_id "
            f"{application_id}, user_version {version}, tables {sorted(tables)}), not an outbox",
        )
    # A new (empty) file, ours, or one written before outboxes carried their application_id.
    # An outbox that needs nothing is not written to at all: a damaged one found further on
    # (reading its rows) is left byte for byte as it was, for whoever salvages it.
    if "outbox" not in tables:
        conn.execute(_SCHEMA)
    if version != SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    if application_id != APPLICATION_ID:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _lost_error(path: str) -> OutboxError:
    return OutboxError(
        "outbox_sync_failed",
        f"the outbox file {os.path.basename(path)} was removed or replaced while open: "
        "the ops it held are gone",
    )


def _fsync_path(path: str) -> None:
    """fsync(2) a file or directory by path (any descriptor flushes the file's pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load(conn: sqlite3.Connection) -> list[OutboxRow]:
    cursor = conn.execute(
        "SELECT seq, workspace_id, sub_doc, op_id, op, created_at, attempts, atomic_group"
        " FROM outbox ORDER BY seq"
    )
    # Every pending row is held in memory (a large offline backlog: 1,000,000 ops). Rows are
    # built straight from the cursor (no second list of raw tuples) and share one string per
    # workspace and sub-doc: measured at 1M ops, 608 -> 377 MiB and 6.2 -> 4.4 s.
    keys: dict[tuple[str, str], tuple[str, str]] = {}
    rows: list[OutboxRow] = []
    for seq, workspace_id, sub_doc, op_id, op, created_at, attempts, atomic_group in cursor:
        workspace_id, sub_doc = keys.setdefault((workspace_id, sub_doc), (workspace_id, sub_doc))
        rows.append(
            OutboxRow(seq, workspace_id, sub_doc, op_id, op, created_at, attempts, atomic_group)
        )
    return rows


def _index_backlog(conn: sqlite3.Connection, page_rows: int) -> int:
    """Make (or drop) the backlog index as the rows found at open need; return their last seq.

    Kept as it is when it already fits (a client that crashed before answering anything), so
    an outbox that needs nothing is not written to."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        first, last = conn.execute("SELECT min(seq), max(seq) FROM outbox").fetchone()
        wanted = None
        if last is not None and last - first + 1 > page_rows:
            # The bound is a literal: SQLite uses a partial index only for a query that repeats
            # its WHERE term, and the reads below do (a bound parameter would not).
            wanted = (
                f"CREATE INDEX {_BACKLOG_INDEX} ON outbox (workspace_id, sub_doc, seq)"
                f" WHERE seq <= {int(last)}"
            )
        found = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?", (_BACKLOG_INDEX,)
        ).fetchone()
        if (found and found[0]) != wanted:
            if found is not None:
                conn.execute(f"DROP INDEX {_BACKLOG_INDEX}")
            if wanted is not None:
                conn.execute(wanted)
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    return int(last or 0)


def _backlog(conn: sqlite3.Connection, last: int) -> list[LaneBacklog]:
    """Rows per lane up to seq `last`, from the backlog index alone when there is one (no op
    text read): ~0.15 s for 1,000,000."""
    cursor = conn.execute(
        "SELECT workspace_id, sub_doc, count(*), max(seq) FROM outbox"
        f" WHERE seq <= {int(last)} GROUP BY workspace_id, sub_doc"
    )
    return [LaneBacklog(*lane) for lane in cursor]


def _read_lane(
    conn: sqlite3.Connection,
    workspace_id: str,
    sub_doc: str,
    after_seq: int,
    up_to_seq: int,
    limit: int,
) -> list[OutboxRow]:
    cursor = conn.execute(
        "SELECT seq, op_id, op, created_at, attempts, atomic_group FROM outbox"
        f" WHERE workspace_id = ? AND sub_doc = ? AND seq > ? AND seq <= {int(up_to_seq)}"
        " ORDER BY seq",
        (workspace_id, sub_doc, after_seq),
    )
    try:
        # The lane's two strings are shared by all its rows.
        rows = (
            OutboxRow(seq, workspace_id, sub_doc, op_id, op, created_at, attempts, group)
            for seq, op_id, op, created_at, attempts, group in cursor
        )
        return _page(rows, limit)
    finally:
        cursor.close()  # ends the read: it must not hold the connection's snapshot open


def _page(rows: Iterator[OutboxRow], limit: int) -> list[OutboxRow]:
    """The first `limit` of `rows` (in seq order), and the rest of the last one's atomic group:
    an atomic call's ops travel in one request, so they must be loaded together."""
    page: list[OutboxRow] = []
    for row in rows:
        if len(page) >= limit and (
            row.atomic_group is None or row.atomic_group != page[-1].atomic_group
        ):
            break
        page.append(row)
    return page


#: Waits between two tries of a held outbox lock, in ms, then the last one again: SQLite's own
#: busy handler's schedule (sqliteDefaultBusyCallback), which this lock stands in front of.
_LOCK_RETRY_MS = (1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100)


def _take_file_lock(path: str, busy_timeout_ms: int) -> int | None:
    """Hold `<path>.lock` (flock, exclusive) for this client, waiting up to `busy_timeout_ms`.

    SQLite's own lock is not enough to pick one of two clients starting at once: each takes a
    shared lock and asks for the exclusive one, and in EXCLUSIVE locking mode the one that waits
    keeps its shared lock, so neither gets it and both fail with `outbox_locked` (an app started
    twice, running nowhere). flock is granted whole or not at all: one of them wins. The kernel
    drops it when its holder dies, even by SIGKILL. A sidecar file, as the server's: flock on the
    database itself could clash with SQLite's POSIX locks (NFS emulates flock with them)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no flock; SQLite's own lock alone
        return None
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + busy_timeout_ms / 1000
    tries = 0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise _locked_error(path) from None
        except BaseException:
            os.close(fd)
            raise
        wait = _LOCK_RETRY_MS[min(tries, len(_LOCK_RETRY_MS) - 1)] / 1000
        tries += 1
        time.sleep(max(0.0, min(wait, deadline - time.monotonic())))


def _locked_error(path: str) -> OutboxError:
    return OutboxError("outbox_locked", f"another client holds the outbox {os.path.basename(path)}")


def _as_outbox_error(exc: BaseException, path: str) -> BaseException:
    if isinstance(exc, OutboxError):
        return exc
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return _locked_error(path)
    if isinstance(exc, sqlite3.Error | OSError):
        return OutboxError("outbox_open_failed", str(exc))
    return exc
