"""Revoking a token while an embedded (SQLite) server runs: `cv-server token revoke` writes the
file from another process, the server reads it within `revocation_poll_seconds`, closes the
socket carrying the token with 4001 and answers its next request 401 `token_revoked`; the
operators' route does the same at once (docs/operating.md, "Revoking a token")."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token, new_token_id, verify_token
from tests.server.conftest import SECRET, ClientFactory

WS = "ws1"
TIMEOUT = 30.0


def mint(*workspaces: str, scopes: list[str] | None = None) -> str:
    """A token with a fresh id, as `cv-server token` mints."""
    return mint_token(
        SECRET,
        list(workspaces),
        now=time.time(),
        ttl=600,
        scopes=scopes,
        token_id=new_token_id(int(time.time()) + 600),
    )


async def status_of(client: TestClient[Any, Any], token: str) -> tuple[int, str | None]:
    answer = await client.get(
        f"/v1/workspaces/{WS}/docs/tree", headers={"Authorization": f"Bearer {token}"}
    )
    body = await answer.json()
    return answer.status, body.get("code") if answer.status >= 400 else None


async def subscribed_socket(client: TestClient[Any, Any], token: str) -> Any:
    ws = await client.ws_connect(
        f"/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {token}"}
    )
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    async with asyncio.timeout(TIMEOUT):
        while (await ws.receive_json())["type"] != "synced":
            pass
    return ws


async def test_a_token_revoked_by_the_cli_while_the_server_runs_is_refused_and_its_socket_closed(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    db = tmp_path / "cv.db"
    config = ServerConfig(db_path=db, token_secret=SECRET, revocation_poll_seconds=0.2)
    client = await aiohttp_client(create_app(config))
    token, other = mint(WS), mint(WS)
    assert await status_of(client, token) == (200, None)
    ws = await subscribed_socket(client, token)
    closing = asyncio.create_task(ws.receive())

    revoked = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "cv_server.cli", "token", "revoke", token, "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.startswith("cv-server token revoke: revoked ")

    async with asyncio.timeout(TIMEOUT):
        closed = await closing
    assert closed.type == WSMsgType.CLOSE, closed
    assert ws.close_code == 4001
    assert await status_of(client, token) == (401, "token_revoked")
    assert await status_of(client, other) == (200, None)  # only that token


async def test_the_operators_route_revokes_at_once_and_needs_operate_on_every_workspace(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # Polls far beyond the test's patience: what happens in time was done by the route.
    config = ServerConfig(
        db_path=tmp_path / "cv.db", token_secret=SECRET, revocation_poll_seconds=600
    )
    client = await aiohttp_client(create_app(config))
    token = mint(WS)
    ws = await subscribed_socket(client, token)
    closing = asyncio.create_task(ws.receive())
    token_id = verify_token(SECRET, token, now=0).token_id
    path = f"/v1/tokens/{token_id}/revoke"
    for refused, code in (
        (mint(WS, scopes=["operate"]), "forbidden_workspace"),
        (mint("*", scopes=["read", "write", "enqueue", "work"]), "missing_scope"),
    ):
        answer = await client.post(path, headers={"Authorization": f"Bearer {refused}"})
        assert (answer.status, (await answer.json())["code"]) == (403, code)
    assert await status_of(client, token) == (200, None)

    operator = mint("*", scopes=["operate"])
    answer = await client.post(path, headers={"Authorization": f"Bearer {operator}"})
    assert answer.status == 200
    assert (await answer.json())["newly"] is True
    assert await status_of(client, token) == (401, "token_revoked")
    async with asyncio.timeout(TIMEOUT):
        closed = await closing
    assert (closed.type, ws.close_code) == (WSMsgType.CLOSE, 4001)
    again = await client.ws_connect(
        f"/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {token}"}
    )
    async with asyncio.timeout(TIMEOUT):
        assert (await again.receive()).type == WSMsgType.CLOSE
    assert again.close_code == 4001
