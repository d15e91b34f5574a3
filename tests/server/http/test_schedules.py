"""Schedules through real HTTP, on both backends (docs/queue.md, "Schedules"): adding, reading,
pausing, running and deleting them, the scheduler firing one, and whose grant a firing runs
under."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp.test_utils import TestClient

from cv_server.auth import mint_token
from tests.server.conftest import SECRET, auth

WS = "ws1"
BASE = f"/v1/workspaces/{WS}/schedules"
#: How long a test waits for the scheduler to fire a schedule due every second.
FIRING_DEADLINE = 10.0


def limited(*scopes: str, sub_docs: list[str] | None = None) -> dict[str, str]:
    token = mint_token(SECRET, [WS], now=time.time(), scopes=scopes, sub_docs=sub_docs)
    return {"Authorization": f"Bearer {token}"}


async def call(
    client: TestClient[Any, Any],
    method: str,
    path: str,
    status: int,
    *,
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    resp = await client.request(method, path, headers=headers or auth(WS), **kwargs)
    assert resp.status == status, await resp.text()
    if status >= 400:
        assert resp.content_type == "application/problem+json"
    return None if status == 204 else await resp.json(content_type=None)


def body(name: str = "tick", **fields: Any) -> dict[str, Any]:
    return {"name": name, "interval_seconds": 60, "enqueue": {"stage": "refresh"}, **fields}


async def fired(client: TestClient[Any, Any], name: str) -> dict[str, Any]:
    """The schedule once its first firing is recorded (bounded by `FIRING_DEADLINE`)."""
    deadline = time.monotonic() + FIRING_DEADLINE
    while time.monotonic() < deadline:
        got = await call(client, "GET", f"{BASE}/{name}", 200)
        if got["last_request_id"] is not None:
            return dict(got)
        await asyncio.sleep(0.1)
    raise AssertionError(f"schedule {name} did not fire within {FIRING_DEADLINE} s")


async def test_a_schedule_is_added_read_listed_and_deleted(server: TestClient[Any, Any]) -> None:
    added = await call(server, "POST", BASE, 201, json=body(missed="all", overlap="queue"))
    assert added["name"] == "tick"
    assert added["interval_seconds"] == 60
    assert added["cron"] is None
    assert (added["missed"], added["overlap"], added["paused"]) == ("all", "queue", False)
    assert added["enqueue"] == {"stage": "refresh", "input": None}
    assert added["enqueue_grant"] is None
    assert added["next_fire_at"] > added["created_at"]
    assert await call(server, "GET", f"{BASE}/tick", 200) == added
    await call(
        server, "POST", BASE, 201, json=body("alpha", cron="0 3 * * *", interval_seconds=None)
    )
    page = await call(server, "GET", BASE, 200, params={"limit": 1})
    assert [s["name"] for s in page["schedules"]] == ["alpha"]
    rest = await call(server, "GET", BASE, 200, params={"after": page["next_after"]})
    assert [s["name"] for s in rest["schedules"]] == ["tick"]
    assert rest["next_after"] is None
    await call(server, "DELETE", f"{BASE}/tick", 204)
    problem = await call(server, "DELETE", f"{BASE}/tick", 404)
    assert problem["code"] == "schedule_not_found"
    assert (await call(server, "GET", f"{BASE}/tick", 404))["code"] == "schedule_not_found"


async def test_a_name_is_taken_once_per_workspace(server: TestClient[Any, Any]) -> None:
    await call(server, "POST", BASE, 201, json=body())
    problem = await call(server, "POST", BASE, 409, json=body(interval_seconds=5))
    assert problem["code"] == "schedule_exists"


async def test_a_schedule_that_cannot_fire_is_refused_whole(server: TestClient[Any, Any]) -> None:
    bad = [
        body(cron="* * * * *"),  # both
        body(interval_seconds=None),  # neither
        body(cron="61 * * * *", interval_seconds=None),
        body(cron="* * * * * *", interval_seconds=None),  # six fields
        body(interval_seconds=0),
        body(missed="most"),
        body(overlap="pile"),
        body(name="a/b"),
        body(enqueue={"stage": "refresh", "rerun": True}),
        body(enqueue={"stage": "refresh", "deterministic": True}),
        body(enqueue={"input": 1}),
        body(enqueue={"stage": "refresh", "input": 2**64}),
    ]
    for item in bad:
        problem = await call(server, "POST", BASE, 422, json=item)
        assert problem["code"] == "invalid_field", item
    assert (await call(server, "GET", BASE, 200))["schedules"] == []


async def test_the_scheduler_fires_a_due_schedule_by_enqueueing_its_request(
    server: TestClient[Any, Any],
) -> None:
    await call(
        server,
        "POST",
        BASE,
        201,
        json=body(interval_seconds=1, enqueue={"stage": "refresh", "input": {"k": 1}}),
    )
    schedule = await fired(server, "tick")
    request = await call(
        server, "GET", f"/v1/workspaces/{WS}/requests/{schedule['last_request_id']}", 200
    )
    assert (request["stage"], request["input"], request["status"]) == (
        "refresh",
        {"k": 1},
        "pending",
    )
    assert schedule["last_fired_at"] < schedule["next_fire_at"]
    metrics = await (await server.get("/metrics")).text()
    assert "cv_schedule_firings_total 1.0" in metrics or "cv_schedule_firings_total 2.0" in metrics


async def test_pause_stops_firing_and_resume_starts_after_now(server: TestClient[Any, Any]) -> None:
    await call(server, "POST", BASE, 201, json=body())
    paused = await call(server, "POST", f"{BASE}/tick/pause", 200)
    assert paused["paused"] is True
    assert paused["next_fire_at"] is None
    resumed = await call(server, "POST", f"{BASE}/tick/resume", 200)
    assert resumed["paused"] is False
    assert resumed["next_fire_at"] > time.time() - 5
    assert (await call(server, "POST", f"{BASE}/nope/pause", 404))["code"] == "schedule_not_found"


async def test_run_enqueues_a_firing_now_and_records_it(server: TestClient[Any, Any]) -> None:
    await call(server, "POST", BASE, 201, json=body(paused=True))
    answer = await call(server, "POST", f"{BASE}/tick/run", 202)
    assert answer["request_id"].startswith("s_")
    assert answer["coalesced"] is False
    got = await call(server, "GET", f"{BASE}/tick", 200)
    assert got["last_request_id"] == answer["request_id"]
    assert got["next_fire_at"] is None  # still paused
    await call(server, "GET", f"/v1/workspaces/{WS}/requests/{answer['request_id']}", 200)


async def test_firings_run_under_the_grant_of_the_token_that_added_the_schedule(
    server: TestClient[Any, Any],
) -> None:
    notes = limited("enqueue", "read", sub_docs=["notes*"])
    added = await call(server, "POST", BASE, 201, json=body(interval_seconds=1), headers=notes)
    grant = {"scopes": ["enqueue", "read"], "sub_docs": ["notes*"]}
    assert added["enqueue_grant"] == grant
    schedule = await fired(server, "tick")
    request = await call(
        server, "GET", f"/v1/workspaces/{WS}/requests/{schedule['last_request_id']}", 200
    )
    assert request["enqueue_grant"] == grant
    # Firing it out of turn needs a token that could have added it.
    narrower = limited("enqueue", sub_docs=["notes.a"])
    problem = await call(server, "POST", f"{BASE}/tick/run", 403, headers=narrower)
    assert problem["code"] == "grant_exceeded"
    await call(server, "POST", f"{BASE}/tick/run", 202, headers=notes)
    await call(server, "POST", f"{BASE}/tick/run", 202)  # every scope and sub-doc


async def test_a_worker_token_cannot_add_a_schedule(server: TestClient[Any, Any]) -> None:
    problem = await call(server, "POST", BASE, 403, json=body(), headers=limited("work"))
    assert problem["code"] == "missing_scope"
    operator = limited("operate")
    assert (await call(server, "POST", BASE, 403, json=body(), headers=operator))[
        "code"
    ] == "missing_scope"
    await call(server, "GET", BASE, 200, headers=operator)
