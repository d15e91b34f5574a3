"""The outbox on a real SQLite file: durable settings, survival across instances and a SIGKILL,
group fsync."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

from cv_workspace_client._core.machine import OutboxRow
from cv_workspace_client._outbox.base import MemoryOutbox, OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError

#: Bound on every wait for the outbox's writer thread.
TIMEOUT = 10


def row(seq: int, sub_doc: str = "tree") -> OutboxRow:
    op_id = f"op_{seq:08d}"
    op = {"type": "node.increment", "node_id": "n", "field": "c", "op_id": op_id}
    return OutboxRow(seq, "ws", sub_doc, op_id, json.dumps(op), created_at=1000.0 + seq)


async def write(outbox: SQLiteOutbox | MemoryOutbox, job: OutboxWrite) -> BaseException | None:
    done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    job.done = done.set_result
    outbox.write(job)
    return await asyncio.wait_for(done, TIMEOUT)


async def test_the_outbox_file_runs_wal_exclusive_and_fsyncs_on_its_syncer(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        settings = await outbox.settings()
        assert await write(outbox, OutboxWrite(inserts=[row(1)])) is None
        await asyncio.wait_for(outbox.sync(1), TIMEOUT)
        assert outbox.synced(1)
        assert outbox.fsyncs >= 1
    finally:
        await outbox.close()
    assert settings["journal_mode"] == "wal"
    # NORMAL: a commit is in the WAL without an fsync; the syncer thread fsyncs the WAL.
    assert settings["synchronous"] == 1
    assert settings["locking_mode"] == "exclusive"


async def test_a_committed_write_survives_a_crash_before_its_fsync(tmp_path: Path) -> None:
    """What survives the process is decided by the commit, not the fsync: a child process
    commits and is SIGKILLed at once; the next client finds the row."""
    path = tmp_path / "app.outbox"
    script = (
        "import asyncio, json, os, signal, sys\n"
        "from cv_workspace_client._core.machine import OutboxRow\n"
        "from cv_workspace_client._outbox.base import OutboxWrite\n"
        "from cv_workspace_client._outbox.sqlite import SQLiteOutbox\n"
        "async def main():\n"
        "    outbox = await SQLiteOutbox.open(sys.argv[1])\n"
        "    op = json.dumps({'type': 'node.increment', 'node_id': 'n', 'field': 'c',"
        " 'op_id': 'op_00000009'})\n"
        "    row = OutboxRow(9, 'ws', 'tree', 'op_00000009', op, 1.0)\n"
        "    outbox.write(OutboxWrite(inserts=[row], done=lambda e: None))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, str(path))
    assert await asyncio.wait_for(proc.wait(), TIMEOUT) == -signal.SIGKILL
    reopened = await SQLiteOutbox.open(path)
    try:
        assert [(r.seq, r.op_id) for r in reopened.rows] == [(9, "op_00000009")]
    finally:
        await reopened.close()


async def test_before_send_reports_a_write_only_after_its_fsync(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox", sync="before_send")
    try:
        seen: list[tuple[BaseException | None, bool]] = []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_done(error: BaseException | None) -> None:
            seen.append((error, outbox.synced(5)))
            done.set_result(None)

        outbox.write(OutboxWrite(inserts=[row(4), row(5)], done=on_done))
        await asyncio.wait_for(done, TIMEOUT)
    finally:
        await outbox.close()
    assert seen == [(None, True)]


async def test_a_one_row_write_commits_on_its_own(tmp_path: Path) -> None:
    """One statement on one row runs in autocommit (its own transaction); anything more is
    one BEGIN ... COMMIT. Either way the rows are in the file when `done` runs (the crash test
    above writes one row, so it covers the autocommit path)."""
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    statements: list[str] = []
    try:
        assert outbox._conn is not None
        outbox._conn.set_trace_callback(statements.append)
        assert await write(outbox, OutboxWrite(inserts=[row(1)])) is None
        assert await write(outbox, OutboxWrite(deletes=[1])) is None
        one_row = list(statements)
        statements.clear()
        assert await write(outbox, OutboxWrite(inserts=[row(2), row(3)], deletes=[2])) is None
        several = list(statements)
        outbox._conn.set_trace_callback(None)
        pending = [r.seq for r in await outbox.pending()]
    finally:
        await outbox.close()
    assert [s.split()[0] for s in one_row] == ["INSERT", "DELETE"]
    assert [s.split()[0] for s in several] == ["BEGIN", "INSERT", "INSERT", "DELETE", "COMMIT"]
    assert pending == [3]


async def test_deletes_need_no_fsync_of_their_own(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        assert await write(outbox, OutboxWrite(inserts=[row(1), row(2)])) is None
        await outbox.sync()
        fsyncs = outbox.fsyncs
        assert await write(outbox, OutboxWrite(deletes=[1])) is None
        await outbox.sync()
        assert outbox.fsyncs == fsyncs  # nothing new to make durable: no fsync asked
        assert await write(outbox, OutboxWrite(inserts=[row(3)])) is None
        pending = [r.seq for r in await outbox.pending()]
    finally:
        await outbox.close()
    assert pending == [2, 3]


async def test_pending_rows_survive_a_new_instance_in_their_original_order(tmp_path: Path) -> None:
    path = tmp_path / "app.outbox"
    first = await SQLiteOutbox.open(path)
    assert (
        await write(first, OutboxWrite(inserts=[row(1), row(2), row(3, "other"), row(4)])) is None
    )
    assert await write(first, OutboxWrite(deletes=[2], attempts=[4, 4])) is None
    await first.close()

    second = await SQLiteOutbox.open(path)
    try:
        assert [r.seq for r in second.rows] == [1, 3, 4]
        assert second.rows[0] == row(1)
        assert second.rows[2].attempts == 2
    finally:
        await second.close()
    with sqlite3.connect(path) as conn:  # the file itself, read by anyone after the close
        assert [r[0] for r in conn.execute("SELECT op_id FROM outbox ORDER BY seq")] == [
            "op_00000001",
            "op_00000003",
            "op_00000004",
        ]


async def test_a_write_is_on_disk_when_its_callback_runs(tmp_path: Path) -> None:
    path = tmp_path / "app.outbox"
    outbox = await SQLiteOutbox.open(path)
    assert await write(outbox, OutboxWrite(inserts=[row(7)])) is None
    await outbox.close(abort=True)  # a crash right after the callback loses nothing it confirmed
    reopened = await SQLiteOutbox.open(path)
    try:
        assert [r.seq for r in reopened.rows] == [7]
    finally:
        await reopened.close()


async def test_many_commits_share_an_fsync(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        for seq in range(1, 301):
            outbox.write(OutboxWrite(inserts=[row(seq)]))
        await asyncio.wait_for(outbox.sync(), TIMEOUT)
        assert outbox.writes_committed == 300
        assert outbox.synced(300)
        assert outbox.fsyncs < 300  # group sync: one fsync covers every commit before it
        assert len(await outbox.pending()) == 300
    finally:
        await outbox.close()


async def test_a_second_client_cannot_open_an_outbox_in_use(tmp_path: Path) -> None:
    path = tmp_path / "app.outbox"
    first = await SQLiteOutbox.open(path)
    try:
        with pytest.raises(OutboxError) as caught:
            await SQLiteOutbox.open(path, busy_timeout_ms=50)
        assert caught.value.code == "outbox_locked"
    finally:
        await first.close()
    second = await SQLiteOutbox.open(path)  # released on close
    await second.close()


async def test_close_applies_every_queued_write(tmp_path: Path) -> None:
    path = tmp_path / "app.outbox"
    outbox = await SQLiteOutbox.open(path)
    for seq in range(1, 51):
        outbox.write(OutboxWrite(inserts=[row(seq)]))
    await outbox.close()
    reopened = await SQLiteOutbox.open(path)
    try:
        assert len(reopened.rows) == 50
    finally:
        await reopened.close()


async def test_the_memory_outbox_keeps_the_same_contract() -> None:
    outbox = MemoryOutbox()
    assert await write(outbox, OutboxWrite(inserts=[row(1), row(2)])) is None
    assert await write(outbox, OutboxWrite(deletes=[1], attempts=[2])) is None
    pending = await outbox.pending()
    assert [(r.seq, r.attempts) for r in pending] == [(2, 1)]


async def test_an_open_cancelled_while_it_waits_for_the_lock_leaves_the_file_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`start()` cancelled (an app's timeout) while the open waits in its thread for the lock:
    the thread goes on, takes the lock and opens the file. Nobody was left to close them, so
    the file stayed locked by this process: every later client on it, in this process, failed
    with `outbox_locked`."""
    import fcntl

    from cv_workspace_client._outbox import file as outbox_file
    from cv_workspace_client._outbox import sqlite as outbox_sqlite

    path = tmp_path / "app.outbox"
    entered, taken = threading.Event(), threading.Event()
    take = outbox_file.take_file_lock

    def take_noting_entry(p: str, busy_timeout_ms: int) -> int | None:
        entered.set()
        try:
            return take(p, busy_timeout_ms)
        finally:
            taken.set()

    monkeypatch.setattr(outbox_sqlite, "take_file_lock", take_noting_entry)
    holder = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another client holds the outbox
    opening = asyncio.ensure_future(SQLiteOutbox.open(path, busy_timeout_ms=TIMEOUT * 1000))
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, entered.wait, TIMEOUT)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    os.close(holder)  # the other client leaves: the cancelled open's thread gets the lock now
    assert await loop.run_in_executor(None, taken.wait, TIMEOUT)
    monkeypatch.undo()

    # The file must come free by itself once that thread is done: a later open gets it.
    deadline = loop.time() + TIMEOUT
    codes: list[str] = []
    while loop.time() < deadline:
        try:
            outbox = await SQLiteOutbox.open(path, busy_timeout_ms=100)
        except OutboxError as exc:
            codes.append(exc.code)
            continue
        await outbox.close()
        break
    else:
        pytest.fail("the cancelled open kept the outbox locked")
    assert set(codes) <= {"outbox_locked"}
