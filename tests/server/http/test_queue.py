"""The work queue through real HTTP: enqueue, coalesce, claim/complete, SSE, idempotency keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.keys import WORK_SIGNALS
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import lift_long_poll_ceiling

#: Bound of a wait on a long poll: a hang detector, far below a lifted poll's hour.
BOUND = 30.0

REQUESTS = "/v1/workspaces/ws1/requests"


async def _enqueue(
    client: TestClient[Any, Any], body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], Any]:
    resp = await client.post(REQUESTS, json=body, headers={**auth("ws1"), **(headers or {})})
    return resp.status, await resp.json(content_type=None), resp.headers


async def _claim(client: TestClient[Any, Any], worker_class: str = "evaluate") -> Any:
    resp = await client.post(
        "/v1/queue/claim",
        json={"worker_classes": [worker_class], "worker_id": "w1"},
        headers=auth("ws1"),
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    return (await resp.json())["request"]


async def _events(client: TestClient[Any, Any], request_id: str, wait: float) -> list[Any]:
    resp = await client.get(
        f"{REQUESTS}/{request_id}/stream", params={"timeout": wait}, headers=auth("ws1")
    )
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for block in (await resp.text()).strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def test_identical_deterministic_requests_coalesce_into_one_row(
    client: TestClient[Any, Any],
) -> None:
    body = {"stage": "evaluate", "job_id": "J1", "input": {"cols": ["a"]}}
    answers = await asyncio.gather(*(_enqueue(client, body) for _ in range(10)))
    assert {status for status, _, _ in answers} == {202}
    ids = {answer["request_id"] for _, answer, _ in answers}
    assert len(ids) == 1
    assert sum(1 for _, answer, _ in answers if not answer["coalesced"]) == 1
    assert await _claim(client) is not None
    assert await _claim(client) is None  # one row, one claim


async def test_a_claimed_request_completes_and_the_stream_reports_done(
    client: TestClient[Any, Any],
) -> None:
    _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": "J2"})
    request_id = answer["request_id"]
    assert answer["stream_url"] == f"{REQUESTS}/{request_id}/stream"
    stream = asyncio.create_task(_events(client, request_id, wait=30))
    row = await _claim(client)
    resp = await client.post(
        f"{REQUESTS}/{request_id}/complete",
        json={"claim_token": row["claim_token"], "result": {"score": 7}},
        headers=auth("ws1"),
    )
    assert resp.status == 200
    events = await asyncio.wait_for(stream, 30)
    assert [name for name, _ in events] == ["queued", "done"]
    assert events[-1][1]["result"] == {"score": 7}


async def test_a_waiter_past_its_deadline_gets_timeout_and_fetches_the_result_later(
    client: TestClient[Any, Any],
) -> None:
    _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": "J3"})
    request_id = answer["request_id"]
    events = await _events(client, request_id, wait=0.2)
    assert events[-1] == (
        "error",
        {"code": "wait_timeout", "request_id": request_id, "status": "pending"},
    )
    row = await _claim(client)
    await client.post(
        f"{REQUESTS}/{request_id}/complete",
        json={"claim_token": row["claim_token"], "result": "late"},
        headers=auth("ws1"),
    )
    resp = await client.get(f"{REQUESTS}/{request_id}", headers=auth("ws1"))
    assert (await resp.json())["result"] == "late"
    assert [name for name, _ in await _events(client, request_id, wait=5)] == ["done"]


async def test_a_stale_claim_token_cannot_complete(client: TestClient[Any, Any]) -> None:
    _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": "J4"})
    await _claim(client)
    resp = await client.post(
        f"{REQUESTS}/{answer['request_id']}/complete",
        json={"claim_token": "not-the-token", "result": 1},
        headers=auth("ws1"),
    )
    assert resp.status == 409
    assert (await resp.json(content_type=None))["code"] == "lease_lost"


async def test_an_idempotency_key_replays_the_first_answer_and_refuses_reuse(
    client: TestClient[Any, Any],
) -> None:
    body = {"stage": "scrape", "input": {"url": "x"}}
    key = {"Idempotency-Key": "k-1"}
    first = await _enqueue(client, body, key)
    again = await _enqueue(client, body, key)
    assert first[0] == again[0] == 202
    assert again[1] == first[1]
    assert again[2].get("Idempotency-Replayed") == "true"
    other = await _enqueue(client, {**body, "input": {"url": "y"}}, key)
    assert (other[0], other[1]["code"]) == (422, "idempotency_key_reuse")
    without_key = await _enqueue(client, body)
    assert without_key[1]["request_id"] != first[1]["request_id"]  # non-deterministic: a new row


async def test_large_results_go_to_the_blob_store(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(blob_threshold_bytes=100)))
    _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": "J5"})
    row = await _claim(client)
    big = {"text": "z" * 1000}
    await client.post(
        f"{REQUESTS}/{answer['request_id']}/complete",
        json={"claim_token": row["claim_token"], "result": big},
        headers=auth("ws1"),
    )
    done = await (
        await client.get(f"{REQUESTS}/{answer['request_id']}", headers=auth("ws1"))
    ).json()
    assert done["result"] is None
    assert done["blob_ref"]
    blob = await client.get(f"/v1/workspaces/ws1/blobs/{done['blob_ref']}", headers=auth("ws1"))
    assert json.loads(await blob.read()) == big
    other = await client.get(f"/v1/workspaces/ws2/blobs/{done['blob_ref']}", headers=auth("ws2"))
    assert other.status == 404


async def test_another_workspaces_requests_are_refused(client: TestClient[Any, Any]) -> None:
    _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": "J6"})
    resp = await client.get(f"{REQUESTS}/{answer['request_id']}", headers=auth("ws2"))
    assert resp.status == 403
    claim = await client.post(
        "/v1/queue/claim", json={"worker_classes": ["evaluate"]}, headers=auth("ws2")
    )
    assert claim.status == 204  # a ws2 worker never sees ws1's work


async def test_an_idle_workers_long_poll_is_woken_by_new_work(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.app is not None
    signals = client.app[WORK_SIGNALS]
    # Past their 2 s ceiling, the polls stay parked until a push (or the shutdown) ends them.
    lift_long_poll_ceiling(client.app, monkeypatch)

    async def poll(worker_class: str) -> int:
        resp = await client.get(
            "/v1/queue/pending",
            params={"worker_classes": worker_class, "timeout": "2"},
            headers=auth("ws1"),
        )
        return resp.status

    evaluate = asyncio.create_task(poll("evaluate"))
    other = asyncio.create_task(poll("enrich"))
    # Both polls must be registered before the work appears (the wait is for a state, not time).
    async with asyncio.timeout(BOUND):
        while len(signals._sleepers) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await _enqueue(client, {"stage": "evaluate", "job_id": "J7"})
    assert await asyncio.wait_for(evaluate, BOUND) == 200
    # The push wakes, in one step, every poll the work concerns: the other class's poll is
    # still parked, unwoken.
    (sleeper,) = signals._sleepers
    assert sleeper.classes == {"enrich"}
    assert not sleeper.wake.is_set()
    other.cancel()


async def test_batched_claim_and_complete_take_and_finish_each_row_once(
    client: TestClient[Any, Any],
) -> None:
    ids = set()
    for i in range(30):
        _, answer, _ = await _enqueue(client, {"stage": "evaluate", "job_id": f"B{i}"})
        ids.add(answer["request_id"])

    async def claim_batch() -> list[Any]:
        resp = await client.post(
            "/v1/queue/claim",
            json={"worker_classes": ["evaluate"], "worker_id": "w", "limit": 8},
            headers=auth("ws1"),
        )
        return [] if resp.status == 204 else (await resp.json())["requests"]

    batches = await asyncio.gather(*(claim_batch() for _ in range(6)))
    claimed = [row for batch in batches for row in batch]
    assert sorted(row["request_id"] for row in claimed) == sorted(ids)  # each exactly once
    completions = [
        {"request_id": row["request_id"], "claim_token": row["claim_token"], "result": i}
        for i, row in enumerate(claimed)
    ]
    completions.append({"request_id": claimed[0]["request_id"], "claim_token": "stale"})
    resp = await client.post(
        "/v1/queue/complete", json={"completions": completions}, headers=auth("ws1")
    )
    results = (await resp.json())["results"]
    assert [r.get("status") for r in results[:-1]] == ["done"] * 30
    assert results[-1]["error"]["code"] == "lease_lost"
    denied = await client.post(
        "/v1/queue/complete", json={"completions": completions[:1]}, headers=auth("ws2")
    )
    assert denied.status == 403


async def test_a_long_poll_ends_at_once_when_the_server_shuts_down(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle worker's long poll held the drain up to its 2 s ceiling: it is told "no work"
    (204) as the server starts shutting down, and so is one that arrives meanwhile. (Both polls
    are lifted to wait an hour: only the shutdown can answer them within the bound.)"""
    assert client.app is not None
    lift_long_poll_ceiling(client.app, monkeypatch)

    async def poll() -> int:
        resp = await client.get(
            "/v1/queue/pending",
            params={"worker_classes": "evaluate", "timeout": "2"},
            headers=auth("ws1"),
        )
        return resp.status

    waiting = asyncio.create_task(poll())
    while client.app is not None and not client.app[WORK_SIGNALS]._sleepers:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert client.app is not None
    await client.app.shutdown()
    assert await asyncio.wait_for(waiting, BOUND) == 204
    assert await asyncio.wait_for(poll(), BOUND) == 204
