"""Several cv-server instances on one PostgreSQL schema whose machines' clocks disagree: the queue
judges leases, backoffs and availability on the database's clock, the one they share, never on
whichever instance happens to answer (docs/queue.md, docs/postgres.md). Real HTTP on loopback, two
apps per test."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.keys import STORES
from tests.server.conftest import SECRET, ClientFactory, auth

pytestmark = pytest.mark.postgres

WS = "ws1"
STAGE = "evaluate"
#: Far more than any lease or backoff (120 s / 30 s): an NTP step, a misconfigured host.
HOUR = 3600.0
TIMEOUT = 20.0

#: The skew of the instance serving the current request (set per request by its middleware).
_SKEW: contextvars.ContextVar[float] = contextvars.ContextVar("instance_skew", default=0.0)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Instances = Callable[..., Awaitable[tuple[TestClient[Any, Any], TestClient[Any, Any]]]]


@pytest.fixture
def instances(
    postgres_url: str, schema: str, aiohttp_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> Instances:
    """`await instances(skew, **config)` → (on_time, skewed): two servers on the test schema; the
    second's wall clock (`time.time` while it serves a request) is `skew` seconds off."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + _SKEW.get())

    def off_by(skew: float) -> Any:
        @web.middleware
        async def skewed(request: web.Request, handler: Handler) -> web.StreamResponse:
            _SKEW.set(skew)
            return await handler(request)

        return skewed

    async def start(
        skew: float, **overrides: Any
    ) -> tuple[TestClient[Any, Any], TestClient[Any, Any]]:
        config = ServerConfig(
            token_secret=SECRET,
            database_url=_with_schema(postgres_url, schema),
            **overrides,
        )
        clients = []
        for instance_skew in (0.0, skew):
            app = create_app(config)
            app.middlewares.insert(0, off_by(instance_skew))
            clients.append(await aiohttp_client(app))
        return clients[0], clients[1]

    return start


@pytest.fixture
async def db_now(postgres_url: str) -> AsyncIterator[Callable[[], Awaitable[float]]]:
    """The database server's clock, read on a connection of the test's own."""
    conn = await asyncpg.connect(postgres_url)

    async def read() -> float:
        value: float = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        return value

    yield read
    await conn.close()


async def enqueue(client: TestClient[Any, Any], job_id: str = "job-1") -> str:
    resp = await client.post(
        f"/v1/workspaces/{WS}/requests", json={"stage": STAGE, "job_id": job_id}, headers=auth(WS)
    )
    assert resp.status == 202, await resp.text()
    request_id: str = (await resp.json())["request_id"]
    return request_id


async def claim(client: TestClient[Any, Any], worker_id: str = "w") -> dict[str, Any] | None:
    resp = await client.post(
        "/v1/queue/claim",
        json={"worker_classes": [STAGE], "worker_id": worker_id},
        headers=auth(WS),
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    request: dict[str, Any] = (await resp.json())["request"]
    return request


async def call(client: TestClient[Any, Any], row: dict[str, Any], verb: str, **body: Any) -> Any:
    resp = await client.post(
        f"/v1/workspaces/{WS}/requests/{row['request_id']}/{verb}",
        json={"claim_token": row["claim_token"], **body},
        headers=auth(WS),
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


def pick(
    pair: tuple[TestClient[Any, Any], TestClient[Any, Any]], skewed_first: bool
) -> tuple[TestClient[Any, Any], TestClient[Any, Any]]:
    on_time, skewed = pair
    return (skewed, on_time) if skewed_first else (on_time, skewed)


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["ahead", "behind"])
@pytest.mark.parametrize(
    "granted_by_skewed", [False, True], ids=["on_time_grants", "skewed_grants"]
)
async def test_a_live_lease_is_not_taken_over_by_the_other_instance(
    instances: Instances,
    db_now: Callable[[], Awaitable[float]],
    skew: float,
    granted_by_skewed: bool,
) -> None:
    granter, other = pick(await instances(skew), granted_by_skewed)
    await enqueue(granter)
    before = await db_now()
    row = await claim(granter, "first")
    after = await db_now()
    assert row is not None
    # The lease is the database's now + 120 s, whatever the granting machine's clock says.
    assert before <= row["claimed_at"] <= after
    assert row["lease_expires_at"] == pytest.approx(row["claimed_at"] + 120.0)

    assert await claim(other, "second") is None  # the first worker still runs it
    assert await claim(granter, "third") is None

    # A heartbeat may reach either instance (a load balancer): it extends, never shortens.
    beat = await call(other, row, "heartbeat")
    assert beat["lease_expires_at"] >= row["lease_expires_at"]
    assert await claim(granter, "fourth") is None
    assert await claim(other, "fifth") is None
    assert (await call(other, row, "complete", result={"ok": True}))["status"] == "done"


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["ahead", "behind"])
@pytest.mark.parametrize("failed_on_skewed", [False, True], ids=["on_time_fails", "skewed_fails"])
async def test_a_backed_off_request_is_not_handed_out_early(
    instances: Instances,
    db_now: Callable[[], Awaitable[float]],
    skew: float,
    failed_on_skewed: bool,
) -> None:
    failer, other = pick(await instances(skew), failed_on_skewed)
    await enqueue(failer)
    row = await claim(failer)
    assert row is not None
    before = await db_now()
    failed = await call(failer, row, "fail", error={"message": "flaky"})
    after = await db_now()

    assert failed["status"] == "pending"
    assert before + 30.0 <= failed["available_at"] <= after + 30.0  # 30 s
    assert await claim(other) is None
    assert await claim(failer) is None


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["ahead", "behind"])
@pytest.mark.parametrize("enqueued_on_skewed", [False, True], ids=["on_time", "skewed"])
async def test_a_new_request_is_claimable_at_once_on_every_instance(
    instances: Instances,
    db_now: Callable[[], Awaitable[float]],
    skew: float,
    enqueued_on_skewed: bool,
) -> None:
    enqueuer, other = pick(await instances(skew), enqueued_on_skewed)
    before = await db_now()
    request_id = await enqueue(enqueuer)
    after = await db_now()

    row = await claim(other)
    assert row is not None
    assert row["request_id"] == request_id
    assert before <= row["created_at"] <= after
    assert before <= row["available_at"] <= after


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["ahead", "behind"])
async def test_a_lapsed_lease_is_handed_out_on_time_and_not_before(
    instances: Instances,
    db_now: Callable[[], Awaitable[float]],
    skew: float,
) -> None:
    lease = 0.5  # shrunk from 120 s: the point is when it lapses, on the shared clock
    on_time, skewed = await instances(skew, lease_seconds=lease)
    await enqueue(on_time)
    first = await claim(on_time, "dies")
    assert first is not None

    # The worker died: its lease lapses `lease` seconds after the claim on the database's clock,
    # and the skewed instance hands the request out then, neither an hour early nor an hour late.
    async with asyncio.timeout(TIMEOUT):
        # Polls the server: the lapse of a lease is announced by nothing.
        while (second := await claim(skewed, "takes_over")) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    taken_at = await db_now()
    assert second["request_id"] == first["request_id"]
    assert second["dequeue_count"] == 2
    assert first["lease_expires_at"] <= second["claimed_at"] <= taken_at


async def test_the_queue_store_reads_the_database_clock(
    instances: Instances, db_now: Callable[[], Awaitable[float]]
) -> None:
    on_time, skewed = await instances(HOUR)
    for client in (on_time, skewed):
        queue = client.app[STORES].queue
        before = await db_now()
        now = await queue.clock()
        after = await db_now()
        assert before <= now <= after
