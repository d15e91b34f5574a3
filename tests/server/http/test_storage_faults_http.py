"""Every write route on a disk that is full answers 503 `storage_unavailable` with `Retry-After`
(the websocket apply an `error` frame, the socket staying up), reads keep answering, and each
verb works again once space returns, in the same app (docs/operating.md, "Storage faults").

The SQLite file is on a tmpfs mounted for the test (`tests/tmpfs.py`), filled to its last byte
by a ballast file: a write needs the WAL to grow, and it cannot.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlparse, urlunparse

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.helpers import claim, enqueue
from tests.tmpfs import fill, mounted_tmpfs

pytestmark = pytest.mark.integration

H: Final = auth("ws1")
REQUESTS: Final = "/v1/workspaces/ws1/requests"
OPS: Final = "/v1/workspaces/ws1/docs/a/ops"
SOCKET: Final = "/v1/workspaces/ws1/socket"


@pytest.fixture
async def on_tmpfs(
    tmp_path: Path, aiohttp_client: ClientFactory
) -> AsyncIterator[tuple[TestClient[Any, Any], Path]]:
    with mounted_tmpfs(tmp_path / "tmpfs", 4 * 1024 * 1024) as where:
        # Every result to the blob store, so completing a request writes a blob.
        config = ServerConfig(db_path=where / "cv.db", token_secret=SECRET, blob_threshold_bytes=0)
        client = await aiohttp_client(create_app(config))
        try:
            yield client, where / "ballast"
        finally:
            await client.close()


def _insert() -> dict[str, Any]:
    return {
        "op_id": new_op_id(),
        "type": "node.insert",
        "node_id": new_op_id(),
        "parent_id": "root",
    }


async def _refused(resp: Any) -> None:
    body = await resp.json(content_type=None)
    assert (resp.status, body.get("code")) == (503, "storage_unavailable"), body
    assert resp.headers["Retry-After"] == "5"  # sweep_seconds (cv_server/config.py)


async def test_every_write_verb_answers_503_on_a_full_disk_and_works_once_space_returns(
    on_tmpfs: tuple[TestClient[Any, Any], Path],
) -> None:
    client, ballast = on_tmpfs
    assert (await client.post(OPS, json={"ops": [_insert()]}, headers=H)).status == 200
    _, first = await enqueue(client, {"stage": "evaluate", "job_id": "J1"})
    _, second = await enqueue(client, {"stage": "evaluate", "job_id": "J2"})
    rows = [await claim(client), await claim(client)]
    await enqueue(client, {"stage": "evaluate", "job_id": "J0"})  # pending: a claim would write
    tokens = {row["request_id"]: row["claim_token"] for row in rows}
    ws = await client.ws_connect(SOCKET, headers=H)

    fill(ballast)

    def verbs() -> list[tuple[str, dict[str, Any], dict[str, str]]]:
        return [
            (OPS, {"ops": [_insert()]}, {}),
            (REQUESTS, {"stage": "evaluate", "job_id": "J3"}, {}),
            (REQUESTS, {"stage": "evaluate", "job_id": "J4"}, {"Idempotency-Key": "k-1"}),
            (
                f"{REQUESTS}/{first['request_id']}/heartbeat",
                {"claim_token": tokens[first["request_id"]]},
                {},
            ),
            (
                f"{REQUESTS}/{first['request_id']}/complete",
                {"claim_token": tokens[first["request_id"]], "result": {"score": 1}},
                {},
            ),
            (
                f"{REQUESTS}/{second['request_id']}/fail",
                {"claim_token": tokens[second["request_id"]], "error": "boom"},
                {},
            ),
            ("/v1/workspaces/ws1/locks/acquire", {"job_id": "J1", "task": "t", "holder": "w"}, {}),
        ]

    for path, body, extra in verbs():
        await _refused(await client.post(path, json=body, headers={**H, **extra}))
    await _refused(
        await client.post(
            "/v1/queue/claim", json={"worker_classes": ["evaluate"], "worker_id": "w"}, headers=H
        )
    )
    # The socket answers its apply with the code, and stays up: the next frame is answered.
    await ws.send_json({"type": "apply", "sub_doc": "a", "req": 1, "ops": [_insert()]})
    frame = await ws.receive_json(timeout=30)
    assert (frame["type"], frame["code"], frame["req"]) == ("error", "storage_unavailable", 1)
    assert frame["retry_after"] == 5
    # Reads keep answering.
    state = await client.get("/v1/workspaces/ws1/docs/a", headers=H)
    assert state.status == 200
    assert (await state.json())["clock"] == 1
    assert (await client.get(f"{REQUESTS}/{first['request_id']}", headers=H)).status == 200
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json(content_type=None))["code"] == "storage_unavailable"

    ballast.unlink()
    assert (await client.get("/readyz")).status == 200
    await ws.send_json({"type": "apply", "sub_doc": "a", "req": 2, "ops": [_insert()]})
    frame = await ws.receive_json(timeout=30)
    assert (frame["type"], frame["req"]) == ("ack", 2), frame
    await ws.close()
    for path, body, extra in verbs():
        resp = await client.post(path, json=body, headers={**H, **extra})
        assert resp.status in (200, 201, 202), (path, await resp.text())
    log = await client.get(OPS, headers=H, params={"since": 0})
    assert (await log.json())["clock"] == 3  # the first, the socket's, the last: none refused


@pytest.mark.postgres
async def test_postgresql_refusing_writes_answers_503_serves_reads_and_recovers(
    postgres_url: str, aiohttp_client: ClientFactory
) -> None:
    """A database of its own, made read-only by `default_transaction_read_only` (25006, as a
    standby or an operator's freeze answers): nothing leaks to other tests' databases."""
    name = f"cv_faults_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(postgres_url)
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        url = urlunparse(urlparse(postgres_url)._replace(path=f"/{name}"))
        client = await aiohttp_client(
            create_app(ServerConfig(database_url=url, token_secret=SECRET))
        )
        pool = client.app[STORES].oplog.pool
        assert (await client.post(OPS, json={"ops": [_insert()]}, headers=H)).status == 200

        await admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        await pool.expire_connections()  # new sessions take the database's setting
        await _refused(await client.post(OPS, json={"ops": [_insert()]}, headers=H))
        await _refused(
            await client.post(REQUESTS, json={"stage": "evaluate", "job_id": "J"}, headers=H)
        )
        state = await client.get("/v1/workspaces/ws1/docs/a", headers=H)
        assert state.status == 200
        assert (await state.json())["clock"] == 1
        ready = await client.get("/readyz")
        assert ready.status == 503
        assert (await ready.json(content_type=None))["code"] == "storage_unavailable"

        await admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        await pool.expire_connections()
        assert (await client.get("/readyz")).status == 200
        assert (await client.post(OPS, json={"ops": [_insert()]}, headers=H)).status == 200
        log = await client.get(OPS, headers=H, params={"since": 0})
        assert (await log.json())["clock"] == 2
        await client.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
