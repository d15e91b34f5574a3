"""Several server instances on one PostgreSQL schema, in one process (real HTTP and websockets on
loopback): cross-instance broadcast, catch-up after a lost LISTEN connection, cross-instance
waiters, one shared token secret, and `cv-server token --database-url`."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import ClientWebSocketResponse
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token, verify_token
from cv_server.cli import _with_schema
from cv_server.keys import STORES, TOKEN_SECRET
from cv_server.pg import PostgresOpLogStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.stores import (
    NotSetUp,
    SchemaMissing,
    listen_application_name,
    read_token_secret,
)
from tests.contract.oplog_contract import incoming
from tests.pg.helpers import settings_for
from tests.server.conftest import ClientFactory

pytestmark = pytest.mark.postgres

WS = "ws1"
TIMEOUT = 30.0


def dsn_in(postgres_url: str, schema: str) -> str:
    return _with_schema(postgres_url, schema)


def bearer(client: TestClient[Any, Any], *workspaces: str) -> dict[str, str]:
    token = mint_token(client.app[TOKEN_SECRET].value, list(workspaces or (WS,)), now=time.time())
    return {"Authorization": f"Bearer {token}"}


def increment(op_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "node.increment",
        "node_id": "root",
        "field": "n",
        "by": 1,
        "op_id": op_id or new_op_id(),
    }


@pytest.fixture
def make_config(postgres_url: str, schema: str) -> Callable[..., ServerConfig]:
    def make(**overrides: Any) -> ServerConfig:
        values: dict[str, Any] = {"database_url": dsn_in(postgres_url, schema)}
        values.update(overrides)
        return ServerConfig(**values)

    return make


@pytest.fixture
async def instances(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> list[TestClient[Any, Any]]:
    # Sweeps far beyond the test's patience: what arrives in time was pushed, not swept.
    return [await aiohttp_client(create_app(make_config(sweep_seconds=600))) for _ in range(2)]


async def subscribe(
    client: TestClient[Any, Any], sub_doc: str, since: int = 0
) -> ClientWebSocketResponse:
    ws = await client.ws_connect(f"/v1/workspaces/{WS}/socket", headers=bearer(client))
    await ws.send_json({"type": "subscribe", "sub_doc": sub_doc, "since": since})
    async with asyncio.timeout(TIMEOUT):
        while (await ws.receive_json())["type"] != "synced":
            pass
    return ws


async def op_clocks(ws: ClientWebSocketResponse, until_clock: int) -> list[int]:
    clocks: list[int] = []
    async with asyncio.timeout(TIMEOUT):
        while not clocks or clocks[-1] < until_clock:
            frame = await ws.receive_json()
            if frame["type"] == "op":
                clocks.append(frame["clock"])
    return clocks


async def test_instances_share_one_token_secret_created_by_the_first(
    instances: list[TestClient[Any, Any]], postgres_url: str, schema: str
) -> None:
    first, second = instances
    assert first.app[TOKEN_SECRET].value == second.app[TOKEN_SECRET].value
    assert await read_token_secret(dsn_in(postgres_url, schema)) == first.app[TOKEN_SECRET].value


async def test_a_subscriber_on_one_instance_sees_each_op_committed_on_another_once_in_order(
    instances: list[TestClient[Any, Any]],
) -> None:
    writer, reader = instances
    ws = await subscribe(reader, "tree")
    for _ in range(20):
        resp = await writer.post(
            f"/v1/workspaces/{WS}/docs/tree/ops",
            json={"ops": [increment(), increment()]},
            headers=bearer(writer),
        )
        assert resp.status == 200
    assert await op_clocks(ws, 40) == list(range(1, 41))
    await ws.close()


async def test_a_lost_listen_connection_makes_every_subscriber_catch_up_from_the_log(
    instances: list[TestClient[Any, Any]], postgres_url: str, schema: str
) -> None:
    _, reader = instances
    ws = await subscribe(reader, "tree")
    # Commit from a store that announces on a channel nobody listens to: the reader hears
    # nothing of these ops, as if their notifications had been lost.
    silent = await PostgresOpLogStore.open(
        postgres_url, settings_for(schema), channel="cv_test_nobody_listens"
    )
    try:
        await silent.append(WS, "tree", [incoming(increment()) for _ in range(5)])
    finally:
        await silent.close()
    queue = reader.app[STORES].queue
    assert isinstance(queue, PostgresQueueStore)
    conn = await asyncpg.connect(postgres_url)
    try:
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = $1",
            listen_application_name(queue),
        )
    finally:
        await conn.close()
    assert killed == 1
    # Only the reconnect can tell the reader to look: it catches up, each op once, in order.
    assert await op_clocks(ws, 5) == [1, 2, 3, 4, 5]
    await ws.close()


async def test_a_waiter_on_one_instance_is_woken_by_a_completion_on_another(
    instances: list[TestClient[Any, Any]],
) -> None:
    front, worker = instances
    answer = await (
        await front.post(
            f"/v1/workspaces/{WS}/requests",
            json={"stage": "evaluate", "job_id": "j1"},
            headers=bearer(front),
        )
    ).json()
    stream = asyncio.create_task(
        front.get(answer["stream_url"], params={"timeout": str(TIMEOUT)}, headers=bearer(front))
    )
    claimed = await (
        await worker.post(
            "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=bearer(worker)
        )
    ).json()
    request = claimed["request"]
    started = time.monotonic()
    done = await worker.post(
        f"/v1/workspaces/{WS}/requests/{request['request_id']}/complete",
        json={"claim_token": request["claim_token"], "result": {"score": 7}},
        headers=bearer(worker),
    )
    assert done.status == 200
    body = await (await asyncio.wait_for(stream, TIMEOUT)).text()
    assert "event: done" in body
    assert '"score":7' in body
    assert time.monotonic() - started < TIMEOUT / 2  # pushed by NOTIFY, not a deadline


async def test_a_cancel_on_one_instance_ends_a_wait_on_another_at_once(
    instances: list[TestClient[Any, Any]],
) -> None:
    front, other = instances
    answer = await (
        await front.post(
            f"/v1/workspaces/{WS}/requests",
            json={"stage": "nobody-serves-this", "job_id": "j1"},
            headers=bearer(front),
        )
    ).json()
    stream = asyncio.create_task(
        front.get(answer["stream_url"], params={"timeout": str(TIMEOUT)}, headers=bearer(front))
    )
    started = time.monotonic()
    cancelled = await other.post(
        f"/v1/workspaces/{WS}/requests/{answer['request_id']}/cancel", headers=bearer(other)
    )
    assert cancelled.status == 200
    assert (await cancelled.json())["status"] == "cancelled"
    body = await (await asyncio.wait_for(stream, TIMEOUT)).text()
    assert "event: cancelled" in body
    assert time.monotonic() - started < TIMEOUT / 2  # pushed by NOTIFY, not a deadline


async def test_a_result_of_several_megabytes_uploaded_to_one_instance_is_served_by_another(
    instances: list[TestClient[Any, Any]],
) -> None:
    front, worker = instances
    enqueued = await front.post(
        f"/v1/workspaces/{WS}/requests",
        json={"stage": "big", "job_id": "j1"},
        headers=bearer(front),
    )
    assert enqueued.status == 202
    claimed = await (
        await worker.post(
            "/v1/queue/claim", json={"worker_classes": ["big"]}, headers=bearer(worker)
        )
    ).json()
    request = claimed["request"]
    path = f"/v1/workspaces/{WS}/requests/{request['request_id']}"
    result = b'"' + "é".encode() * 1_500_000 + b'"'  # 3 MB of JSON, not ASCII
    uploaded = await worker.post(
        f"{path}/result",
        data=io.BytesIO(result),
        headers={
            **bearer(worker),
            "Claim-Token": request["claim_token"],
            "Content-Type": "application/json",
        },
    )
    assert uploaded.status == 201
    blob_ref = (await uploaded.json())["blob_ref"]
    done = await worker.post(
        f"{path}/complete",
        json={"claim_token": request["claim_token"], "blob_ref": blob_ref},
        headers=bearer(worker),
    )
    assert done.status == 200
    row = await (await front.get(path, headers=bearer(front))).json()
    assert (row["status"], row["blob_ref"], row["dequeue_count"]) == ("done", blob_ref, 1)
    blob = await front.get(f"/v1/workspaces/{WS}/blobs/{blob_ref}", headers=bearer(front))
    assert await blob.read() == result


async def test_the_token_command_mints_a_token_the_instances_accept(
    instances: list[TestClient[Any, Any]], postgres_url: str, schema: str
) -> None:
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "cv_server.cli",
            "token",
            "--database-url",
            postgres_url,
            "--schema",
            schema,
            "--workspace",
            WS,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    token = out.stdout.strip()
    claims = verify_token(instances[0].app[TOKEN_SECRET].value, token, now=time.time())
    assert claims.workspaces == frozenset({WS})
    resp = await instances[1].get(
        f"/v1/workspaces/{WS}/docs/tree", headers={"Authorization": f"Bearer {token}"}
    )
    assert resp.status == 200


async def test_token_reads_a_deployment_and_sets_none_up_where_there_is_none(
    postgres_url: str, schema: str
) -> None:
    """`cv-server token --database-url` on a schema no instance or `init` set up (a mistyped
    DSN) created the tables and a fresh secret there, and printed a token no instance accepts.
    It now refuses in one line and leaves the schema empty; `init` sets it up, idempotently."""
    dsn = dsn_in(postgres_url, schema)
    with pytest.raises(NotSetUp, match="cv-server init"):
        await read_token_secret(dsn)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        backend = ("--database-url", postgres_url, "--schema", schema)
        return subprocess.run(
            [sys.executable, "-m", "cv_server.cli", *args, *backend],
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = await asyncio.to_thread(cli, "token", "--workspace", WS)
    assert refused.returncode == 1
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1
    assert "not_set_up" in refused.stderr
    conn = await asyncpg.connect(postgres_url)
    try:
        tables = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", schema
        )
    finally:
        await conn.close()
    assert tables == 0
    said = []
    for _ in range(2):
        init = await asyncio.to_thread(cli, "init")
        assert init.returncode == 0, init.stderr
        said.append(init.stdout)
    assert said == [
        f"cv-server init: set up schema {schema!r}\n",
        f"cv-server init: schema {schema!r} is already set up; its token secret is kept\n",
    ]
    secret = await read_token_secret(dsn)
    minted = await asyncio.to_thread(cli, "token", "--workspace", WS)
    assert minted.returncode == 0, minted.stderr
    assert verify_token(secret, minted.stdout.strip(), now=time.time()).workspaces == {WS}


async def test_a_search_path_naming_no_existing_schema_is_refused(postgres_url: str) -> None:
    with pytest.raises(SchemaMissing, match="create it first"):
        await read_token_secret(_with_schema(postgres_url, "cv_test_does_not_exist"))


def test_the_schema_flag_replaces_any_search_path_of_the_url() -> None:
    url = "postgresql://u@h:5432/db?options=-csearch_path%3Dold&sslmode=disable"
    assert _with_schema(url, "fresh") == (
        "postgresql://u@h:5432/db?sslmode=disable&search_path=fresh"
    )
    assert _with_schema(url, None) == url
    with pytest.raises(SystemExit):
        _with_schema(url, "Robert'); DROP TABLE")
