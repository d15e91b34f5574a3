"""Shutdown of the app served as `cv-server serve` serves it (`web.AppRunner` and its
`shutdown_timeout`): what happens to websocket applies still in flight when the drain deadline
passes and aiohttp cancels their handler, on PostgreSQL, where one socket's applies to one sub-doc
wait for each other (see `http_socket._Session.apply`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import web

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.keys import STORES
from cv_server.pg.oplog import PostgresOpLogStore
from cv_server.pg.oplog_sql import HEADS_TABLE
from tests.pg.helpers import fresh_schema
from tests.server.conftest import SECRET, auth

pytestmark = pytest.mark.postgres

WS = "acc"
DOC = "tree"


def _increment(op_id: str) -> dict[str, Any]:
    return {"type": "node.increment", "node_id": "c", "field": "n", "by": 1, "op_id": op_id}


async def _until(condition: Callable[[], Any], patience: float = 10.0) -> None:
    """Wait for a state (not for time): poll `condition` until true, fail after `patience`."""
    async with asyncio.timeout(patience):
        while not await condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.fixture
async def database_url(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as schema:
        yield _with_schema(postgres_url, schema)


async def _serve(config: ServerConfig, drain: float) -> tuple[web.AppRunner, str]:
    # As `cv_server.cli._serve_app` builds it: half the drain deadline each way.
    runner = web.AppRunner(create_app(config), access_log=None, shutdown_timeout=drain / 2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_socket_applies_cut_off_by_the_drain_deadline_end_without_an_error_or_traceback(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    config = ServerConfig(database_url=database_url, token_secret=SECRET)
    runner, url = await _serve(config, drain=1.0)
    store = runner.app[STORES].oplog
    assert isinstance(store, PostgresOpLogStore)
    headers = auth(WS)
    blocker = await asyncpg.connect(database_url)
    cleanup: asyncio.Task[None] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            setup = {
                "type": "node.insert",
                "node_id": "c",
                "parent_id": "root",
                "op_id": "setup-c0",
            }
            async with session.post(
                f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops", json={"ops": [setup]}, headers=headers
            ) as resp:
                assert resp.status == 200
            # Another transaction holds the sub-doc's head row: the socket's first apply waits
            # for it in the database, the three behind it wait for the first, in the server.
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute(
                f"SELECT clock FROM {HEADS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2"
                " FOR UPDATE",
                WS,
                DOC,
            )
            ws = await session.ws_connect(f"{url}/v1/workspaces/{WS}/socket", headers=headers)
            for i in range(4):
                frame = {"type": "apply", "sub_doc": DOC, "ops": [_increment(f"ws-op-{i:04d}")]}
                await ws.send_json({**frame, "req": i})

            async def lock_waited_for() -> bool:
                return bool(
                    await blocker.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted")
                )

            await _until(lock_waited_for)
            frames: list[Any] = []

            async def read() -> None:  # answers the server's close handshake
                async for msg in ws:
                    frames.append(msg.data)

            reader = asyncio.create_task(read())
            cleanup = asyncio.create_task(runner.cleanup())

            async def store_closing() -> bool:
                return bool(store._closed)

            # The drain deadline passed with the applies unanswered; the stores are closing.
            await _until(store_closing)
            await tx.rollback()
            await asyncio.wait_for(cleanup, 30)
            await asyncio.wait_for(reader, 10)
        assert ws.close_code == 1001
    finally:
        if cleanup is None:
            await runner.cleanup()
        await blocker.close()
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]

    # Restarted on the same database: the first apply committed once (it was in the database
    # when the drain ended); the others were never acknowledged and a retry commits each once.
    runner, url = await _serve(config, drain=1.0)
    try:
        async with aiohttp.ClientSession() as session:
            ops = [_increment(f"ws-op-{i:04d}") for i in range(4)]
            results = []
            for _ in range(2):
                async with session.post(
                    f"{url}/v1/workspaces/{WS}/docs/{DOC}/ops", json={"ops": ops}, headers=headers
                ) as resp:
                    assert resp.status == 200
                    results.append((await resp.json())["results"])
            async with session.get(f"{url}/v1/workspaces/{WS}/docs/{DOC}", headers=headers) as r:
                doc = await r.json()
    finally:
        await runner.cleanup()
    first, second = results
    assert first[0] == {"op_id": "ws-op-0000", "clock": 2, "duplicate": True}
    assert [r["clock"] for r in first] == [2, 3, 4, 5]
    assert [r["clock"] for r in second] == [2, 3, 4, 5]
    assert all(r["duplicate"] for r in second)
    assert doc["clock"] == 5
    assert doc["state"]["nodes"]["c"]["fields"]["n"] == 4
