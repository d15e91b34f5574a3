"""The embedded SQLite engine every store shares: one writer thread with group commit, reads on
other connections, nothing blocking the event loop (STYLE: datasette/sqlite-utils).

Why one writer for every store: SQLite allows one writer at a time anyway. Funnelling every write
through one thread turns lock contention into a queue, and lets the thread commit many waiting
jobs in **one** transaction (group commit): one fsync for the lot, which is what makes
`synchronous=FULL` affordable.

Each job of a group of several runs inside its own SAVEPOINT, so a job that raises is rolled back
alone and the others in the group still commit (a job alone in its group is rolled back with the
transaction, which holds nothing else). Jobs may register undo callbacks for in-memory caches
they changed; those run if the job's savepoint or the whole group's COMMIT fails, so caches never
run ahead of disk.

A storage fault (disk full, read-only file, I/O error) fails the jobs it touched with
`StorageUnavailable` and leaves the writer serving: the transaction is rolled back, the next group
begins afresh (and after a read-only refusal on a newly opened connection, since SQLite opens a
file it may not write read-only for good), so writes resume by themselves once the disk has room
again (tests/server/http/test_storage_faults_http.py, tests/acceptance/test_storage_faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import sqlite_utils

from cv_server.storage_faults import StorageFaults, StorageUnavailable

__all__ = ["SQLiteDatabase", "Transaction"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long a connection waits for SQLite's own lock before failing (only readers and a second
#: process can contend; our writes are already serialised by the writer thread).
_BUSY_TIMEOUT_MS = 5000

#: SQLite's primary result codes that mean "the storage refused", not "this write is wrong":
#: SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN (a -wal or journal it cannot
#: create). Extended codes keep the primary one in their low byte.
_STORAGE_FAULTS: Final = frozenset({8, 10, 13, 14})
_SQLITE_READONLY: Final = 8


def storage_fault(exc: BaseException) -> StorageUnavailable | None:
    """`exc` as a `StorageUnavailable` (the driver's error chained) if SQLite raised it because
    the storage refused the write, else None."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(code, int) or code & 0xFF not in _STORAGE_FAULTS:
        return None
    fault = StorageUnavailable(str(exc) or type(exc).__name__)
    fault.__cause__ = exc
    return fault


#: The largest existing file converted to incremental auto-vacuum at open (a `VACUUM` rewrites
#: the whole file, holding the writer and needing as much free disk again): 1 GiB takes seconds
#: to a minute on ordinary disks. A larger file is served as it is, with a warning naming the
#: offline conversion (docs/operating.md, "Storage over time").
CONVERT_AT_OPEN_MAX_BYTES = 1024**3


@dataclass
class Transaction:
    """Handed to a write job: the writer's connection, plus undo registration.

    A job must not end the group transaction itself (COMMIT, ROLLBACK, RELEASE): it is failed,
    and the other jobs of its group are run again as if the transaction had been rolled back.
    """

    conn: sqlite3.Connection
    db: sqlite_utils.Database
    _undos: list[Callable[[], None]] = field(default_factory=list)
    #: Op-log ops this job writes (`count_ops`): what `on_group_commit` reports per group.
    ops: int = 0

    def count_ops(self, n: int) -> None:
        self.ops += n

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Register `undo` to run (LIFO) if this job's writes do not reach disk."""
        self._undos.append(undo)

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self.conn.executemany(sql, rows)


@dataclass
class _Job(Generic[T]):
    fn: Callable[[Transaction], T]
    future: asyncio.Future[T]
    loop: asyncio.AbstractEventLoop


_STOP = object()


def _create_owner_only(path: str) -> int | None:
    """Create the database file readable by its owner only, if it does not exist yet; return
    the mode of an existing file that others than its owner may read (else None).

    The file holds the token secret: at SQLite's default (0644 under the usual umask) any local
    user could read it and mint a token for every workspace. SQLite gives the `-wal` and `-shm`
    files the mode of the database file. An existing file keeps the mode its operator chose (a
    shared group for backups, say), with a warning (`_warn_loose_mode`) once it has opened as a
    database: one made by an older version, or copied in with the default mode, was served
    silently."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = os.stat(path).st_mode & 0o777
        return mode if mode & 0o077 else None
    os.close(fd)
    return None


def _convert_to_incremental_vacuum(conn: sqlite3.Connection, path: str) -> None:
    """Switch a file made before incremental auto-vacuum (or by another tool) to it, once: a
    `VACUUM` rewrites it, so only files up to `CONVERT_AT_OPEN_MAX_BYTES`; a larger one is
    served as it is, with a warning (docs/operating.md). Pinned by
    `test_an_existing_file_is_converted_to_incremental_auto_vacuum_at_open`."""
    if path == ":memory:" or int(conn.execute("PRAGMA auto_vacuum").fetchone()[0]) == 2:
        return
    size = os.path.getsize(path)
    if size > CONVERT_AT_OPEN_MAX_BYTES:
        logger.warning(
            "%s (%d bytes) does not give freed space back to the file system; stop the server"
            " and run: sqlite3 %s 'PRAGMA auto_vacuum = INCREMENTAL; VACUUM;'"
            " (needs as much free disk as the file; docs/operating.md)",
            path,
            size,
            path,
        )
        return
    began = time.perf_counter()
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("VACUUM")
    logger.info(
        "converted %s (%d bytes) to incremental auto-vacuum in %.1f s",
        path,
        size,
        time.perf_counter() - began,
    )


def _warn_loose_mode(path: str, mode: int) -> None:
    # Only once the file opened as a database: a file that is none (a mistyped path) is
    # refused, and the warning came first, about a secret it did not hold.
    logger.warning(
        "%s holds the token secret and is readable by others than its owner (mode "
        "%s): any of them can mint a token for every workspace; chmod 600 it",
        path,
        oct(mode),
    )


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA foreign_keys = ON")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    else:
        # Before the first write creates the file's header, where the mode is stored: a new
        # file gives freed pages back to the file system in `incremental_vacuum` steps. Only a
        # new file: an existing one is converted apart, and one the storage refuses writes to
        # is still served read-only (tests/acceptance/test_storage_faults.py).
        if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("PRAGMA journal_mode = WAL")
        # An acknowledged write is on disk: the promise of the product, not a tuning knob.
        conn.execute("PRAGMA synchronous = FULL")
    return conn


class SQLiteDatabase:
    """Open with `await SQLiteDatabase.open(path, schema=...)`; close with `await db.close()`.

    `write(fn)` runs `fn(tx)` on the writer thread inside a group transaction and resolves once the
    group has committed (durably). `read(fn)` runs `fn(conn)` on a reader connection.
    """

    def __init__(self, path: str | Path, *, max_group: int = 512, readers: int = 2) -> None:
        self.path = str(path)
        self.max_group = max_group
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="sqlite-read")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._closed = False
        #: The writer thread's connection (replaced by `_reopen`); set once the thread starts.
        self._conn: sqlite3.Connection
        self.groups_committed = 0
        self.jobs_committed = 0
        #: Called on the writer thread after each COMMIT of a group that held op-log ops, with
        #: the seconds from BEGIN to the end of COMMIT and the ops it held (`Transaction.
        #: count_ops`). It must be quick and thread-safe (prometheus_client's metrics are).
        self.on_group_commit: Callable[[float, int], None] | None = None
        #: Writes refused for storage, and whether the last write was (`/readyz`).
        self.faults = StorageFaults()

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        schema: Callable[[sqlite_utils.Database], None] | None = None,
        max_group: int = 512,
        readers: int = 2,
    ) -> SQLiteDatabase:
        """Create the file if needed, apply `schema` (idempotent) and start the writer thread."""
        self = cls(path, max_group=max_group, readers=readers)
        loose_mode = None
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            loose_mode = _create_owner_only(self.path)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writer = threading.Thread(
            target=self._run_writer,
            args=(schema, started, asyncio.get_running_loop()),
            name="sqlite-writer",
            daemon=True,
        )
        self._writer.start()
        await started
        if loose_mode is not None:
            _warn_loose_mode(self.path, loose_mode)
        return self

    # -- public API ------------------------------------------------------------------------------

    def submit(self, fn: Callable[[Transaction], T]) -> asyncio.Future[T]:
        """`write` without the coroutine: queue `fn` and return the future of its result (for
        callers that chain a callback instead of awaiting: one task fewer per write)."""
        if self._closed:
            raise RuntimeError("database is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Job(fn, future, loop))
        return future

    async def write(self, fn: Callable[[Transaction], T]) -> T:
        """Run `fn` in the next group transaction; return its result once committed to disk.

        `fn` runs on the writer thread: it must not touch the event loop, and must not block on
        anything but SQLite. If it raises, its own writes are rolled back and the error re-raised
        here; other jobs of the group are unaffected.
        """
        return await self.submit(fn)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` on a read-only connection in a reader thread (sees committed data)."""
        if self._closed:
            raise RuntimeError("database is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._run_read, fn)

    async def incremental_vacuum(self, max_pages: int) -> int:
        """Give at most `max_pages` free pages back to the file system (the file shrinks), in one
        write job; return how many. Call after deleting rows, until it answers less than
        `max_pages`. 0 on a file not in incremental auto-vacuum mode (`convert_at_open`)."""

        def job(tx: Transaction) -> int:
            if int(tx.execute("PRAGMA auto_vacuum").fetchone()[0]) != 2:
                return 0
            free = int(tx.execute("PRAGMA freelist_count").fetchone()[0])
            pages = min(free, max_pages)
            # Python's sqlite3 steps a statement that returns no row once, and each step of
            # this pragma frees one page: one execution per page (microseconds each).
            for _ in range(pages):
                tx.execute("PRAGMA incremental_vacuum")
            return pages

        return await self.write(job)

    async def close(self) -> None:
        """Finish every queued write, then stop the threads and close the connections."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        if self._writer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._writer.join)
        self._readers.shutdown(wait=True)
        with self._reader_lock:
            for conn in self._reader_conns:
                conn.close()
            self._reader_conns.clear()

    # -- threads ---------------------------------------------------------------------------------

    def _run_read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = _connect(self.path, readonly=True)
            self._local.conn = conn
            with self._reader_lock:
                self._reader_conns.append(conn)
        return fn(conn)

    def _run_writer(
        self,
        schema: Callable[[sqlite_utils.Database], None] | None,
        started: asyncio.Future[None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        try:
            conn = _connect(self.path)
            _convert_to_incremental_vacuum(conn, self.path)
            db = sqlite_utils.Database(conn)
            if schema is not None:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    schema(db)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
        except BaseException as exc:
            loop.call_soon_threadsafe(started.set_exception, exc)
            return
        loop.call_soon_threadsafe(started.set_result, None)
        self._conn = conn
        try:
            self._writer_loop(db)
        finally:
            self._conn.close()

    def _reopen(self) -> sqlite_utils.Database:
        """A fresh writer connection (the old one closed): SQLite opens a file it may not write
        read-only and keeps it so, so only a new connection sees the file writable again. If
        opening fails, the old connection stays and the next group is refused as before."""
        try:
            conn = _connect(self.path)
        except sqlite3.Error:
            logger.warning("reopening %s for writing failed", self.path, exc_info=True)
            return sqlite_utils.Database(self._conn)
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()
        self._conn = conn
        return sqlite_utils.Database(conn)

    def _writer_loop(self, db: sqlite_utils.Database) -> None:
        stopping = False
        read_only = False
        while not stopping:
            first = self._jobs.get()
            if first is _STOP:
                break
            group: list[_Job[Any]] = [first]
            # Everything already waiting joins this transaction: that is the group commit.
            while len(group) < self.max_group:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stopping = True
                    break
                group.append(nxt)
            if read_only:
                # Reopened when the next write comes, not when the refusal happened: the file
                # may have become writable in between (tests/acceptance/test_storage_faults.py).
                db = self._reopen()
            try:
                read_only = self._commit_group(self._conn, db, group)
            except sqlite3.Error as exc:
                # Rolling back itself failed (an I/O error on a dying disk): the group is failed
                # whole, nothing of it acknowledged, and the next group gets a new connection
                # rather than a thread that died with every future unresolved.
                with contextlib.suppress(sqlite3.Error):
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                logger.warning("a write group failed outside its jobs", exc_info=True)
                self._fail(group, exc)
                read_only = True

    def _fail(self, group: list[_Job[Any]], exc: sqlite3.Error) -> None:
        fault = storage_fault(exc)
        if fault is not None:
            self.faults.refused(str(fault))
        self._resolve([(job, False, fault or exc) for job in group])

    def _commit_group(
        self, conn: sqlite3.Connection, db: sqlite_utils.Database, group: list[_Job[Any]]
    ) -> bool:
        """Run `group` and settle its futures; True if the storage refused a write as read-only
        (the caller then opens a new connection before the next group)."""
        final: dict[int, tuple[bool, Any]] = {}
        pending = group
        while pending:
            # Each retry drops the job that lost the transaction, so this ends.
            pending = self._try_group(conn, db, pending, final)
        read_only = False
        outcomes: list[tuple[_Job[Any], bool, Any]] = []
        for job in group:
            ok, value = final[id(job)]
            fault = None if ok else storage_fault(value)
            if fault is not None:
                cause = value
                read_only = read_only or (cause.sqlite_errorcode & 0xFF) == _SQLITE_READONLY
                self.faults.refused(str(fault))
                value = fault
            outcomes.append((job, ok, value))
        # Settled in queue order whatever the retries: appends queued in order resolve in order.
        self._resolve(outcomes)
        return read_only

    def _try_group(
        self,
        conn: sqlite3.Connection,
        db: sqlite_utils.Database,
        group: list[_Job[Any]],
        final: dict[int, tuple[bool, Any]],
    ) -> list[_Job[Any]]:
        """Run `group` in one transaction and record each job's outcome in `final`; return the
        jobs to run again in a fresh transaction if one job's failure took the whole transaction
        (and so the other jobs' writes) with it."""
        outcomes: list[tuple[_Job[Any], bool, Any]] = []
        committed_undos: list[Callable[[], None]] = []
        ops = 0
        began = time.perf_counter()
        changes = conn.total_changes
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            for job in group:
                final[id(job)] = (False, exc)
            return []
        # A job alone in its group needs no savepoint: if it fails, rolling back the whole
        # transaction takes back exactly its writes, and two statements fewer per commit is what
        # the one-writer op path pays (tests/server/test_sqlite_engine_failures.py pins both).
        alone = len(group) == 1
        for index, job in enumerate(group):
            tx = Transaction(conn, db)
            if not alone:
                # One savepoint name for every job (each is released before the next starts):
                # distinct names would overflow sqlite3's statement cache and re-prepare each
                # time.
                conn.execute("SAVEPOINT job")
            try:
                result = job.fn(tx)
            except BaseException as exc:  # the job's error belongs to its caller
                ok, value = False, _deliverable(exc)
            else:
                ok, value = True, result
            if not conn.in_transaction:
                # SQLite ended the whole transaction, not just the failed statement
                # (RAISE(ROLLBACK), and SQLITE_FULL / IOERR / NOMEM may): the savepoint is gone
                # and so are the writes of the jobs before it. `ROLLBACK TO job` would raise and
                # kill this thread with every future unresolved. Undo every cache change, fail
                # this job alone, and run the others again (none was acknowledged).
                for undo in reversed(tx._undos):
                    undo()
                for undo in reversed(committed_undos):
                    undo()
                if ok:
                    value = RuntimeError("a write job must not end the group transaction")
                final[id(job)] = (False, value)
                for earlier, earlier_ok, earlier_value in outcomes:
                    if not earlier_ok:
                        final[id(earlier)] = (False, earlier_value)
                return [earlier for earlier, earlier_ok, _ in outcomes if earlier_ok] + group[
                    index + 1 :
                ]
            if ok:
                if not alone:
                    conn.execute("RELEASE job")
                committed_undos.extend(tx._undos)
                ops += tx.ops
            else:
                if alone:
                    conn.execute("ROLLBACK")
                else:
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                for undo in reversed(tx._undos):
                    undo()
            outcomes.append((job, ok, value))
        if not conn.in_transaction:  # the lone job failed and was rolled back: nothing to commit
            for job, ok, value in outcomes:
                final[id(job)] = (ok, value)
            return []
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            for undo in reversed(committed_undos):
                undo()
            outcomes = [(job, False, exc if ok else value) for job, ok, value in outcomes]
        else:
            self.groups_committed += 1
            self.jobs_committed += sum(1 for _, ok, _ in outcomes if ok)
            if conn.total_changes != changes:  # a write reached disk: the storage takes them
                self.faults.wrote()
            if ops and self.on_group_commit is not None:
                try:
                    self.on_group_commit(time.perf_counter() - began, ops)
                except Exception:  # a metric must never fail the writes it measures
                    logger.exception("on_group_commit failed")
        for job, ok, value in outcomes:
            final[id(job)] = (ok, value)
        return []

    @staticmethod
    def _resolve(outcomes: list[tuple[_Job[Any], bool, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Job[Any], bool, Any]]] = {}
        for item in outcomes:
            by_loop.setdefault(item[0].loop, []).append(item)
        for loop, items in by_loop.items():
            # One wake-up per loop per group, not one per job.
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, items)


def _deliverable(exc: BaseException) -> BaseException:
    """`exc` as a job's future may carry it. asyncio refuses StopIteration in `set_exception`
    (TypeError on 3.11, which would escape `_settle` and strand the rest of the group), and a
    CancelledError would cancel the awaiting task, which was never cancelled: both are wrapped."""
    if isinstance(exc, (StopIteration, asyncio.CancelledError)):
        wrapped = RuntimeError(f"write job raised {type(exc).__name__}")
        wrapped.__cause__ = exc
        return wrapped
    return exc


def _settle(items: list[tuple[_Job[Any], bool, Any]]) -> None:
    for job, ok, value in items:
        if job.future.done():  # the caller was cancelled; the write itself still happened
            continue
        if ok:
            job.future.set_result(value)
        else:
            job.future.set_exception(value)
