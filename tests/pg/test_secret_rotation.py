"""`cv-server rotate-secret --database-url` while instances run: two server instances on one
PostgreSQL schema, in one process (real HTTP and websockets on loopback), and the real CLI in
a subprocess. Without a restart, both refuse every token of the old secret (401), accept tokens
of the new one, and close a socket opened with an old token (4001, as at a token's expiry, so
the SDK asks its token provider for a new one). A rotation whose notification was lost is
picked up when the instance's LISTEN connection comes back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import new_secret
from cv_server.cli import _with_schema
from cv_server.keys import STORES, TOKEN_SECRET
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.stores import listen_application_name, read_token_secret
from tests.server.conftest import ClientFactory

pytestmark = pytest.mark.postgres

WS = "ws1"
TIMEOUT = 30.0


@pytest.fixture
def cli(postgres_url: str, schema: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        backend = ("--database-url", postgres_url, "--schema", schema)
        return subprocess.run(
            [sys.executable, "-m", "cv_server.cli", *args, *backend],
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


@pytest.fixture
async def instances(
    aiohttp_client: ClientFactory, postgres_url: str, schema: str
) -> list[TestClient[Any, Any]]:
    # Sweeps (and so the LISTEN connection's liveness checks) far beyond the test's patience:
    # what arrives in time was pushed by the rotation's NOTIFY.
    config = ServerConfig(database_url=_with_schema(postgres_url, schema), sweep_seconds=600)
    return [await aiohttp_client(create_app(config)) for _ in range(2)]


async def _mint(cli: Callable[..., subprocess.CompletedProcess[str]]) -> str:
    answer = await asyncio.to_thread(cli, "token", "--workspace", WS)
    assert answer.returncode == 0, answer.stderr
    return answer.stdout.strip()


async def _status(client: TestClient[Any, Any], token: str) -> int:
    resp = await client.get(
        f"/v1/workspaces/{WS}/docs/tree", headers={"Authorization": f"Bearer {token}"}
    )
    return resp.status


def _replaced(client: TestClient[Any, Any]) -> asyncio.Event:
    """Set once the instance checks tokens with a new secret."""
    event = asyncio.Event()
    client.app[TOKEN_SECRET].watch(lambda _secret: event.set())
    return event


async def test_a_rotation_reaches_every_running_instance_and_closes_sockets_of_old_tokens(
    instances: list[TestClient[Any, Any]],
    cli: Callable[..., subprocess.CompletedProcess[str]],
    schema: str,
) -> None:
    old_token = await _mint(cli)
    assert [await _status(client, old_token) for client in instances] == [200, 200]
    ws = await instances[1].ws_connect(
        f"/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {old_token}"}
    )
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    async with asyncio.timeout(TIMEOUT):
        while (await ws.receive_json())["type"] != "synced":
            pass
    replaced = [_replaced(client) for client in instances]
    # Reading when the close comes, as a client's socket always is: one that reads the close
    # frame only after the server hung up cannot answer it, and aiohttp then reports 1006.
    closing = asyncio.create_task(ws.receive())

    rotated = await asyncio.to_thread(cli, "rotate-secret")
    assert rotated.returncode == 0, rotated.stderr
    assert rotated.stderr == ""
    assert rotated.stdout == (
        f"cv-server rotate-secret: replaced the token secret of schema {schema!r}; every token"
        " minted before is now refused: mint new ones with `cv-server token` (running"
        " instances follow without a restart)\n"
    )

    async with asyncio.timeout(TIMEOUT):
        for event in replaced:
            await event.wait()
        closed = await closing
    assert closed.type == WSMsgType.CLOSE, closed
    assert ws.close_code == 4001, (closed, ws.exception())
    new_token = await _mint(cli)
    assert [await _status(client, old_token) for client in instances] == [401, 401]
    assert [await _status(client, new_token) for client in instances] == [200, 200]
    for client, token, code in ((instances[0], old_token, 4001), (instances[1], new_token, None)):
        fresh = await client.ws_connect(
            f"/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {token}"}
        )
        if code is None:  # accepted: it answers a subscribe
            await fresh.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
            async with asyncio.timeout(TIMEOUT):
                assert (await fresh.receive_json())["type"] == "synced"
            await fresh.close()
        else:
            async with asyncio.timeout(TIMEOUT):
                assert (await fresh.receive()).type == WSMsgType.CLOSE
            assert fresh.close_code == code


async def test_a_rotation_whose_notification_was_lost_is_picked_up_on_reconnect(
    instances: list[TestClient[Any, Any]],
    cli: Callable[..., subprocess.CompletedProcess[str]],
    postgres_url: str,
    schema: str,
) -> None:
    """The secret replaced with no NOTIFY at all (as if it came while the LISTEN connection
    was away): the reconnect alone must make the instance read it again."""
    _, instance = instances
    old_token = await _mint(cli)
    replaced = _replaced(instance)
    conn = await asyncpg.connect(_with_schema(postgres_url, schema))
    try:
        await conn.execute(
            "UPDATE server_meta SET value = $1 WHERE key = 'token_secret'", new_secret()
        )
        queue = instance.app[STORES].queue
        assert isinstance(queue, PostgresQueueStore)
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = $1",
            listen_application_name(queue),
        )
    finally:
        await conn.close()
    assert killed == 1
    async with asyncio.timeout(TIMEOUT):
        await replaced.wait()
    assert await _status(instance, old_token) == 401
    assert await _status(instance, await _mint(cli)) == 200


async def test_rotation_refuses_a_schema_with_no_deployment_and_creates_nothing(
    cli: Callable[..., subprocess.CompletedProcess[str]], postgres_url: str, schema: str
) -> None:
    refused = await asyncio.to_thread(cli, "rotate-secret")
    assert refused.returncode == 1
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("cv-server rotate-secret: ")
    assert "not_set_up" in refused.stderr
    conn = await asyncpg.connect(postgres_url)
    try:
        tables = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", schema
        )
    finally:
        await conn.close()
    assert tables == 0


async def test_repeated_rotations_each_leave_one_new_secret(
    cli: Callable[..., subprocess.CompletedProcess[str]], postgres_url: str, schema: str
) -> None:
    init = await asyncio.to_thread(cli, "init")
    assert init.returncode == 0, init.stderr
    dsn = _with_schema(postgres_url, schema)
    seen = [await read_token_secret(dsn)]
    for _ in range(2):
        rotated = await asyncio.to_thread(cli, "rotate-secret")
        assert rotated.returncode == 0, rotated.stderr
        seen.append(await read_token_secret(dsn))
    assert len(set(seen)) == 3
