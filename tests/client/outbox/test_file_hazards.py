"""The outbox file against what a user's machine does to it: the app started twice on one file,
a holder SIGKILLed or frozen, a file that is not an outbox (the app's own database, a damaged or
truncated outbox, one from a newer SDK), the file removed under an open client, a full disk, and
ops at the server's size limits replayed byte for byte after a restart."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import JsonValue

from cv_mutations import NodeIncrement, NodeInsert, NodeUpdate
from cv_server import ServerConfig, create_app
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client._core.machine import OutboxRow
from cv_workspace_client._outbox.base import OutboxWrite
from cv_workspace_client._outbox.file import APPLICATION_ID
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError

from ..helpers import SECRET, WS, fast_config, server_log, server_state, token_for

TIMEOUT = 30
REPO = Path(__file__).resolve().parents[3]

#: The outbox DDL of the SDK releases that did not stamp `application_id` yet.
LEGACY_SCHEMA = """
CREATE TABLE outbox (
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


def increment(seq: int, pad: int = 0) -> OutboxRow:
    op_id = f"op{seq:010d}"
    op: dict[str, object] = {"type": "node.increment", "node_id": "n", "field": "c"}
    if pad:
        op["meta"] = {"pad": "x" * pad}
    op["op_id"] = op_id
    return OutboxRow(seq, WS, "tree", op_id, json.dumps(op, separators=(",", ":")), 1.0)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def siblings(path: Path) -> list[str]:
    """The files SQLite keeps beside `path` (-wal, -shm, -journal)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + "-"))


async def written_outbox(path: Path, count: int, pad: int = 500) -> None:
    outbox = await SQLiteOutbox.open(path)
    outbox.write(OutboxWrite(inserts=[increment(seq, pad) for seq in range(1, count + 1)]))
    await outbox.close()


async def open_error(path: Path, busy_timeout_ms: int = 200) -> OutboxError:
    with pytest.raises(OutboxError) as caught:
        await SQLiteOutbox.open(path, busy_timeout_ms=busy_timeout_ms)
    return caught.value


async def silent_server() -> tuple[str, Callable[[], Awaitable[None]]]:
    """A TCP server that accepts and never answers: ops stay pending."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def stop() -> None:
        server.close()
        for writer in held:
            writer.close()

    return f"http://127.0.0.1:{port}", stop


# -- files that are not (this SDK's) outbox --------------------------------------------------------


def app_database(path: Path, kind: str) -> None:
    conn = sqlite3.connect(path)
    if kind == "app_tables":  # the app's own database passed as `outbox=` by mistake
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO users VALUES (1, 'ada')")
    elif kind == "other_outbox_table":  # another library's table of the same name
        conn.execute("CREATE TABLE outbox (id INTEGER PRIMARY KEY, payload BLOB)")
        conn.execute("INSERT INTO outbox VALUES (1, x'00')")
        conn.execute("PRAGMA user_version = 1")
    elif kind == "other_application_id":
        conn.execute("PRAGMA application_id = 1234")
        conn.execute(LEGACY_SCHEMA)
    elif kind == "versioned_app":
        conn.execute("CREATE TABLE t (x)")
        conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    "kind", ["app_tables", "other_outbox_table", "other_application_id", "versioned_app"]
)
async def test_another_applications_database_is_refused_and_left_exactly_as_it_was(
    tmp_path: Path, kind: str
) -> None:
    """Before: the app's database was taken over (an `outbox` table created in it, its
    user_version overwritten, switched to WAL, then locked for the client's lifetime)."""
    path = tmp_path / "app.db"
    app_database(path, kind)
    before = digest(path)
    error = await open_error(path)
    assert error.code == "outbox_foreign"
    assert digest(path) == before
    assert siblings(path) == []
    assert f"{path.name}.lock" not in os.listdir(tmp_path)  # nor a lock file of ours beside it
    conn = sqlite3.connect(path, timeout=0)  # not left locked either
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_a_new_or_empty_file_becomes_an_outbox_stamped_with_its_application_id(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty.outbox"
    empty.write_bytes(b"")
    for path in (tmp_path / "new" / "app.outbox", empty):
        outbox = await SQLiteOutbox.open(path)
        outbox.write(OutboxWrite(inserts=[increment(1)]))
        await outbox.close()
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
            assert conn.execute("SELECT seq FROM outbox").fetchall() == [(1,)]
        finally:
            conn.close()


async def test_an_outbox_written_before_the_application_id_still_replays_in_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.outbox"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(LEGACY_SCHEMA)
    conn.execute("PRAGMA user_version = 1")
    rows = [increment(seq) for seq in (3, 1, 2)]
    conn.executemany(
        "INSERT INTO outbox VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (r.seq, r.workspace_id, r.sub_doc, r.op_id, r.op_json, r.created_at, 0, None)
            for r in rows
        ],
    )
    conn.close()
    outbox = await SQLiteOutbox.open(path)
    try:
        assert outbox.rows == [increment(1), increment(2), increment(3)]
    finally:
        await outbox.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    finally:
        conn.close()


async def test_an_outbox_from_a_newer_sdk_is_refused_and_left_exactly_as_it_was(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.outbox"
    await written_outbox(path, 10)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    before = digest(path)
    error = await open_error(path)
    assert error.code == "outbox_version"
    assert digest(path) == before


@pytest.mark.parametrize(
    "damage", ["header_only", "first_page", "half", "last_page_missing", "garbled_page"]
)
async def test_a_damaged_outbox_is_refused_with_a_typed_error_and_never_emptied(
    tmp_path: Path, damage: str
) -> None:
    """A truncated or garbled outbox still holds ops nobody else has: refused with
    `outbox_open_failed`, its bytes untouched (the app or an operator can salvage them), never
    read as an empty outbox and never rewritten."""
    path = tmp_path / "app.outbox"
    await written_outbox(path, 2000)
    assert path.stat().st_size > 100 * 4096
    damage_file(path, damage)
    before = digest(path)
    error = await open_error(path)
    assert error.code == "outbox_open_failed"
    assert digest(path) == before
    assert siblings(path) == []


def damage_file(path: Path, damage: str) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as file:
        if damage == "header_only":
            file.truncate(60)
        elif damage == "first_page":
            file.truncate(4096)
        elif damage == "half":
            file.truncate(size // 2 + 100)
        elif damage == "last_page_missing":
            file.truncate(size - 4096)
        else:
            file.seek(size // 2)
            file.write(bytes(range(256)) * 32)


# -- the app started twice, and holders that die or freeze -----------------------------------------

HOLDER = """
import asyncio, sys
from cv_workspace_client import WorkspaceClient
from cv_mutations import NodeIncrement

async def main():
    client = WorkspaceClient(sys.argv[1], token=sys.argv[2], outbox=sys.argv[3])
    await client.start()
    tasks = [asyncio.ensure_future(client.apply_op("ws1", "tree",
             NodeIncrement(node_id="n", field="c", op_id=f"held{i:04d}"))) for i in range(50)]
    while len(await client._outbox.pending()) < 50:
        await asyncio.sleep(0.01)
    await client._outbox.sync()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def spawn_holder(url: str, path: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDER,
        url,
        token_for(WS),
        str(path),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
    assert line == b"ready\n"
    return proc


async def test_a_frozen_holder_keeps_the_outbox_and_a_sigkilled_one_frees_it_at_once(
    tmp_path: Path,
) -> None:
    """The lock is a POSIX lock: it lasts exactly as long as the process holding it. A stopped
    (SIGSTOP) holder is alive: a second start fails with `outbox_locked`. SIGKILLed, it is gone:
    the next start opens at once, well inside its busy timeout, and finds every op, in order."""
    url, stop = await silent_server()
    path = tmp_path / "app.outbox"
    proc = await spawn_holder(url, path)
    try:
        proc.send_signal(signal.SIGSTOP)
        assert (await open_error(path)).code == "outbox_locked"
    finally:
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        await stop()
    loop = asyncio.get_running_loop()
    began = loop.time()
    outbox = await SQLiteOutbox.open(path, busy_timeout_ms=60_000)
    try:
        assert loop.time() - began < 30  # never waited out the busy timeout (a minute)
        assert [row.op_id for row in outbox.rows] == [f"held{i:04d}" for i in range(50)]
    finally:
        await outbox.close()


RACER = """
import asyncio, os, sys
from cv_workspace_client._outbox.base import OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError
from tests.client.outbox.test_file_hazards import increment

async def main():
    try:
        outbox = await SQLiteOutbox.open(sys.argv[1], busy_timeout_ms=300)
    except OutboxError as exc:
        print(exc.code, flush=True)
        return
    tag = int(sys.argv[2])
    outbox.write(OutboxWrite(inserts=[increment(tag * 1000 + i) for i in range(20)]))
    print("opened", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await outbox.close()

asyncio.run(main())
"""


async def test_two_processes_starting_at_once_on_one_outbox_one_wins_the_other_gets_locked(
    tmp_path: Path,
) -> None:
    """An app started twice by mistake, both on a new file and on one with pending ops: exactly
    one process owns the file; the other fails with `outbox_locked` and writes nothing, so no
    op is replayed twice side by side, reordered or deleted under its owner."""
    path = tmp_path / "app.outbox"
    for round_ in range(4):
        if round_ == 2:
            await written_outbox(path, 5, pad=0)
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                RACER,
                str(path),
                str(tag),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            for tag in (1, 2)
        ]
        said: dict[int, str] = {}
        for tag, proc in zip((1, 2), procs, strict=True):
            assert proc.stdout is not None
            said[tag] = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode().strip()
        for tag, proc in zip((1, 2), procs, strict=True):
            assert proc.stdin is not None
            if said[tag] == "opened":
                proc.stdin.write(b"close\n")
                await proc.stdin.drain()
            assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 0
        errors = [(await proc.stderr.read()).decode() for proc in procs if proc.stderr]
        assert sorted(said.values()) == ["opened", "outbox_locked"], (said, errors)
        winner = next(tag for tag, word in said.items() if word == "opened")
        outbox = await SQLiteOutbox.open(path)
        try:
            seqs = [row.seq for row in outbox.rows]
        finally:
            await outbox.close()
        kept = list(range(1, 6)) if round_ == 2 else []
        assert seqs == kept + [winner * 1000 + i for i in range(20)], (round_, seqs)
        # Empty the file for the next round (as answered ops would be).
        cleaner = await SQLiteOutbox.open(path)
        cleaner.write(OutboxWrite(deletes=[row.seq for row in cleaner.rows]))
        await cleaner.close()


# -- the file removed or replaced under an open client ---------------------------------------------


@pytest.mark.parametrize("how", ["unlinked", "renamed", "replaced", "unlinked_after_last_fsync"])
async def test_ops_of_an_outbox_file_removed_while_open_are_never_reported_as_waiting_in_it(
    tmp_path: Path, how: str
) -> None:
    """Before: with the file unlinked (its -wal left) or renamed, the connection went on writing
    to the old inode, the syncer's fsync of `<path>-wal` succeeded, and at close every pending op
    was reported as `StillPendingError` ("it waits in the outbox") — while the next start on the
    path found an empty outbox. Now the syncer and the close check that the path is still the
    file they opened: every such op fails with `outbox_sync_failed`, and new ops are refused."""
    url, stop = await silent_server()
    path = tmp_path / "app.outbox"
    client = WorkspaceClient(
        url,
        token=token_for(WS),
        outbox=path,
        config=fast_config(ops_over_websocket=False),
    )
    await client.start()
    try:
        before = asyncio.ensure_future(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        )
        outbox = client._outbox
        assert isinstance(outbox, SQLiteOutbox)
        async with asyncio.timeout(TIMEOUT):
            while not outbox.synced(1):
                await asyncio.sleep(0.001)
                await outbox.sync()
        if how in ("unlinked", "unlinked_after_last_fsync"):
            path.unlink()
        elif how == "renamed":
            path.rename(tmp_path / "moved.outbox")
        else:
            path.rename(tmp_path / "old.outbox")
            shutil.copy(tmp_path / "old.outbox", path)
        tasks = [before]
        if how != "unlinked_after_last_fsync":
            committed = outbox.writes_committed
            tasks.append(
                asyncio.ensure_future(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                )
            )
            async with asyncio.timeout(TIMEOUT):  # its insert is committed on the next tick
                while True:
                    if outbox.writes_committed > committed:
                        break
                    await asyncio.sleep(0.001)
            with pytest.raises(OutboxError) as failed:
                await asyncio.wait_for(outbox.sync(), TIMEOUT)
            assert failed.value.code == "outbox_sync_failed"
            with pytest.raises(OutboxError):
                await asyncio.wait_for(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")), TIMEOUT
                )
    finally:
        await asyncio.wait_for(client.close(), TIMEOUT)
        await stop()
    for outcome in [await_exception(task) for task in tasks]:
        assert isinstance(outcome, OutboxError), outcome
        assert outcome.code == "outbox_sync_failed"


def await_exception(task: asyncio.Future[Any]) -> BaseException | None:
    assert task.done()
    return task.exception()


# -- a full disk -----------------------------------------------------------------------------------

#: Runs in its own mount namespace on a 512 KiB tmpfs: submits 4 KB ops to a server that never
#: answers until the outbox's disk is full, frees the space, submits one more, closes, and prints
#: what each op was told and what the file holds.
DISK_FULL = """
import asyncio, json, os, sys
from cv_mutations import NodeUpdate
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError
from tests.client.helpers import WS, fast_config, token_for
from tests.client.outbox.test_file_hazards import silent_server

async def main(directory):
    url, stop = await silent_server()
    filler = os.path.join(directory, "filler")
    with open(filler, "wb") as file:
        file.write(b"x" * 128 * 1024)
    path = os.path.join(directory, "app.outbox")
    client = WorkspaceClient(url, token=token_for(WS), outbox=path,
                             config=fast_config(ops_over_websocket=False))
    await client.start()
    outbox = client._outbox

    async def submit(i):
        task = asyncio.ensure_future(client.apply_op(WS, "tree", NodeUpdate(
            node_id="n", set={"blob": f"{i:04d}" + "x" * 4000}, op_id=f"diskfull{i:04d}")))
        committed = outbox.writes_committed
        for _ in range(10_000):  # until its write committed or failed
            if task.done() or outbox.writes_committed > committed:
                return task
            await asyncio.sleep(0.001)
        raise AssertionError("the write neither committed nor failed")

    tasks = {}
    for i in range(400):
        tasks[f"diskfull{i:04d}"] = task = await submit(i)
        if task.done():
            break
    os.remove(filler)
    tasks["diskfull9999"] = await submit(9999)
    await client.close()
    await stop()
    told, said = {}, {}
    for op_id, task in tasks.items():
        try:
            await task
            told[op_id] = "committed"
        except (OutboxError, StillPendingError) as exc:
            told[op_id], said[op_id] = exc.code, str(exc)
    outbox = await SQLiteOutbox.open(path)
    stored = [row.op_id for row in outbox.rows]
    await outbox.close()
    print(json.dumps({"told": told, "said": said, "stored": stored}))

asyncio.run(main(sys.argv[1]))
"""


async def test_a_full_disk_fails_the_op_that_did_not_fit_and_keeps_every_op_said_to_be_waiting(
    tmp_path: Path,
) -> None:
    """A real full disk (a tiny tmpfs): the op whose insert did not fit fails with
    `outbox_write_failed` and is not in the file (nothing half-written: the file opens and holds
    exactly the ops told `StillPendingError`, in order); once space is freed, the next op is
    accepted again."""
    if shutil.which("unshare") is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    directory = tmp_path / "small_disk"
    directory.mkdir()
    shell = 'mount -t tmpfs -o size=512k tmpfs "$1" || exit 77; exec "$2" -c "$3" "$1"'
    proc = await asyncio.create_subprocess_exec(
        "unshare",
        "-m",
        "sh",
        "-c",
        shell,
        "sh",
        str(directory),
        sys.executable,
        DISK_FULL,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    if proc.returncode == 77 or b"unshare failed" in err:
        pytest.skip(f"cannot mount a private tmpfs: {err.decode()[-200:]}")
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out)
    told: dict[str, str] = result["told"]
    waiting = [op_id for op_id, word in told.items() if word == "still_pending"]
    refused = [op_id for op_id, word in told.items() if word != "still_pending"]
    assert len(waiting) > 10
    assert refused == [max(op_id for op_id in told if op_id != "diskfull9999")]
    assert told[refused[0]] == "outbox_write_failed"
    assert result["said"][refused[0]].count("outbox_write_failed") == 1  # the code said once
    assert told["diskfull9999"] == "still_pending"
    assert result["stored"] == waiting


# -- ops at the limits, replayed byte for byte after a restart -------------------------------------

#: The server's request body limit (ServerConfig.max_body_bytes), and the bytes `Send.body()`
#: wraps around a lone op: `{"ops":[` ... `],"atomic":false}`.
MAX_BODY = ServerConfig().max_body_bytes
WRAPPER = len('{"ops":[],"atomic":false}')
#: The stamp the SDK appends to each op it mints (docs/limits.md#ops-through-the-sdk): its client
#: id (21 characters), the lane seq (the big op is the lane's 4th) and `minted_at` (13 digits).
STAMP = len(',"client_id":"' + "c" * 21 + '","seq":4,"minted_at":' + "1" * 13)


TEXT = 'ñ 日本語 🎉 👩\u200d👩\u200d👧 \u2028\u2029 \u0000 "quoted" \\ \ufeff \U0010fffd'
#: The smallest subnormal and normal doubles, the largest, a negative zero, two inexact ones.
FLOAT_VALUES = [
    5e-324,
    2.2250738585072014e-308,
    1.7976931348623157e308,
    -0.0,
    0.1,
    1 / 3,
]
FLOATS: list[JsonValue] = [*FLOAT_VALUES]


def op_text(op: NodeUpdate | NodeIncrement) -> str:
    from cv_workspace_client._core.wire import dumps_body

    return dumps_body(op.model_dump(mode="json", exclude_none=True))


def limit_ops() -> list[NodeUpdate | NodeIncrement]:
    """Unicode the JSON encoder must not touch (astral planes, joiners, line separators, NUL,
    quotes, a BOM), floats at the edges of the double range, and one op whose request, once the
    SDK stamped it, is exactly the server's body limit."""
    text = TEXT
    floats = FLOATS
    ops: list[NodeUpdate | NodeIncrement] = [
        NodeUpdate(
            node_id="n",
            set={"text": text, "floats": floats, "int": 2**63 - 1, "neg": -(2**63)},
            op_id="limits-unicode-0001",
        ),
        NodeIncrement(node_id="n", field="c", by=0.1, op_id="limits-float-00001"),
        NodeIncrement(node_id="n", field="c", by=1e-300, op_id="limits-float-00002"),
    ]
    # The biggest op one request can carry: pad with 2- and 3-byte characters up to exactly
    # the limit, in bytes (what the server counts).
    base = NodeUpdate(node_id="n", set={"big": ""}, op_id="limits-big-000001")
    room = MAX_BODY - WRAPPER - STAMP - len(op_text(base).encode())
    pad = "日" * (room // 3) + "é" * ((room % 3) // 2) + "x" * ((room % 3) % 2)
    ops.append(NodeUpdate(node_id="n", set={"big": pad}, op_id="limits-big-000001"))
    assert len(op_text(ops[-1]).encode()) + STAMP + WRAPPER == MAX_BODY
    return ops


async def recording_server(
    tmp_path: Path, bodies: list[bytes], drop_answers: list[bool]
) -> AsyncGenerator[str, None]:
    """A real server that records every POST .../ops body as received and, while
    `drop_answers` holds True, commits each request and then drops the connection unanswered."""
    app = create_app(ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET))

    @web.middleware
    async def record(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("/ops"):
            bodies.append(await request.read())
            response = await handler(request)
            if drop_answers and drop_answers[0]:
                assert request.transport is not None
                request.transport.close()
            return response
        return await handler(request)

    app.middlewares.append(record)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.parametrize(
    "replay_over",
    [
        "http",
        "websocket",
    ],
)
async def test_ops_at_the_limits_are_resent_after_a_restart_byte_for_byte_and_apply_once(
    tmp_path: Path, replay_over: str
) -> None:
    """The first client's request is committed by the server but its answer lost, so the client
    gives up (one attempt) and closes with every op waiting in the outbox. The next client on the
    file resends each op's stored text unchanged (found verbatim, in order, in the request bodies),
    under the same op_id: the server recognises every one as the same op (`duplicate`, same
    clock — a changed byte would be `op_id_reuse`), and the state holds the values bit for bit."""
    ops = limit_ops()
    texts = [op_text(op) for op in ops]
    bodies: list[bytes] = []
    drop_answers = [False]
    path = tmp_path / "app.outbox"
    servers = recording_server(tmp_path, bodies, drop_answers)
    url = await anext(servers)
    try:
        async with WorkspaceClient(url, token=token_for(WS), config=fast_config()) as setup:
            await setup.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        bodies.clear()
        drop_answers[0] = True
        config = fast_config(ops_over_websocket=False, retry_attempts=1)
        first = WorkspaceClient(url, token=token_for(WS), outbox=path, config=config)
        await first.start()
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(first.apply_op(WS, "tree", op) for op in ops), return_exceptions=True
                ),
                TIMEOUT,
            )
        finally:
            await first.close()
        assert all(isinstance(outcome, StillPendingError) for outcome in outcomes), outcomes
        # One request, committed, its answer lost; the big op (over the batch byte cap) was
        # to follow it alone: the lane gave up first.
        assert len(bodies) == 1
        assert len(await server_log(url, "tree")) == len(ops)
        conn = sqlite3.connect(path)
        try:
            stored = conn.execute("SELECT op_id, op FROM outbox ORDER BY seq").fetchall()
        finally:
            conn.close()
        # Stored as the app wrote it, then the lane stamp (client_id, seq, minted_at): the
        # stamped text is what goes on the wire, and the big op's request is the limit exactly.
        assert [op_id for op_id, _ in stored] == [op.op_id for op in ops]
        for (_, stored_text), text in zip(stored, texts, strict=True):
            assert stored_text.startswith(text[:-1] + ',"client_id":')
        assert len(stored[-1][1].encode()) + WRAPPER == MAX_BODY

        bodies.clear()
        drop_answers[0] = False
        config = fast_config(ops_over_websocket=replay_over == "websocket", retry_attempts=1)
        second = WorkspaceClient(url, token=token_for(WS), outbox=path, config=config)
        await second.start()
        try:
            assert second.pending_count() == len(ops)
            await second.wait_synced(timeout=TIMEOUT)
            commit = await second.apply_op(WS, "tree", ops[0])  # once more, from the app
        finally:
            await second.close()
        log = await server_log(url, "tree")
        state = await server_state(url, "tree")
    finally:
        await servers.aclose()
    if replay_over == "http":
        replayed = b"".join(bodies)
        position = 0
        for _, text in stored:
            # The stamped text the first client stored, byte for byte.
            found = replayed.find(text.encode(), position)
            assert found >= 0, text[:80]
            position = found + len(text.encode())
    assert commit.duplicate
    assert [entry["op_id"] for entry in log[1:]] == [op.op_id for op in ops]  # each once
    fields = state["state"]["nodes"]["n"]["fields"]
    assert fields["text"] == TEXT
    assert [float(x).hex() for x in fields["floats"]] == [x.hex() for x in FLOAT_VALUES]
    assert (fields["int"], fields["neg"]) == (2**63 - 1, -(2**63))
    assert fields["c"] == 0.1 + 1e-300
    assert fields["big"] == ops[-1].set["big"]  # type: ignore[union-attr]
