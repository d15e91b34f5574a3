"""The queue on PostgreSQL with two server instances on one schema, real HTTP on loopback
(docs/queue.md, docs/postgres.md). What the contract suites check one store at a time, here through
both servers at once: a request runs to completion once, and a waiter on either instance learns its
outcome.

Leases are shrunk in the config (never a real 120 s wait); a lapse is awaited on the database's
clock, the one the queue judges leases by. Waiter sweeps are set far beyond each test's patience, so
an outcome that arrives in time was pushed (NOTIFY), not swept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.keys import WORK_SIGNALS
from cv_server.pg import create_pool
from cv_server.pg.queue import PostgresQueueStore
from tests.pg.helpers import settings_for
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.helpers import lift_long_poll_ceiling

pytestmark = pytest.mark.postgres

WS = "ws1"
STAGE = "evaluate"
REQUESTS = f"/v1/workspaces/{WS}/requests"
TIMEOUT = 20.0
#: Short enough to lapse within a test, long enough to outlive one HTTP round trip.
SHORT_LEASE = 0.5

Client = TestClient[Any, Any]
_DB_CLOCK = "SELECT extract(epoch FROM clock_timestamp())::float8"
Instances = Callable[..., Awaitable[tuple[Client, Client]]]


@pytest.fixture
def instances(postgres_url: str, schema: str, aiohttp_client: ClientFactory) -> Instances:
    """`await instances(**config)` → two servers on the test schema."""

    async def start(**overrides: Any) -> tuple[Client, Client]:
        overrides.setdefault("sweep_seconds", 600.0)
        config = ServerConfig(
            token_secret=SECRET, database_url=_with_schema(postgres_url, schema), **overrides
        )
        return await aiohttp_client(create_app(config)), await aiohttp_client(create_app(config))

    return start


@pytest.fixture
async def past(postgres_url: str) -> AsyncIterator[Callable[[float], Awaitable[None]]]:
    """`await past(t)`: returns once the database's clock is past `t` (a lease's expiry)."""
    conn = await asyncpg.connect(postgres_url)

    async def wait(instant: float) -> None:
        async with asyncio.timeout(TIMEOUT):
            # Waits on the database's clock, which signals nothing: read it until it is past.
            while await conn.fetchval(_DB_CLOCK) <= instant:  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    yield wait
    await conn.close()


async def enqueue(client: Client, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    resp = await client.post(REQUESTS, json=body, headers={**auth(WS), **headers})
    assert resp.status == 202, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def claim(client: Client, **extra: Any) -> Any:
    resp = await client.post(
        "/v1/queue/claim", json={"worker_classes": [STAGE], **extra}, headers=auth(WS)
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def verb(client: Client, held: dict[str, Any], name: str, **body: Any) -> tuple[int, Any]:
    resp = await client.post(
        f"{REQUESTS}/{held['request_id']}/{name}",
        json={"claim_token": held["claim_token"], **body},
        headers=auth(WS),
    )
    return resp.status, await resp.json(content_type=None)


async def row(client: Client, request_id: str) -> dict[str, Any]:
    resp = await client.get(f"{REQUESTS}/{request_id}", headers=auth(WS))
    assert resp.status == 200
    found: dict[str, Any] = await resp.json()
    return found


async def stream(client: Client, request_id: str) -> str:
    resp = await client.get(
        f"{REQUESTS}/{request_id}/stream", params={"timeout": str(TIMEOUT)}, headers=auth(WS)
    )
    assert resp.status == 200
    return await resp.text()


async def test_concurrent_enqueues_of_one_id_on_both_instances_make_one_live_request(
    instances: Instances,
) -> None:
    a, b = await instances()
    body = {"stage": STAGE, "job_id": "j1", "input": {"n": 1}}
    answers = await asyncio.gather(*(enqueue((a, b)[i % 2], body) for i in range(16)))
    assert len({answer["request_id"] for answer in answers}) == 1
    assert sorted(answer["coalesced"] for answer in answers) == [False] + [True] * 15
    assert await claim(b) is not None
    assert await claim(a) is None  # one live request, handed out once


async def test_a_rerun_racing_the_completion_on_the_other_instance_never_forks_a_run(
    instances: Instances,
) -> None:
    a, b = await instances()
    body = {"stage": STAGE, "job_id": "j1", "input": {"v": 0}}
    request_id = (await enqueue(a, body))["request_id"]
    for attempt in range(1, 9):
        held = (await claim(a))["request"]
        assert held["run"] == attempt
        (status, _), rerun = await asyncio.gather(
            verb(a, held, "complete", result={"run": attempt}),
            enqueue(b, {**body, "input": {"v": attempt}, "rerun": True}),
        )
        assert status == 200
        now = await row(b, request_id)
        if rerun["coalesced"]:  # absorbed by the run in flight: that run's answer stands
            assert (now["status"], now["run"], now["result"]) == ("done", attempt, {"run": attempt})
            await enqueue(b, {**body, "rerun": True})
        else:  # re-opened after the completion: exactly one new run, with the new input
            assert (now["status"], now["run"], now["input"]) == (
                "pending",
                attempt + 1,
                {"v": attempt},
            )
        assert (await row(a, request_id))["run"] == attempt + 1


async def test_a_lapsed_holder_on_one_instance_can_write_nothing_after_a_reclaim_on_the_other(
    instances: Instances, past: Callable[[float], Awaitable[None]]
) -> None:
    a, b = await instances(lease_seconds=SHORT_LEASE)
    request_id = (await enqueue(a, {"stage": STAGE, "job_id": "j1"}))["request_id"]
    waiter = asyncio.create_task(stream(a, request_id))
    first = (await claim(a, worker_id="first"))["request"]
    await past(first["lease_expires_at"])
    second = (await claim(b, worker_id="second"))["request"]
    assert second["dequeue_count"] == 2
    for client in (a, b):
        for name, body in (
            ("heartbeat", {}),
            ("complete", {"result": {"by": "first"}}),
            ("fail", {"error": {"code": "boom"}}),
        ):
            status, problem = await verb(client, first, name, **body)
            assert (status, problem["code"]) == (409, "lease_lost")
    assert await verb(a, second, "complete", result={"by": "second"}) == (200, {"status": "done"})
    status, problem = await verb(b, first, "complete", result={"by": "first"})
    assert (status, problem["code"]) == (409, "lease_lost")
    done = await row(b, request_id)
    assert (done["status"], done["result"], done["claimed_by"]) == (
        "done",
        {"by": "second"},
        "second",
    )
    text = await asyncio.wait_for(waiter, TIMEOUT)
    assert "event: done" in text
    assert '"by":"second"' in text


async def test_the_last_allowed_dequeue_lapsing_is_parked_and_both_instances_hear_it(
    instances: Instances, past: Callable[[float], Awaitable[None]]
) -> None:
    a, b = await instances(lease_seconds=SHORT_LEASE)
    body = {"stage": STAGE, "job_id": "j1", "max_dequeues": 2}
    request_id = (await enqueue(a, body))["request_id"]
    waiters = [asyncio.create_task(stream(client, request_id)) for client in (a, b)]
    first = (await claim(a))["request"]
    await past(first["lease_expires_at"])
    second = (await claim(b))["request"]
    assert second["dequeue_count"] == 2  # the boundary: the last allowed dequeue is handed out
    await past(second["lease_expires_at"])
    assert await claim(a) is None  # exhausted: parked, not handed out a third time
    parked = await row(b, request_id)
    assert (parked["status"], parked["dequeue_count"], parked["error"]["code"]) == (
        "poison",
        2,
        "lease_lapsed",
    )
    status, problem = await verb(b, second, "complete", result={"late": True})
    assert (status, problem["code"]) == (409, "lease_lost")
    for text in await asyncio.wait_for(asyncio.gather(*waiters), TIMEOUT):
        assert "event: done" in text
        assert '"status":"poison"' in text


async def test_fail_then_complete_of_one_claim_is_refused_and_the_backoff_holds_on_both(
    instances: Instances,
) -> None:
    a, b = await instances(failure_backoff_seconds=3600.0)
    request_id = (await enqueue(a, {"stage": STAGE, "job_id": "j1"}))["request_id"]
    held = (await claim(a))["request"]
    status, failed = await verb(a, held, "fail", error={"code": "boom"})
    assert (status, failed["status"]) == (200, "pending")
    for client in (a, b):
        status, problem = await verb(client, held, "complete", result={"late": True})
        assert (status, problem["code"]) == (409, "lease_lost")
        status, problem = await verb(client, held, "heartbeat")
        assert (status, problem["code"]) == (409, "lease_lost")
        assert await claim(client) is None  # backed off: not claimable before available_at
    # The holder's retried fail is answered, not refused, and changes nothing.
    assert await verb(b, held, "fail", error={"code": "other"}) == (200, failed)
    after = await row(b, request_id)
    assert (after["status"], after["result"], after["error"]) == ("pending", None, {"code": "boom"})
    assert after["available_at"] == failed["available_at"]


async def test_an_idle_worker_long_polling_one_instance_is_woken_by_an_enqueue_on_the_other(
    instances: Instances, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await instances()
    assert b.app is not None
    # Lifted past its 2 s ceiling, the poll can only be answered by the push (200).
    lift_long_poll_ceiling(b.app, monkeypatch)
    poll = asyncio.create_task(
        b.get(
            "/v1/queue/pending",
            params={"worker_classes": STAGE, "timeout": "2"},
            headers=auth(WS),
        )
    )
    # The poll must be registered before the work appears (the wait is for a state, not time).
    while not b.app[WORK_SIGNALS]._sleepers:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    await enqueue(a, {"stage": STAGE, "job_id": "j1"})
    resp = await asyncio.wait_for(poll, TIMEOUT)
    assert resp.status == 200  # pushed by NOTIFY from the other instance


async def test_an_idempotency_key_reused_on_the_other_instance_is_replayed_or_refused(
    instances: Instances,
) -> None:
    a, b = await instances()
    body = {"stage": STAGE, "deterministic": False, "input": {"n": 1}}
    first = await enqueue(a, body, **{"Idempotency-Key": "k1"})
    resp = await b.post(REQUESTS, json=body, headers={**auth(WS), "Idempotency-Key": "k1"})
    assert (resp.status, resp.headers.get("Idempotency-Replayed")) == (202, "true")
    assert await resp.json() == first
    resp = await b.post(
        REQUESTS, json={**body, "input": {"n": 2}}, headers={**auth(WS), "Idempotency-Key": "k1"}
    )
    assert (resp.status, (await resp.json())["code"]) == (422, "idempotency_key_reuse")
    held = (await claim(b))["request"]
    assert held["request_id"] == first["request_id"]
    assert await claim(a) is None  # the replay enqueued nothing


async def test_a_waiter_arriving_after_the_completion_on_the_other_instance_is_answered_at_once(
    instances: Instances,
) -> None:
    a, b = await instances()
    request_id = (await enqueue(a, {"stage": STAGE, "job_id": "j1"}))["request_id"]
    held = (await claim(a))["request"]
    assert await verb(a, held, "complete", result={"ok": 1}) == (200, {"status": "done"})
    started = time.monotonic()
    text = await stream(b, request_id)
    assert text.startswith("event: done")
    assert time.monotonic() - started < TIMEOUT / 4


async def test_a_completion_whose_notification_is_lost_reaches_the_waiter_by_the_sweep(
    instances: Instances, postgres_url: str, schema: str
) -> None:
    a, b = await instances(sweep_seconds=0.2)
    request_id = (await enqueue(a, {"stage": STAGE, "job_id": "j1"}))["request_id"]
    waiter = asyncio.create_task(stream(b, request_id))
    held = (await claim(a))["request"]
    pool = await create_pool(postgres_url, settings_for(schema))
    try:
        deaf = PostgresQueueStore(pool, channel="nobody_listens")
        await deaf.complete(request_id, held["claim_token"], {"ok": 1}, None)
    finally:
        await pool.close()
    text = await asyncio.wait_for(waiter, TIMEOUT)  # a sweep (0.2 s) away; the deadline: 60 s
    assert "event: done" in text
