"""Acceptance: SIGKILL the real server between committing an apply that enqueues and answering it;
the client's resend applies the ops once and enqueues each request once — read from the op-log
and queue tables, not from the answers (docs/queue.md#start-work-with-the-change-that-needs-it).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import new_op_id
from cv_server.cli import _with_schema
from tests.acceptance.commit_paused_server import PAUSED_SUB_DOC
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.pg.helpers import fresh_schema

pytestmark = pytest.mark.acceptance

WS = "acc"
#: The bound on every wait of this test.
DEADLINE_S = 60.0
OPS_TABLE = "workspace_sub_doc_ops"
REQUESTS_TABLE = "workspace_process_requests"

#: (op_ids, request ids with their run and caused_by_clock), as the tables hold them.
Tables = tuple[list[str], list[tuple[str, int, int | None]]]


class Backend:
    """Where the two servers keep their data, and how the test reads the tables directly."""

    def __init__(self, db: Path | None, database_url: str | None) -> None:
        self.db, self.database_url = db, database_url

    async def tables(self) -> Tables:
        if self.database_url is None:
            return await asyncio.to_thread(self._sqlite_tables)
        conn = await asyncpg.connect(self.database_url)
        try:
            ops = await conn.fetch(
                f"SELECT op_id FROM {OPS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2"
                " ORDER BY clock",
                WS,
                PAUSED_SUB_DOC,
            )
            rows = await conn.fetch(
                f"SELECT request_id, run, caused_by_clock FROM {REQUESTS_TABLE}"
                " WHERE workspace_id = $1 ORDER BY request_id",
                WS,
            )
        finally:
            await conn.close()
        return [r[0] for r in ops], [(r[0], r[1], r[2]) for r in rows]

    def _sqlite_tables(self) -> Tables:
        assert self.db is not None
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            ops = conn.execute(
                f"SELECT op_id FROM {OPS_TABLE} WHERE workspace_id = ? AND sub_doc = ?"
                " ORDER BY clock",
                (WS, PAUSED_SUB_DOC),
            ).fetchall()
            rows = conn.execute(
                f"SELECT request_id, run, caused_by_clock FROM {REQUESTS_TABLE}"
                " WHERE workspace_id = ? ORDER BY request_id",
                (WS,),
            ).fetchall()
        return [r[0] for r in ops], [(r[0], r[1], r[2]) for r in rows]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        yield Backend(tmp_path / "cv.db", None)
        return
    postgres_url: str = request.getfixturevalue("postgres_url")
    async with fresh_schema(postgres_url) as schema:
        yield Backend(None, _with_schema(postgres_url, schema))


async def post(url: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/v1/workspaces/{WS}/docs/{PAUSED_SUB_DOC}/ops",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=DEADLINE_S),
        ) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def wait_for(marker: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await asyncio.to_thread(marker.exists):
        assert time.monotonic() < deadline, "the server never committed the apply"
        await asyncio.sleep(0.05)


async def test_a_resend_after_a_sigkill_between_commit_and_answer_applies_and_enqueues_once(
    backend: Backend, tmp_path: Path
) -> None:
    token = await asyncio.to_thread(
        mint_cli_token, backend.db, WS, database_url=backend.database_url
    )
    port, marker = free_port(), tmp_path / "committed"
    paused = ServerProcess(
        backend.db,
        port,
        tmp_path / "paused.log",
        database_url=backend.database_url,
        entry=("-m", "tests.acceptance.commit_paused_server", str(marker)),
    )
    plain = ServerProcess(
        backend.db, port, tmp_path / "plain.log", database_url=backend.database_url
    )
    op_ids = [new_op_id(), new_op_id()]
    body = {
        "ops": [
            {"type": "node.insert", "op_id": op_ids[0], "node_id": "n", "parent_id": "root"},
            {"type": "node.increment", "op_id": op_ids[1], "node_id": "n", "field": "v", "by": 1},
        ],
        # One item with a random-style id (derived from the op_ids), one deterministic.
        "enqueue": [{"stage": "evaluate", "input": {"x": 1}}, {"stage": "score", "job_id": "j"}],
    }
    await asyncio.to_thread(paused.start)
    try:
        first = asyncio.ensure_future(post(paused.url, token, body))
        await wait_for(marker)
        await asyncio.to_thread(paused.kill)
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(first, DEADLINE_S)
        committed_ops, committed_requests = await backend.tables()
        assert committed_ops == op_ids
        assert len(committed_requests) == 2

        await asyncio.to_thread(plain.start)
        status, answer = await post(plain.url, token, body)
    finally:
        await asyncio.to_thread(paused.stop)
        await asyncio.to_thread(plain.stop)

    assert status == 200, answer
    ops, requests = await backend.tables()
    assert ops == op_ids  # applied once
    # Enqueued once: the same two rows, each in its first run, naming the commit's last clock.
    assert requests == committed_requests
    assert [(run, clock) for _id, run, clock in requests] == [(1, 2), (1, 2)]
    # The resend is answered with those requests.
    assert [r["duplicate"] for r in answer["results"]] == [True, True]
    assert sorted(e["request_id"] for e in answer["enqueued"]) == [r[0] for r in requests]
