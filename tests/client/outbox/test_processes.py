"""The outbox file under real processes and real sizes: SIGKILLs at random instants (mid-fsync,
mid-checkpoint), 100,000 ops left by an offline app, a long online run, a second process on the
same file, and the file's directory removed under an open client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_workspace_client import WorkspaceClient
from cv_workspace_client._core.machine import OutboxRow
from cv_workspace_client._outbox.base import OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError

from ..helpers import SECRET, WS, fast_config, server_log, token_for

TIMEOUT = 30
REPO = Path(__file__).resolve().parents[3]
PAGE = 4096
#: SQLite's automatic checkpoint threshold (pages): the WAL is reset once it is reached.
AUTOCHECKPOINT_PAGES = 1000


def increment(seq: int, pad: int = 0) -> OutboxRow:
    """A row as the client writes it: a node.increment whose op_id names its seq."""
    op_id = f"op{seq:010d}"
    op: dict[str, object] = {"type": "node.increment", "node_id": "n", "field": "c"}
    if pad:
        op["meta"] = {"pad": "x" * pad}  # a wider op: more WAL pages per commit
    op["op_id"] = op_id
    return OutboxRow(seq, WS, "tree", op_id, json.dumps(op, separators=(",", ":")), 1.0)


def stamped(seq: int) -> OutboxRow:
    """`increment(seq)` as the SDK mints it: with its lane stamp, which the outbox stores with
    the lane's last minted seq (docs/client.md#exactly-once)."""
    row = increment(seq)
    op = {**json.loads(row.op_json), "client_id": "c" * 21, "seq": seq, "minted_at": 1}
    return replace(row, op_json=json.dumps(op, separators=(",", ":")), lane_seq=seq)


def file_rows(path: Path) -> list[tuple[int, str, str]]:
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return list(conn.execute("SELECT seq, op_id, op FROM outbox ORDER BY seq"))
    finally:
        conn.close()


def size(path: Path | str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


async def start_server(tmp_path: Path, requests: list[int] | None = None) -> TestServer:
    """A real server; `requests` (if given) records the op count of every POST .../ops."""
    app = create_app(ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET))
    if requests is not None:

        @web.middleware
        async def count(
            request: web.Request,
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> web.StreamResponse:
            if request.method == "POST" and request.path.endswith("/ops"):
                requests.append(len((await request.json())["ops"]))
            return await handler(request)

        app.middlewares.append(count)
    server = TestServer(app)
    await server.start_server()
    return server


def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def insert_counter_node(url: str) -> None:
    async with WorkspaceClient(url, token=token_for(WS), config=fast_config()) as setup:
        await setup.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))


# -- SIGKILL at random instants --------------------------------------------------------------------

#: Writes wide rows at full speed (so SQLite checkpoints every few hundred commits while the
#: syncer fsyncs the WAL), deletes the oldest as if answered, and reports each confirmed write
#: (`w <highest seq>`) and delete (`d <highest deleted seq>`) once its callback ran.
KILLED_WRITER = """
import asyncio, json, sys
from cv_workspace_client._core.machine import OutboxRow
from cv_workspace_client._outbox.base import OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from tests.client.outbox.test_processes import increment

async def main():
    outbox = await SQLiteOutbox.open(sys.argv[1])
    seq = max((r.seq for r in outbox.rows), default=0)
    oldest = min((r.seq for r in outbox.rows), default=seq + 1)
    print("open", seq, "-", flush=True)
    while True:
        rows = [increment(s, pad=900) for s in range(seq + 1, seq + 9)]
        seq += 8
        outbox.write(OutboxWrite(inserts=rows, done=lambda e, s=seq: print("w", s, e, flush=True)))
        if seq - oldest > 400:
            gone = list(range(oldest, oldest + 8))
            oldest += 8
            outbox.write(OutboxWrite(deletes=gone, done=lambda e, s=gone[-1]: print("d", s, e,
                flush=True)))
        await asyncio.sleep(0)

asyncio.run(main())
"""


async def test_outbox_killed_at_random_instants_stays_whole_gapless_and_replays_once_in_order(
    tmp_path: Path,
) -> None:
    """20 SIGKILLs of a process writing at full speed (the syncer fsyncing, SQLite checkpointing
    about every 200 commits): after each, the file opens and passes integrity_check, the pending
    seqs are one gapless run (no later op kept while an earlier unanswered one was lost), every
    confirmed write not confirmed deleted is there, intact. Then a client replays the survivors
    against a real server: each committed once, in seq order."""
    rng = random.Random(7)
    path = tmp_path / "app.outbox"
    total_written = 0
    max_wal = 0
    for _ in range(20):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            KILLED_WRITER,
            str(path),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        written = deleted = opened_at = 0
        kill_after = rng.randint(300, 4000)
        seen = 0
        try:
            async with asyncio.timeout(TIMEOUT):
                while seen < kill_after:
                    word, value, error = (await proc.stdout.readline()).decode().split()
                    if word == "w":
                        assert error == "None"
                        written = int(value)
                    elif word == "d":
                        deleted = int(value)
                    else:
                        opened_at = written = int(value)
                    seen += 1
            await asyncio.sleep(rng.uniform(0, 0.01))
        finally:
            proc.send_signal(signal.SIGKILL)
            assert await proc.wait() == -signal.SIGKILL
        # What it confirmed up to its death (the pipe lags behind it); a torn last line is not.
        for line in (await proc.stdout.read()).decode().splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            word, value, _ = line.split()
            if word == "w":
                written = int(value)
            elif word == "d":
                deleted = int(value)
        max_wal = max(max_wal, size(f"{path}-wal"))
        rows = file_rows(path)
        seqs = [seq for seq, _, _ in rows]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gapless
        if deleted:  # deleted no further than confirmed, but for the one delete in progress
            assert seqs[0] <= deleted + 9
        assert seqs[-1] >= written  # nothing confirmed was lost...
        for seq, op_id, op in rows:  # ...nor torn
            assert op_id == f"op{seq:010d}"
            assert json.loads(op)["op_id"] == op_id
        total_written += seqs[-1] - opened_at
    # Enough pages went through the WAL for many checkpoints, and they did reset it.
    assert total_written * 1000 > 20 * AUTOCHECKPOINT_PAGES * PAGE
    assert max_wal < (AUTOCHECKPOINT_PAGES + 100) * PAGE

    survivors = [op_id for _, op_id, _ in file_rows(path)]
    server = await start_server(tmp_path)
    try:
        url = url_of(server)
        await insert_counter_node(url)
        async with WorkspaceClient(
            url, token=token_for(WS), outbox=path, config=fast_config()
        ) as client:
            assert client.pending_count() == len(survivors)
            await client.wait_synced(timeout=TIMEOUT)
        logged = [entry["op_id"] for entry in (await server_log(url, "tree"))[1:]]
    finally:
        await server.close()
    assert logged == survivors  # each once, in seq order
    assert file_rows(path) == []


# -- an offline app's 100,000 ops ------------------------------------------------------------------


async def test_100k_ops_left_offline_start_fast_replay_in_full_batches_in_order(
    tmp_path: Path,
) -> None:
    """Measured: start 0.5 s and +62 MiB RSS before paged loading (every pending row held in
    memory: about 0.6 KiB per op; now a page per sub-doc), 100 requests of 1,000 ops, replay
    2.8 s. The file stops growing: everything answered leaves it the same size (free pages,
    reused) but for the backlog index the paged open makes once, and the WAL is checkpointed
    away."""
    count = 100_000
    path = tmp_path / "app.outbox"
    offline = await SQLiteOutbox.open(path)
    for first in range(1, count + 1, 100):  # one write per tick, as an offline app's client does
        offline.write(OutboxWrite(inserts=[increment(s) for s in range(first, first + 100)]))
    await offline.close()
    file_before = size(path)

    requests: list[int] = []
    server = await start_server(tmp_path, requests)
    try:
        url = url_of(server)
        await insert_counter_node(url)
        requests.clear()
        client = WorkspaceClient(
            url, token=token_for(WS), outbox=path, config=fast_config(ops_over_websocket=False)
        )
        await client.start()
        # Started fast: the backlog stays on disk but for the one page the start read.
        held = client._machine.lane_pending(WS, "tree")
        page = client._machine.restore_page
        try:
            assert client.pending_count() == count
            await client.wait_synced(timeout=TIMEOUT)
            assert await client._outbox.pending() == []  # type: ignore[union-attr]
        finally:
            await client.close()
        logged = [entry["op_id"] for entry in (await server_log(url, "tree"))[1:]]
    finally:
        await server.close()
    assert 0 < len(held.rows) <= page < count
    assert held.on_disk is not None
    assert requests == [1000] * 100
    assert logged == [f"op{seq:010d}" for seq in range(1, count + 1)]
    # The backlog index (about 20 bytes per op of these small ops) is made once, at the paged
    # open; its pages are freed with the rows and reused like theirs.
    assert size(path) <= file_before * 1.25
    assert size(f"{path}-wal") == 0


async def test_an_outbox_emptied_after_a_burst_reuses_its_pages_for_the_next_one(
    tmp_path: Path,
) -> None:
    """The file never shrinks (no VACUUM, no auto_vacuum), but it stops growing: a second
    offline burst of the same size fits in the pages the first one freed."""
    path = tmp_path / "app.outbox"
    sizes: list[int] = []
    seq = 0
    for _ in range(3):
        outbox = await SQLiteOutbox.open(path)
        burst = list(range(seq + 1, seq + 20_001))
        seq = burst[-1]
        for first in range(0, len(burst), 200):
            chunk = burst[first : first + 200]
            outbox.write(OutboxWrite(inserts=[increment(s) for s in chunk]))
        for first in range(0, len(burst), 1000):
            outbox.write(OutboxWrite(deletes=burst[first : first + 1000]))
        await outbox.close()
        sizes.append(size(path))
    assert file_rows(path) == []
    assert sizes[2] <= sizes[0] * 1.05


# -- a long online run -----------------------------------------------------------------------------


async def test_50k_ops_answered_one_by_one_keep_the_file_and_wal_bounded(tmp_path: Path) -> None:
    """An online app's outbox traffic (insert with its lane's seq, then delete once answered),
    50,000 times: the WAL is checkpointed and reused (it stays under the autocheckpoint size),
    the file stays page 1, the outbox table and its two small lane tables, a page each. The
    lane row rewritten by every insert adds a frame per commit, not WAL growth: measured 4.1 MB
    WAL at most (1,001 frames), a 16 KiB file."""
    path = tmp_path / "app.outbox"
    outbox = await SQLiteOutbox.open(path)
    biggest_wal = biggest_file = 0
    try:
        for seq in range(1, 50_001):
            outbox.write(OutboxWrite(inserts=[stamped(seq)]))
            outbox.write(OutboxWrite(deletes=[seq]))
            if seq % 500 == 0:
                await outbox.sync()  # the syncer keeps up, as during round trips
                biggest_wal = max(biggest_wal, size(f"{path}-wal"))
                biggest_file = max(biggest_file, size(path))
        assert outbox.writes_committed == 100_000
    finally:
        await outbox.close()
    assert biggest_wal < (AUTOCHECKPOINT_PAGES + 10) * PAGE
    assert biggest_file <= 4 * PAGE
    assert size(path) <= 4 * PAGE
    assert size(f"{path}-wal") == 0


# -- a second process on the same file -------------------------------------------------------------

SECOND_CLIENT = """
import asyncio, sys, time
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.errors import OutboxError

async def main():
    started = time.perf_counter()
    try:
        async with WorkspaceClient(sys.argv[1], outbox=sys.argv[2]):
            print("opened", flush=True)
    except OutboxError as exc:
        print(exc.code, round(time.perf_counter() - started, 2), flush=True)

asyncio.run(main())
"""


async def test_a_second_process_gets_outbox_locked_while_the_first_keeps_committing(
    tmp_path: Path,
) -> None:
    """The second process waits out its busy timeout (5 s) and fails with `outbox_locked`; the
    first commits ops all along, none delayed by the other's polling, and its file is intact."""
    path = tmp_path / "app.outbox"
    server = await start_server(tmp_path)
    try:
        url = url_of(server)
        await insert_counter_node(url)
        async with WorkspaceClient(
            url, token=token_for(WS), outbox=path, config=fast_config()
        ) as first:
            await first.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                SECOND_CLIENT,
                url,
                str(path),
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
            )
            slowest = 0.0
            committed = 0
            while proc.returncode is None:
                began = time.perf_counter()
                await first.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                slowest = max(slowest, time.perf_counter() - began)
                committed += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.01)
            out, _ = await proc.communicate()
            assert first.pending_count() == 0
            assert await first._outbox.pending() == []  # type: ignore[union-attr]
        logged = await server_log(url, "tree")
    finally:
        await server.close()
    code, waited = out.decode().split()
    assert code == "outbox_locked"
    assert 4 < float(waited) < 15
    assert committed > 20
    # Had the second process's polling blocked the first's writes, one would have waited out
    # the second's busy timeout (5 s); the file lock it polls is not the database's.
    assert slowest < 2.5
    assert len(logged) == committed + 2


# -- the directory removed under an open client ----------------------------------------------------


async def test_ops_whose_outbox_directory_vanished_are_not_reported_as_waiting_in_it(
    tmp_path: Path,
) -> None:
    """The outbox's directory is removed while a client is offline: the syncer's fsync fails, new
    ops fail with a typed `OutboxError`, and an op in flight at close is told its fsync failed,
    not `StillPendingError` ("it stays in the outbox and will be replayed": nothing will) — nor is
    the op fsynced before the directory went: the file that held it is gone."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    directory = tmp_path / "outboxes"
    client = WorkspaceClient(
        f"http://127.0.0.1:{port}",
        token=token_for(WS),
        outbox=directory / "app.outbox",
        config=fast_config(ops_over_websocket=False),
    )
    await client.start()
    try:
        before = asyncio.create_task(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        )
        outbox = client._outbox
        assert isinstance(outbox, SQLiteOutbox)
        async with asyncio.timeout(TIMEOUT):
            while not outbox.synced(1):  # written on the next tick, then fsynced
                await asyncio.sleep(0.001)
                await outbox.sync()
        shutil.rmtree(directory)
        after = asyncio.create_task(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        )
        async with asyncio.timeout(TIMEOUT):
            # Its insert is committed on a later tick (a state: wait for it, not for 10 ms).
            while outbox._written_seq < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        with pytest.raises(OutboxError) as failed_sync:
            await asyncio.wait_for(outbox.sync(), TIMEOUT)
        assert failed_sync.value.code == "outbox_sync_failed"
        with pytest.raises(OutboxError) as refused:
            await asyncio.wait_for(
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")), TIMEOUT
            )
        assert refused.value.code == "outbox_write_failed"
    finally:
        await asyncio.wait_for(client.close(), TIMEOUT)
        silent.close()
        for writer in held:
            writer.close()
    # Fsynced before the directory went, but gone with it: nothing will replay it either.
    with pytest.raises(OutboxError) as gone:
        await before
    assert gone.value.code == "outbox_sync_failed"
    with pytest.raises(OutboxError) as lost:
        await after
    assert lost.value.code == "outbox_sync_failed"
