"""A real `cv-server` on a file system that fills up, or on a file it may not write: writes answer
503 `storage_unavailable` with `Retry-After`, reads keep answering, `/readyz` says so, and once
the storage takes writes again they resume without a restart, with every acknowledged op in the
log and no refused batch half in it (docs/operating.md, "Storage faults").

The file system is a small tmpfs mounted here (`tests/tmpfs.py`: root, else skipped unless
`CV_REQUIRE_ROOT_MOUNTS=1`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from cv_mutations import new_op_id
from tests.acceptance.procs import ServerProcess, create_sqlite_database, free_port, mint_cli_token
from tests.tmpfs import mounted_tmpfs, run, unavailable

pytestmark = pytest.mark.acceptance

WS: Final = "w1"
DOC: Final = "a"
#: The tmpfs holding the database, and the filler file created on it before the server starts:
#: deleting the filler is how space comes back.
TMPFS_BYTES: Final = 8 * 1024 * 1024
FILLER_BYTES: Final = 2 * 1024 * 1024
#: Each batch carries about 4 x 8 KB: the disk fills within a few hundred requests.
PAD: Final = "x" * 8000
OPS_PER_BATCH: Final = 4
#: Bounds: requests sent before the disk must have filled, and seconds for the whole test.
MAX_BATCHES: Final = 2000
DEADLINE_S: Final = 120.0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", TMPFS_BYTES) as where:
        yield where


def _batch() -> list[dict[str, Any]]:
    return [
        {
            "op_id": new_op_id(),
            "type": "node.insert",
            "node_id": f"n{new_op_id()}",
            "parent_id": "root",
            "fields": {"pad": PAD},
        }
        for _ in range(OPS_PER_BATCH)
    ]


class Writer:
    """Posts batches and keeps what the server acknowledged."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops"
        #: op_id -> clock of every op answered as committed.
        self.acked: dict[str, int] = {}

    async def post(self, ops: list[dict[str, Any]]) -> tuple[int, dict[str, Any], str | None]:
        async with self.session.post(self.url, json={"ops": ops}) as resp:
            body = await resp.json(content_type=None)
            if resp.status == 200:
                for result in body["results"]:
                    assert "clock" in result, result
                    self.acked[result["op_id"]] = result["clock"]
            return resp.status, body, resp.headers.get("Retry-After")


async def _log(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    while True:
        async with session.get(
            f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops", params={"since": len(entries)}
        ) as resp:
            assert resp.status == 200, await resp.text()
            page = await resp.json()
        entries += page["ops"]
        if not page["ops"] or len(entries) >= page["clock"]:
            return entries


async def _readyz(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(f"{url}/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


def _assert_log_is_what_was_acknowledged(entries: list[dict[str, Any]], writer: Writer) -> None:
    assert [e["clock"] for e in entries] == list(range(1, len(entries) + 1))  # gap-free
    in_log = {e["op_id"]: e["clock"] for e in entries}
    assert len(in_log) == len(entries)
    assert in_log == writer.acked  # every acknowledged op, and nothing else


async def test_a_full_disk_answers_503_serves_reads_and_recovers_when_space_returns(
    tmpfs: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    db = tmpfs / "cv.db"
    create_sqlite_database(db)
    token = mint_cli_token(db, WS)
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * FILLER_BYTES)
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            writer = Writer(session, server.url)
            refused: tuple[dict[str, Any], str | None, list[dict[str, Any]]] | None = None
            for _ in range(MAX_BATCHES):
                ops = _batch()
                status, body, retry_after = await writer.post(ops)
                if status != 200:
                    assert status == 503, body
                    refused = (body, retry_after, ops)
                    break
            assert refused is not None, "the disk never filled"
            body, retry_after, refused_ops = refused
            assert body["code"] == "storage_unavailable"
            assert retry_after == "5"  # sweep_seconds (cv_server/config.py)
            assert len(writer.acked) > 0

            # Reads keep answering; the refused batch is nowhere, not even in part.
            async with session.get(f"{server.url}/v1/workspaces/{WS}/docs/{DOC}") as resp:
                assert resp.status == 200
                state = await resp.json()
            entries = await _log(session, server.url)
            assert state["clock"] == len(entries)
            _assert_log_is_what_was_acknowledged(entries, writer)
            assert not {op["op_id"] for op in refused_ops} & {e["op_id"] for e in entries}

            # /readyz says so while the disk is full.
            status, ready = await _readyz(session, server.url)
            assert (status, ready["code"]) == (503, "storage_unavailable"), ready
            async with session.get(f"{server.url}/metrics") as resp:
                metrics = await resp.text()
            refusals = [
                line
                for line in metrics.splitlines()
                if line.startswith("cv_storage_writes_refused_total ")
            ]
            assert refusals, metrics
            assert float(refusals[0].split()[1]) >= 1, refusals

            # Space comes back: ready again and writes resume, in the same process.
            filler.unlink()
            status, ready = await _readyz(session, server.url)
            assert status == 200, ready
            status, body, _ = await writer.post(refused_ops)  # the outbox resends as it was
            assert status == 200, body
            for _ in range(5):
                status, body, _ = await writer.post(_batch()[:1])
                assert status == 200, body
            entries = await _log(session, server.url)
            _assert_log_is_what_was_acknowledged(entries, writer)
            assert {op["op_id"] for op in refused_ops} <= {e["op_id"] for e in entries}
        assert server.proc is not None
        assert server.proc.poll() is None  # never restarted
    finally:
        server.stop()
    assert time.monotonic() - started < DEADLINE_S


async def test_a_read_only_database_file_serves_reads_and_refuses_writes_with_503(
    tmpfs: Path, tmp_path: Path
) -> None:
    db = tmpfs / "cv.db"
    create_sqlite_database(db)
    token = mint_cli_token(db, WS)
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=30)
    server.start()
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            writer = Writer(session, server.url)
            assert (await writer.post(_batch()))[0] == 200
        assert server.terminate() == 0
        # Immutable even for root: SQLite can only open the file read-only.
        made_read_only = run("chattr", "+i", str(db))
        if made_read_only.returncode != 0:
            unavailable(f"chattr +i is not supported here: {made_read_only.stderr.strip()}")
        server.start()
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            writer.session = session
            status, body, retry_after = await writer.post(_batch())
            assert (status, body["code"], retry_after) == (503, "storage_unavailable", "5"), body
            entries = await _log(session, server.url)
            _assert_log_is_what_was_acknowledged(entries, writer)
            async with session.get(f"{server.url}/v1/workspaces/{WS}/docs/{DOC}") as resp:
                assert resp.status == 200
                assert (await resp.json())["clock"] == len(entries)
            status, ready = await _readyz(session, server.url)
            assert (status, ready["code"]) == (503, "storage_unavailable"), ready

            # Writable again: the writer opens the file anew, no restart.
            assert run("chattr", "-i", str(db)).returncode == 0
            status, ready = await _readyz(session, server.url)
            assert status == 200, ready
            assert (await writer.post(_batch()))[0] == 200
            _assert_log_is_what_was_acknowledged(await _log(session, server.url), writer)
    finally:
        server.stop()
