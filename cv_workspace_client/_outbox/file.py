"""The outbox file's SQL, identity and lock, for `SQLiteOutbox` (`_outbox/sqlite.py`): the
schema and the check that a file is an outbox, the loads and pages of a backlog, the write of one
`OutboxWrite`, and the sidecar file lock that picks one client of two starting at once."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from cv_workspace_client._core.effects import LaneBacklog, OutboxRow
from cv_workspace_client._outbox.base import OutboxWrite, take_page
from cv_workspace_client.errors import OutboxError

__all__ = [
    "APPLICATION_ID",
    "BUSY_TIMEOUT_MS",
    "SCHEMA_VERSION",
    "apply_write",
    "as_outbox_error",
    "backlog_of",
    "claim",
    "connect",
    "file_identity",
    "fsync_path",
    "index_backlog",
    "load_all",
    "load_lanes",
    "locked_error",
    "lost_error",
    "read_lane_rows",
    "take_file_lock",
]

#: Bumped when the table changes shape; an outbox from a newer SDK is refused, not misread.
SCHEMA_VERSION = 1

#: Marks the file as an outbox (SQLite's `PRAGMA application_id`, the bytes "cvob"), so that a
#: database of another application passed as `outbox=` is refused instead of taken over.
APPLICATION_ID = 0x63766F62

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

#: The client id the file's ops are minted under (one row) and each lane's last minted seq
#: (docs/client.md#exactly-once). Tables of their own, so the `outbox` table keeps its shape.
_LANE_TABLES = ("outbox_client", "outbox_lanes")
_LANES_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS outbox_client (id TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS outbox_lanes (workspace_id TEXT NOT NULL, sub_doc TEXT NOT NULL,"
    " last_seq INTEGER NOT NULL, PRIMARY KEY (workspace_id, sub_doc)) WITHOUT ROWID",
)
_UPSERT_LANE = (
    "INSERT INTO outbox_lanes (workspace_id, sub_doc, last_seq) VALUES (?, ?, ?)"
    " ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET last_seq = max(last_seq, excluded.last_seq)"
)

#: A renumbered op (`Restamp`): same row, new lane stamp; the lane's last seq set down with it.
_RESTAMP = "UPDATE outbox SET op = ? WHERE seq = ?"
_SET_LANE = (
    "INSERT INTO outbox_lanes (workspace_id, sub_doc, last_seq) VALUES (?, ?, ?)"
    " ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET last_seq = excluded.last_seq"
)

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

_COUNT_ATTEMPT = "UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?"
_DELETE = "DELETE FROM outbox WHERE seq = ?"
_DELETE_RANGE = "DELETE FROM outbox WHERE workspace_id = ? AND sub_doc = ? AND seq > ? AND seq <= ?"

#: How long opening waits for another connection's lock before reporting `outbox_locked`
#: (the previous client of a restart may still be closing its file).
BUSY_TIMEOUT_MS = 5000


def _row_values(r: OutboxRow) -> tuple[Any, ...]:
    return (
        r.seq,
        r.workspace_id,
        r.sub_doc,
        r.op_id,
        r.op_json,
        r.created_at,
        r.attempts,
        r.atomic_group,
    )


def _statements(job: OutboxWrite) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The job as (statement, parameter rows), in the order they must run."""
    statements: list[tuple[str, list[tuple[Any, ...]]]] = []
    if job.inserts:
        statements.append((_INSERT, [_row_values(r) for r in job.inserts]))
        lanes: dict[tuple[str, str], int] = {}
        for r in job.inserts:
            if r.lane_seq is not None:
                key = (r.workspace_id, r.sub_doc)
                lanes[key] = max(lanes.get(key, 0), r.lane_seq)
        if lanes:
            # In the insert's transaction: a lane's seq is never behind an op stored with it.
            statements.append((_UPSERT_LANE, [(*key, seq) for key, seq in lanes.items()]))
    if job.restamps:
        statements.append((_RESTAMP, [(r.op_json, r.seq) for r in job.restamps]))
    if job.lane_seqs:
        statements.append((_SET_LANE, list(job.lane_seqs)))
    if job.attempts:
        statements.append((_COUNT_ATTEMPT, [(seq,) for seq in job.attempts]))
    if job.deletes:
        statements.append((_DELETE, [(seq,) for seq in job.deletes]))
    for lane in job.ranges:
        statements.append(
            (_DELETE_RANGE, [(lane.workspace_id, lane.sub_doc, lane.after_seq, lane.up_to_seq)])
        )
    return statements


def apply_write(conn: sqlite3.Connection, job: OutboxWrite) -> None:
    """Commit `job` as one transaction (on return it is in the WAL: it survives the process).

    A job of one statement on one row (an op's insert, an answered op's delete: what a writer
    awaiting each op makes) runs in autocommit: SQLite wraps the statement in its own
    transaction, as atomic and as durable as BEGIN ... COMMIT, two statements fewer
    (tests/client/outbox/test_sqlite.py::test_a_one_row_write_commits_on_its_own)."""
    statements = _statements(job)
    if len(statements) == 1 and len(statements[0][1]) == 1:
        sql, (params,) = statements[0]
        conn.execute(sql, params)
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql, rows in statements:
            if len(rows) == 1:
                conn.execute(sql, rows[0])
            else:
                conn.executemany(sql, rows)
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


def connect(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # One client per outbox file: two would resend the same rows side by side. The lock is a
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
        claim(conn)
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


def claim(conn: sqlite3.Connection) -> None:
    """Inside the open's transaction: make a new file an outbox, or check that it is one.

    Raises `OutboxError("outbox_foreign")` for another application's database and
    `OutboxError("outbox_version")` for an outbox from a newer SDK, having written nothing."""
    application_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    ours = tables - {_BACKLOG_INDEX, *_LANE_TABLES} == {"outbox"}
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


def load_lanes(
    conn: sqlite3.Connection, mint: Callable[[], str]
) -> tuple[str, dict[tuple[str, str], int]]:
    """The file's client id (minted with `mint` and stored on first use) and its lanes' last
    minted seqs."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _LANES_SCHEMA:
            conn.execute(statement)
        row = conn.execute("SELECT id FROM outbox_client").fetchone()
        if row is None:
            client_id = mint()
            conn.execute("INSERT INTO outbox_client (id) VALUES (?)", (client_id,))
        else:
            client_id = str(row[0])
        lanes = {
            (str(ws), str(doc)): int(seq)
            for ws, doc, seq in conn.execute(
                "SELECT workspace_id, sub_doc, last_seq FROM outbox_lanes"
            )
        }
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    return client_id, lanes


def file_identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def lost_error(path: str) -> OutboxError:
    return OutboxError(
        "outbox_sync_failed",
        f"the outbox file {os.path.basename(path)} was removed or replaced while open: "
        "the ops it held are gone",
    )


def fsync_path(path: str) -> None:
    """fsync(2) a file or directory by path (any descriptor flushes the file's pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_all(conn: sqlite3.Connection) -> list[OutboxRow]:
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


def index_backlog(conn: sqlite3.Connection, page_rows: int) -> int:
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


def backlog_of(conn: sqlite3.Connection, last: int) -> list[LaneBacklog]:
    """Rows per lane up to seq `last`, from the backlog index alone when there is one (no op
    text read): ~0.15 s for 1,000,000."""
    cursor = conn.execute(
        "SELECT workspace_id, sub_doc, count(*), max(seq) FROM outbox"
        f" WHERE seq <= {int(last)} GROUP BY workspace_id, sub_doc"
    )
    return [LaneBacklog(*lane) for lane in cursor]


def read_lane_rows(
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
        return take_page(rows, limit)
    finally:
        cursor.close()  # ends the read: it must not hold the connection's snapshot open


#: Waits between two tries of a held outbox lock, in ms, then the last one again: SQLite's own
#: busy handler's schedule (sqliteDefaultBusyCallback), which this lock stands in front of.
_LOCK_RETRY_MS = (1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100)


def take_file_lock(path: str, busy_timeout_ms: int) -> int | None:
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
                raise locked_error(path) from None
        except BaseException:
            os.close(fd)
            raise
        wait = _LOCK_RETRY_MS[min(tries, len(_LOCK_RETRY_MS) - 1)] / 1000
        tries += 1
        time.sleep(max(0.0, min(wait, deadline - time.monotonic())))


def locked_error(path: str) -> OutboxError:
    return OutboxError("outbox_locked", f"another client holds the outbox {os.path.basename(path)}")


def as_outbox_error(exc: BaseException, path: str) -> BaseException:
    if isinstance(exc, OutboxError):
        return exc
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return locked_error(path)
    if isinstance(exc, sqlite3.Error | OSError):
        return OutboxError("outbox_open_failed", str(exc))
    return exc
