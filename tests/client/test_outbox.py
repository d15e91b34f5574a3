"""The outbox on a real SQLite file: durable settings, survival across instances, group commit."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from cv_workspace_client._machine import OutboxRow
from cv_workspace_client._outbox import MemoryOutbox, OutboxWrite, SQLiteOutbox
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


async def test_the_outbox_file_runs_wal_with_synchronous_full(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        settings = await outbox.settings()
    finally:
        await outbox.close()
    assert settings["journal_mode"] == "wal"
    assert settings["synchronous"] == 2  # FULL
    assert settings["locking_mode"] == "exclusive"


async def test_deletes_commit_without_their_own_fsync_and_inserts_stay_full(
    tmp_path: Path,
) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        assert await write(outbox, OutboxWrite(inserts=[row(1), row(2)])) is None
        assert await write(outbox, OutboxWrite(deletes=[1])) is None
        after_delete = await outbox.settings()
        assert await write(outbox, OutboxWrite(inserts=[row(3)])) is None
        pending = [r.seq for r in await outbox.pending()]
    finally:
        await outbox.close()
    # A delete-only group drops to NORMAL for its commit and restores FULL right after, so the
    # next insert (an op about to be sent) is fsynced again.
    assert after_delete["synchronous"] == 2
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


async def test_concurrent_writes_share_transactions(tmp_path: Path) -> None:
    outbox = await SQLiteOutbox.open(tmp_path / "app.outbox")
    try:
        loop = asyncio.get_running_loop()
        futures = []
        for seq in range(1, 301):
            future: asyncio.Future[BaseException | None] = loop.create_future()
            outbox.write(OutboxWrite(inserts=[row(seq)], done=future.set_result))
            futures.append(future)
        errors = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT)
        assert errors == [None] * 300
        assert outbox.writes_committed == 300
        assert outbox.groups_committed < 300  # group commit: fewer fsyncs than writes
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
