"""The client's outbox: ops written down before their first send, deleted once answered.

Two implementations behind one small seam: `SQLiteOutbox` (a file: survives crashes and restarts;
the default whenever the app passes a path) and `MemoryOutbox` (`outbox=None`: retries and
reconnects are still safe, a process restart loses what was pending).

The SQLite file is written by **one dedicated thread** (the event loop never blocks on SQLite),
which commits everything queued since its last commit in one transaction: concurrently submitted
ops share one fsync (group commit), so `synchronous=FULL` costs a fraction of an fsync per op.
WAL keeps those commits cheap. `locking_mode=EXCLUSIVE` keeps a second client (another process)
from replaying the same rows concurrently: it fails to open with `outbox_locked` instead.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cv_workspace_client._machine import OutboxRow
from cv_workspace_client.errors import OutboxError

__all__ = ["MemoryOutbox", "Outbox", "OutboxWrite", "SQLiteOutbox"]

#: Bumped when the table changes shape; an outbox from a newer SDK is refused, not misread.
SCHEMA_VERSION = 1

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

#: How long opening waits for another connection's lock before reporting `outbox_locked`
#: (the previous client of a restart may still be closing its file).
_BUSY_TIMEOUT_MS = 5000


@dataclass(slots=True)
class OutboxWrite:
    """One unit of work for the outbox: rows to insert, seqs to delete, seqs whose attempt count
    grows. `done(error)` runs on the event loop once the write is durable (error None) or failed."""

    inserts: list[OutboxRow] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    done: Callable[[BaseException | None], None] | None = None

    def __bool__(self) -> bool:
        return bool(self.inserts or self.deletes or self.attempts)


class Outbox(abc.ABC):
    """Where pending ops live. `rows` is what a previous client left, in seq order."""

    durable: bool = False

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []

    @abc.abstractmethod
    def write(self, job: OutboxWrite) -> None:
        """Queue `job`; never blocks. Writes are applied in the order they were queued."""

    @abc.abstractmethod
    async def flush(self) -> None:
        """Return once every write queued so far is applied."""

    @abc.abstractmethod
    async def close(self, *, abort: bool = False) -> None:
        """Apply queued writes (or, with `abort`, drop them like a crash would) and release the
        outbox."""

    @abc.abstractmethod
    async def pending(self) -> list[OutboxRow]:
        """The rows currently stored, in seq order (for diagnostics and tests)."""


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
        if job.done is not None:
            job.done(None)

    async def flush(self) -> None:
        return None

    async def close(self, *, abort: bool = False) -> None:
        return None

    async def pending(self) -> list[OutboxRow]:
        return [self._rows[seq] for seq in sorted(self._rows)]


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


class _Stop:
    def __init__(self, abort: bool) -> None:
        self.abort = abort


@dataclass(slots=True)
class _Flush:
    future: asyncio.Future[None]


@dataclass(slots=True)
class _Read:
    future: asyncio.Future[Any]
    fn: Callable[[sqlite3.Connection], Any]


class SQLiteOutbox(Outbox):
    """A SQLite file outbox. Open with `await SQLiteOutbox.open(path)`."""

    durable = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_group: int = 4096,
        busy_timeout_ms: int = _BUSY_TIMEOUT_MS,
    ) -> None:
        super().__init__()
        self.path = str(path)
        self.max_group = max_group
        self.busy_timeout_ms = busy_timeout_ms
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._stopped = threading.Event()
        #: Transactions committed and writes they carried (group commit shows as writes > groups).
        self.groups_committed = 0
        self.writes_committed = 0

    @classmethod
    async def open(
        cls, path: str | os.PathLike[str], *, busy_timeout_ms: int = _BUSY_TIMEOUT_MS
    ) -> SQLiteOutbox:
        """Create the file if needed, load what is pending, and start the writer thread.

        Raises `OutboxError("outbox_locked")` if another client holds the file for longer than
        `busy_timeout_ms`."""
        self = cls(path, busy_timeout_ms=busy_timeout_ms)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future[list[OutboxRow]] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="cv-outbox-writer", daemon=True
        )
        self._thread.start()
        self.rows = await started
        return self

    # -- API (event loop side) ---------------------------------------------------------------------

    def write(self, job: OutboxWrite) -> None:
        if self._closed:
            if job.done is not None:
                job.done(OutboxError("outbox_closed", "the outbox is closed"))
            return
        self._jobs.put(job)

    async def flush(self) -> None:
        if self._closed:
            return
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._jobs.put(_Flush(future))
        await future

    async def pending(self) -> list[OutboxRow]:
        assert self._loop is not None
        future: asyncio.Future[list[OutboxRow]] = self._loop.create_future()
        self._jobs.put(_Read(future, _load))
        return await future

    async def settings(self) -> dict[str, Any]:
        """The durability settings the writer connection runs with (journal_mode, synchronous,
        locking_mode), as SQLite reports them."""
        assert self._loop is not None
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()

        def read(conn: sqlite3.Connection) -> dict[str, Any]:
            return {
                name: conn.execute(f"PRAGMA {name}").fetchone()[0]
                for name in ("journal_mode", "synchronous", "locking_mode")
            }

        self._jobs.put(_Read(future, read))
        return await future

    async def close(self, *, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_Stop(abort))
        # Waiting on a threading.Event from a worker thread keeps the loop free meanwhile.
        await asyncio.get_running_loop().run_in_executor(None, self._stopped.wait)

    # -- writer thread -----------------------------------------------------------------------------

    def _run(self, started: asyncio.Future[list[OutboxRow]]) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            conn = _connect(self.path, self.busy_timeout_ms)
            rows = _load(conn)
        except BaseException as exc:
            error = _as_outbox_error(exc, self.path)
            loop.call_soon_threadsafe(_settle_future, started, None, error)
            self._stopped.set()
            return
        loop.call_soon_threadsafe(_settle_future, started, rows, None)
        try:
            self._serve(conn, loop)
        finally:
            conn.close()
            self._stopped.set()

    def _serve(self, conn: sqlite3.Connection, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            first = self._jobs.get()
            batch: list[Any] = [first]
            # Everything already queued joins this transaction: one fsync for the lot.
            while len(batch) < self.max_group:
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            writes: list[OutboxWrite] = []
            stop: _Stop | None = None
            for item in batch:
                if isinstance(item, OutboxWrite):
                    writes.append(item)
                    continue
                if writes:  # keep order: writes queued before a flush/read land first
                    self._commit(conn, loop, writes)
                    writes = []
                if isinstance(item, _Stop):
                    stop = item
                    break
                if isinstance(item, _Flush):
                    loop.call_soon_threadsafe(_settle_future, item.future, None, None)
                elif isinstance(item, _Read):
                    try:
                        value, error = item.fn(conn), None
                    except BaseException as exc:
                        value, error = None, exc
                    loop.call_soon_threadsafe(_settle_future, item.future, value, error)
            if stop is not None:
                if not stop.abort:
                    leftovers = _drain(self._jobs)
                    remaining = [item for item in leftovers if isinstance(item, OutboxWrite)]
                    if remaining:
                        self._commit(conn, loop, remaining)
                return
            if writes:
                self._commit(conn, loop, writes)

    def _commit(
        self, conn: sqlite3.Connection, loop: asyncio.AbstractEventLoop, writes: list[OutboxWrite]
    ) -> None:
        error: BaseException | None = None
        # Only an insert must reach the disk before the op is sent. A group of deletes (answered
        # ops) and attempt counts commits without its own fsync: lost in a crash, it only means
        # a replay the server answers from its dedupe record. The next durable commit fsyncs the
        # WAL and carries it along. This halves the fsyncs of a client awaiting each op.
        durable = any(job.inserts for job in writes)
        if not durable:
            conn.execute("PRAGMA synchronous = NORMAL")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for job in writes:
                    if job.inserts:
                        conn.executemany(
                            "INSERT OR REPLACE INTO outbox (seq, workspace_id, sub_doc, op_id, op,"
                            " created_at, attempts, atomic_group) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
                        conn.executemany(
                            "DELETE FROM outbox WHERE seq = ?", [(seq,) for seq in job.deletes]
                        )
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
        except BaseException as exc:
            error = OutboxError("outbox_write_failed", str(exc))
        else:
            self.groups_committed += 1
        finally:
            if not durable:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA synchronous = FULL")
            self.writes_committed += len(writes)
        callbacks = [job.done for job in writes if job.done is not None]
        if callbacks:
            # One wake-up of the event loop per transaction, not one per write.
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                loop.call_soon_threadsafe(_run_callbacks, callbacks, error)


def _connect(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # One client per outbox file: two would replay the same rows side by side.
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        conn.execute("PRAGMA journal_mode = WAL")
        # An op is on disk before its first send: the promise, not a tuning knob.
        conn.execute("PRAGMA synchronous = FULL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise OutboxError(
                "outbox_version",
                f"outbox schema {version} is newer than this SDK ({SCHEMA_VERSION})",
            )
        conn.execute("BEGIN IMMEDIATE")  # takes (and, in EXCLUSIVE mode, keeps) the write lock
        conn.execute(_SCHEMA)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.close()
        raise
    return conn


def _load(conn: sqlite3.Connection) -> list[OutboxRow]:
    cursor = conn.execute(
        "SELECT seq, workspace_id, sub_doc, op_id, op, created_at, attempts, atomic_group"
        " FROM outbox ORDER BY seq"
    )
    return [OutboxRow(*row) for row in cursor.fetchall()]


def _drain(jobs: queue.SimpleQueue[Any]) -> list[Any]:
    items: list[Any] = []
    while True:
        try:
            items.append(jobs.get_nowait())
        except queue.Empty:
            return items


def _as_outbox_error(exc: BaseException, path: str) -> BaseException:
    if isinstance(exc, OutboxError):
        return exc
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return OutboxError(
            "outbox_locked", f"another client holds the outbox {os.path.basename(path)}"
        )
    if isinstance(exc, sqlite3.Error):
        return OutboxError("outbox_open_failed", str(exc))
    return exc


def _settle_future(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _run_callbacks(
    callbacks: list[Callable[[BaseException | None], None]], error: BaseException | None
) -> None:
    for callback in callbacks:
        callback(error)
