"""`SQLiteOutbox`: the outbox in a SQLite file (the default whenever the app passes a path).

Its SQL, the file's identity checks and its lock are in `_outbox/file.py`. How the file is
written, and why:

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

`locking_mode=EXCLUSIVE` keeps a second client (another process) from resending the same rows
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

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cv_mutations import new_op_id
from cv_workspace_client._core.effects import LaneBacklog, OutboxRow
from cv_workspace_client._outbox.base import Outbox, OutboxSync, OutboxWrite
from cv_workspace_client._outbox.file import (
    BUSY_TIMEOUT_MS,
    apply_write,
    as_outbox_error,
    backlog_of,
    connect,
    file_identity,
    fsync_path,
    index_backlog,
    load_all,
    load_lanes,
    lost_error,
    read_lane_rows,
    take_file_lock,
)
from cv_workspace_client.errors import OutboxError

__all__ = ["SQLiteOutbox"]

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
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
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
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
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
            raise as_outbox_error(exc, self.path) from None
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
        self._lock_fd = take_file_lock(self.path, self.busy_timeout_ms)
        try:
            conn = connect(self.path, self.busy_timeout_ms)
        except BaseException as exc:
            if isinstance(exc, OutboxError) and exc.code == "outbox_foreign" and not lock_existed:
                # Refused untouched, but the `.lock` we made stayed beside the app's database.
                # Removed while we hold it: whoever waits on it would be refused the same way.
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}.lock")
            self._release_file_lock()
            raise
        try:
            identity = file_identity(self.path)
            assert identity is not None  # just opened, under our lock
            if page_rows is None:
                rows = load_all(conn)
                backlog = backlog_of(conn, rows[-1].seq if rows else 0)
            else:
                last = index_backlog(conn, page_rows)
                backlog = backlog_of(conn, last)
                rows = [
                    row
                    for lane in backlog
                    for row in read_lane_rows(
                        conn, lane.workspace_id, lane.sub_doc, 0, last, page_rows
                    )
                ]
            self.client_id, self.lane_seqs = load_lanes(conn, new_op_id)
            # The WAL file was just created: make its directory entry durable once.
            fsync_path(os.path.dirname(os.path.abspath(self.path)))
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
            apply_write(conn, job)
        except sqlite3.Error as exc:
            if job.done is not None:
                job.done(OutboxError("outbox_write_failed", str(exc)))
            return
        self.groups_committed += 1
        self.writes_committed += 1
        if not job.inserts:
            # Deletes and attempt counts need no fsync of their own: a delete lost in a power
            # failure only means a resend the server answers from its dedupe record. The next
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
            # The syncer thread sets `_lost` before its settle call reaches this loop: the
            # error may not be recorded yet, and a sync must fail either way
            # (tests/client/outbox/test_file_hazards.py, `..._removed_while_open_...`).
            self._error = self._error or lost_error(self.path)
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
            raise lost_error(self.path)

    def _flush_off_loop(self) -> None:
        # Under `_reading`, which `close` holds to close the connection (a checkpoint of the WAL
        # into the file, fsynced, then the WAL deleted): the WAL is either still there to fsync,
        # or gone with everything in it durable. A close that won the race made the fsync fail
        # on the missing WAL, and a durable discard was reported as failed.
        with self._reading:
            try:
                fsync_path(self.path + "-wal")
            except FileNotFoundError:
                if not self._closed or self._conn is not None:
                    raise

    async def pending(self) -> list[OutboxRow]:
        if self._conn is None or self._closed:
            raise OutboxError("outbox_closed", "the outbox is closed")
        return load_all(self._conn)

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
                return read_lane_rows(conn, workspace_id, sub_doc, after_seq, up_to_seq, limit)
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
                fsync_path(wal)
            except OSError as exc:
                error = OutboxError("outbox_sync_failed", f"fsync of the outbox failed: {exc}")
            self.fsyncs += 1
            if self._file_lost():
                # Set before `_durable` moves: `synced()` never says yes for a row of a file
                # that is gone.
                self._lost = True
                error = lost_error(self.path)
            with self._lock:
                if error is None:
                    done = self._durable = target
                wanted, self._wanted = self._wanted, False
            if wanted or error is not None:
                self._loop_call(self._settle_synced, target, error)
            if error is not None:
                return

    def _file_lost(self) -> bool:
        return file_identity(self.path) != self._identity

    def _check_identity(self) -> None:
        if not self._lost and self._file_lost():
            self._lost = True
            self._settle_synced(self._durable, lost_error(self.path))

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
