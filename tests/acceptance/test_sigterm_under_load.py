"""Acceptance: SIGTERM on the real `cv-server serve` under mixed load, on SQLite and PostgreSQL.

While websocket clients pipeline applies, HTTP clients post ops, a subscriber streams, a worker
holds a claim and long-polls, and an SSE request stream is open, the server is sent SIGTERM. What
a user must see: exit code 0 within the drain deadline, sockets closed with 1001, no 500 and no
traceback in the server's log; and after a restart on the same file or database: every
acknowledged op at the clock it was acknowledged with, a gap-free log, a retry of any op under its
op_id answered as a duplicate (or committed once if the server never got to it), and the next
commit at the next clock.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.cli import _with_schema
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.acceptance.test_lifecycle_edges import _Server

pytestmark = pytest.mark.acceptance

WS = "acc"
DOC = "tree"
#: the drain deadline; the process must be gone within it (plus start-up noise).
DRAIN_SECONDS = 25.0
#: Acknowledgements to collect before the signal, so the drain happens under load.
LOADED_AFTER = 150
#: Applies one websocket client keeps unanswered at once (the SDK pipelines the same way).
WINDOW = 16


@dataclass
class Sent:
    """Every op a client sent, by op_id, and the clock the server acknowledged it at."""

    ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    close_codes: list[int | None] = field(default_factory=list)
    seen: list[tuple[int, str]] = field(default_factory=list)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)

    def ack(self, op_id: str, result: dict[str, Any]) -> None:
        assert "error" not in result, result  # increments of an existing node: never rejected
        self.acked[op_id] = int(result["clock"])
        if len(self.acked) >= LOADED_AFTER:
            self.loaded.set()


def _increment(op_id: str) -> dict[str, Any]:
    # Not idempotent (docs/ops.md): a double apply shows in the counter.
    return {"type": "node.increment", "node_id": "c", "field": "n", "by": 1, "op_id": op_id}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, str]]:
    if request.param == "sqlite":
        db = tmp_path / "cv.db"
        srv = ServerProcess(db, free_port(), tmp_path / "server.log")
        token = mint_cli_token(db, WS)
        try:
            yield srv, token
        finally:
            srv.stop()
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    schema = f"cv_test_{secrets.token_hex(6)}"
    asyncio.run(_execute(postgres_url, f"CREATE SCHEMA {schema}"))
    try:
        url = _with_schema(postgres_url, schema)
        srv = ServerProcess(None, free_port(), tmp_path / "server.log", database_url=url)
        token = mint_cli_token(None, WS, database_url=url)
        try:
            yield srv, token
        finally:
            srv.stop()
    finally:
        asyncio.run(_execute(postgres_url, f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


async def _execute(dsn: str, statement: str) -> None:
    # Not `tests.pg.helpers.fresh_schema`: this test runs its scenarios with `asyncio.run`, whose
    # end closes a generator suspended in another loop's `async with` (dropping the schema).
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _ws_applier(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], sent: Sent, name: str
) -> None:
    """Pipelines applies (up to WINDOW unanswered) until the server closes the socket."""
    ws = await session.ws_connect(f"{url}/v1/workspaces/{WS}/socket", headers=headers)
    window = asyncio.Semaphore(WINDOW)
    by_req: dict[int, str] = {}

    async def read() -> None:
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            frame = msg.json()
            if frame.get("type") == "ack":
                sent.ack(by_req[frame["req"]], frame["results"][0])
                window.release()
            elif frame.get("type") == "error":
                raise AssertionError(f"the server answered an apply with {frame}")

    reader = asyncio.create_task(read())
    try:
        for i in itertools.count():
            room = asyncio.ensure_future(window.acquire())
            await asyncio.wait({room, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not room.done() or reader.done() or ws.closed:
                room.cancel()
                break
            op_id = f"{name}-{i:06d}"
            sent.ops[op_id] = _increment(op_id)
            by_req[i] = op_id
            try:
                await ws.send_json(
                    {"type": "apply", "sub_doc": DOC, "ops": [_increment(op_id)], "req": i}
                )
            except (ConnectionResetError, RuntimeError):
                break
        await asyncio.wait_for(reader, 30)
    finally:
        reader.cancel()
        sent.close_codes.append(ws.close_code)


async def _http_applier(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], sent: Sent, name: str
) -> None:
    for i in itertools.count():
        op_id = f"{name}-{i:06d}"
        sent.ops[op_id] = _increment(op_id)
        try:
            async with session.post(
                f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops",
                json={"ops": [_increment(op_id)]},
                headers=headers,
            ) as resp:
                sent.statuses.append(resp.status)
                if resp.status != 200:
                    return
                sent.ack(op_id, (await resp.json())["results"][0])
        except aiohttp.ClientError:
            return


async def _subscriber(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], sent: Sent
) -> None:
    async with session.ws_connect(f"{url}/v1/workspaces/{WS}/socket", headers=headers) as ws:
        await ws.send_json({"type": "subscribe", "sub_doc": DOC, "since": 0})
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            frame = msg.json()
            if frame.get("type") == "op":
                sent.seen.append((frame["clock"], frame["op_id"]))
        sent.close_codes.append(ws.close_code)


async def _sse_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> bytes:
    """A request nobody works on, its outcome stream open: ends with the wait, not cut."""
    async with session.post(
        f"{url}/v1/workspaces/{WS}/requests",
        json={"stage": "evaluate", "job_id": "J-idle", "worker_class": "idle", "input": {}},
        headers=headers,
    ) as resp:
        assert resp.status == 202, await resp.text()
        stream_url = (await resp.json())["stream_url"]
    async with session.get(f"{url}{stream_url}", headers=headers) as stream:
        return await stream.content.read()


async def _worker(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> list[int]:
    """Holds a claim (never completed) and long-polls for more work until the server goes."""
    async with session.post(
        f"{url}/v1/workspaces/{WS}/requests",
        json={"stage": "evaluate", "job_id": "J-held", "worker_class": "busy", "input": {}},
        headers=headers,
    ) as resp:
        assert resp.status == 202
    async with session.post(
        f"{url}/v1/queue/claim",
        json={"worker_classes": ["busy"], "worker_id": "w1"},
        headers=headers,
    ) as resp:
        assert resp.status == 200, await resp.text()
    statuses: list[int] = []
    while True:
        try:
            async with session.get(
                f"{url}/v1/queue/pending?worker_classes=busy&timeout=2", headers=headers
            ) as resp:
                statuses.append(resp.status)
                if resp.status not in (200, 204):
                    return statuses
        except aiohttp.ClientError:
            return statuses


@dataclass
class Drained:
    exit_code: int
    took: float
    sent: Sent
    sse: bytes
    poll_statuses: list[int]


async def _load_and_terminate(server: ServerProcess, token: str) -> Drained:
    headers = {"Authorization": f"Bearer {token}"}
    sent = Sent()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{server.url}/v1/workspaces/{WS}/docs/{DOC}/ops",
            json={
                "ops": [
                    {
                        "type": "node.insert",
                        "node_id": "c",
                        "parent_id": "root",
                        "fields": {"n": 0},
                        "op_id": "setup-counter",
                    }
                ]
            },
            headers=headers,
        ) as resp:
            assert resp.status == 200
        subscriber = asyncio.create_task(_subscriber(session, server.url, headers, sent))
        sse = asyncio.create_task(_sse_stream(session, server.url, headers))
        worker = asyncio.create_task(_worker(session, server.url, headers))
        clients = [
            *(
                asyncio.create_task(_ws_applier(session, server.url, headers, sent, f"ws{k}"))
                for k in range(3)
            ),
            *(
                asyncio.create_task(_http_applier(session, server.url, headers, sent, f"http{k}"))
                for k in range(4)
            ),
        ]
        await asyncio.wait_for(sent.loaded.wait(), 60)
        started = time.monotonic()
        exit_code = await asyncio.to_thread(server.terminate)
        took = time.monotonic() - started
        await asyncio.wait_for(asyncio.gather(*clients, subscriber), 30)
        return Drained(
            exit_code,
            took,
            sent,
            await asyncio.wait_for(sse, 30),
            await asyncio.wait_for(worker, 30),
        )


async def _read_log(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> list[tuple[int, str]]:
    entries: list[tuple[int, str]] = []
    while True:
        async with session.get(
            f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops?since={len(entries)}", headers=headers
        ) as resp:
            assert resp.status == 200
            page = (await resp.json())["ops"]
        if not page:
            return entries
        entries += [(op["clock"], op["op_id"]) for op in page]


async def _post(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], ops: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for start in range(0, len(ops), 500):  # within the per-request limit
        async with session.post(
            f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops",
            json={"ops": ops[start : start + 500]},
            headers=headers,
        ) as resp:
            assert resp.status == 200, await resp.text()
            results += (await resp.json())["results"]
    return results


def test_sigterm_under_mixed_load_drains_cleanly_and_a_restart_resumes_exactly(
    server: tuple[ServerProcess, str],
) -> None:
    srv, token = server
    srv.start()
    drained = asyncio.run(_load_and_terminate(srv, token))
    log_text = srv.log.read_text()

    assert drained.exit_code == 0
    assert drained.took < DRAIN_SECONDS, f"SIGTERM took {drained.took:.1f} s"
    assert "Traceback" not in log_text, log_text[-4000:]
    assert "ERROR" not in log_text, log_text[-4000:]
    sent = drained.sent
    assert set(drained.sent.close_codes) <= {1001}, drained.sent.close_codes
    assert set(sent.statuses) <= {200, 503}, sent.statuses  # never a 500
    assert set(drained.poll_statuses) <= {200, 204, 503}, drained.poll_statuses
    # The request stream is told that its wait ended (the work goes on), not cut.
    assert b"event: error\n" in drained.sse, drained.sse
    assert b'"wait_timeout"' in drained.sse, drained.sse

    srv.start()  # the same file, the same database
    headers = {"Authorization": f"Bearer {token}"}

    async def after_restart() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{srv.url}/readyz") as resp:
                assert resp.status == 200
            log = await _read_log(session, srv.url, headers)
            clocks = [clock for clock, _ in log]
            assert clocks == list(range(1, len(log) + 1)), "the log has a gap or a repeat"
            by_op_id = {op_id: clock for clock, op_id in log}
            assert len(by_op_id) == len(log), "an op_id is in the log twice"
            lost = {op_id: c for op_id, c in sent.acked.items() if by_op_id.get(op_id) != c}
            assert not lost, f"acknowledged ops missing or moved after restart: {lost}"
            # What the subscriber saw is the log's prefix: in order, no gap, no duplicate.
            assert sent.seen == log[: len(sent.seen)]
            # Every op retried under its op_id: committed once, never twice.
            op_ids = sorted(sent.ops)
            first = await _post(session, srv.url, headers, [sent.ops[i] for i in op_ids])
            second = await _post(session, srv.url, headers, [sent.ops[i] for i in op_ids])
            for op_id, a, b in zip(op_ids, first, second, strict=True):
                assert "error" not in a, a
                assert "error" not in b, b
                if op_id in by_op_id:
                    assert (a["clock"], a["duplicate"]) == (by_op_id[op_id], True)
                assert (b["clock"], b["duplicate"]) == (a["clock"], True)
            head = len(log) + sum(1 for r in first if not r["duplicate"])
            async with session.get(
                f"{srv.url}/v1/workspaces/{WS}/docs/{DOC}", headers=headers
            ) as resp:
                doc = await resp.json()
            assert doc["clock"] == head
            assert doc["state"]["nodes"]["c"]["fields"]["n"] == len(sent.ops)
            nxt = await _post(session, srv.url, headers, [_increment("after-restart")])
            assert nxt[0]["clock"] == head + 1

    asyncio.run(after_restart())


def test_sigterm_with_a_zero_drain_deadline_does_not_wait_for_a_stuck_request(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, WS)
    server = _Server(db, tmp_path / "server.log", "--set", "drain_seconds=0")
    host, port = server.url.removeprefix("http://").split(":")

    async def stuck_request() -> asyncio.StreamWriter:
        """A POST whose body never comes: its handler waits in `request.read()`."""
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/workspaces/{WS}/docs/{DOC}/ops HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        await writer.drain()
        # aiohttp answers `Expect` as it hands the request to its handler: it is in flight.
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        writer.write(b'{"ops": [')
        await writer.drain()
        return writer

    async def scenario() -> None:
        writer = await stuck_request()
        try:
            code, took = await asyncio.to_thread(server.signal_and_wait, signal.SIGTERM, 10)
        finally:
            writer.close()
        assert code == 0
        assert took < 5

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
