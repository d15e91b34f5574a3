"""Acceptance: a token revoked through one `cv-server serve` process while its socket is open on
another, both on one PostgreSQL schema (docs/operating.md, "Revoking a token").

B's revocation poll is set far beyond the test's bound, so only A's NOTIFY can tell B in time:
B closes the socket with 4001 within `CLOSE_BOUND_S` of A's answer, and both processes answer
the token's next request 401 `token_revoked`, while a token minted beside it still works on both.
Tokens are minted by `cv-server token`, as an operator mints them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from cv_server.auth import token_id_of
from cv_server.cli import _with_schema
from tests.acceptance.procs import ServerProcess, free_port
from tests.pg.helpers import fresh_schema

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

WS = "acc"
#: "Closed within a few seconds" (docs/operating.md); NOTIFY does it in well under one.
CLOSE_BOUND_S = 5.0
#: B's poll of the revocation list: never within the test, so only NOTIFY can reach B.
SETTINGS = ("revocation_poll_seconds=3600", "sweep_seconds=3600")


def _cli(url: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "cv_server.cli", *args, "--database-url", url],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.fixture
async def instances(postgres_url: str, tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """Two `cv-server serve` processes on one fresh schema: (its DSN, their base URLs)."""
    async with fresh_schema(postgres_url) as schema:
        url = _with_schema(postgres_url, schema)
        await asyncio.to_thread(_cli, url, "init")
        servers = [
            ServerProcess(
                None, free_port(), tmp_path / f"s{i}.log", database_url=url, settings=SETTINGS
            )
            for i in range(2)
        ]
        try:
            await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
            yield url, [s.url for s in servers]
        finally:
            for server in servers:
                await asyncio.to_thread(server.stop)


async def _status(session: aiohttp.ClientSession, base: str, token: str) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {token}"}
    async with session.get(f"{base}/v1/workspaces/{WS}/docs/tree", headers=headers) as answer:
        if answer.content_type == "application/problem+json":
            return answer.status, (await answer.json())["code"]
        return answer.status, None


async def test_a_token_revoked_through_process_a_closes_its_socket_on_process_b(
    instances: tuple[str, list[str]],
) -> None:
    url, (a, b) = instances
    token, other = [
        await asyncio.to_thread(_cli, url, "token", "--workspace", WS, "--scope", "read")
        for _ in range(2)
    ]
    operator = await asyncio.to_thread(_cli, url, "token", "--workspace", "*", "--scope", "operate")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(30)) as session:
        assert [await _status(session, base, token) for base in (a, b)] == [(200, None)] * 2
        ws = await session.ws_connect(
            f"{b}/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {token}"}
        )
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        synced = await ws.receive_json(timeout=30)
        assert synced["type"] == "synced", synced
        closing = asyncio.create_task(ws.receive())
        revoking_at = time.monotonic()
        async with session.post(
            f"{a}/v1/tokens/{token_id_of(token)}/revoke",
            headers={"Authorization": f"Bearer {operator}"},
        ) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["newly"] is True
        async with asyncio.timeout(CLOSE_BOUND_S):
            closed = await closing
        took = time.monotonic() - revoking_at
        assert (closed.type, ws.close_code) == (aiohttp.WSMsgType.CLOSE, 4001), (closed, took)
        print(f"socket on B closed {took:.3f} s after the revoke was sent to A")
        assert [await _status(session, base, token) for base in (a, b)] == [
            (401, "token_revoked")
        ] * 2
        assert [await _status(session, base, other) for base in (a, b)] == [(200, None)] * 2
