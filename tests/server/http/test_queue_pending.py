"""`GET /v1/queue/pending`, the idle workers' long poll (docs/protocol.md), on both backends: work
already claimable answers 200 at once, without waiting for a push; work the token may not claim,
or that is not claimable yet, does not. (Waking on work that becomes pending during the wait:
`tests/server/http/test_queue.py`.)

Each poll that should find work asks for 30 s, past the route's 2 s ceiling: a poll answered by
its timeout is a 204, so a 200 is the work found, not a timing margin."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from cv_server.keys import STORES
from tests.contract.queue_contract import LEASE, STAGE, request
from tests.server.conftest import auth

PENDING = "/v1/queue/pending"


async def _poll(
    server: TestClient[Any, Any], workspace: str, patience: float, worker_class: str = STAGE
) -> tuple[int, Any]:
    resp = await server.get(
        PENDING,
        params=[
            ("worker_classes", "nobody"),
            ("worker_classes", worker_class),
            ("timeout", patience),
        ],
        headers=auth(workspace),
    )
    body = await resp.json() if resp.status == 200 else await resp.read()
    return resp.status, body


async def _enqueue(server: TestClient[Any, Any], workspace: str, job_id: str) -> None:
    resp = await server.post(
        f"/v1/workspaces/{workspace}/requests",
        json={"stage": STAGE, "job_id": job_id},
        headers=auth(workspace),
    )
    assert resp.status == 202, await resp.text()


async def test_work_already_pending_answers_at_once(server: TestClient[Any, Any]) -> None:
    await _enqueue(server, "ws1", "J1")
    assert await _poll(server, "ws1", 30) == (200, {"pending": True})
    assert await _poll(server, "*", 30) == (200, {"pending": True})  # an operator's token
    # A hint, not a claim: the work is still there for the worker's claim.
    claim = await server.post(
        "/v1/queue/claim", json={"worker_classes": [STAGE]}, headers=auth("ws1")
    )
    assert claim.status == 200


async def test_work_under_a_lapsed_lease_answers_at_once(server: TestClient[Any, Any]) -> None:
    """A request whose worker died (its lease lapsed an hour ago on the store's clock) is
    claimable: the poll says so, and the claim it leads to re-drives it."""
    assert server.app is not None
    queue = server.app[STORES].queue
    past = await queue.clock() - 3600
    row, _ = await queue.enqueue(request(ws="ws1"), past)
    assert await queue.claim(STAGE, "dead-worker", LEASE, past) is not None
    assert await _poll(server, "ws1", 30) == (200, {"pending": True})
    claim = await server.post(
        "/v1/queue/claim", json={"worker_classes": [STAGE]}, headers=auth("ws1")
    )
    assert (await claim.json())["request"]["request_id"] == row.request_id


async def test_work_the_token_does_not_grant_is_not_announced(
    server: TestClient[Any, Any],
) -> None:
    assert server.app is not None
    queue = server.app[STORES].queue
    past = await queue.clock() - 3600
    await queue.enqueue(request("dead", ws="ws1"), past)
    assert await queue.claim(STAGE, "dead-worker", LEASE, past) is not None  # lapsed
    await _enqueue(server, "ws1", "J1")  # pending
    status, _ = await _poll(server, "ws2", 0)
    assert status == 204
    status, _ = await _poll(server, "ws1", 0, worker_class="enrich")  # another class's poll
    assert status == 204


async def test_work_backing_off_is_not_announced(server: TestClient[Any, Any]) -> None:
    await _enqueue(server, "ws1", "J1")
    claimed = await server.post(
        "/v1/queue/claim", json={"worker_classes": [STAGE]}, headers=auth("ws1")
    )
    row = (await claimed.json())["request"]
    failed = await server.post(
        f"/v1/workspaces/ws1/requests/{row['request_id']}/fail",
        json={"claim_token": row["claim_token"]},
        headers=auth("ws1"),
    )
    assert (await failed.json())["status"] == "pending"  # again, after the 30 s backoff
    status, _ = await _poll(server, "ws1", 0)
    assert status == 204


async def test_a_worker_class_the_claim_would_refuse_is_refused(
    server: TestClient[Any, Any],
) -> None:
    """The classes now reach the store: read as a claim reads them, so a NUL (which PostgreSQL
    text cannot hold) is a 422, never a 500."""
    for bad in ("a\x00b", "x" * 65, ""):
        resp = await server.get(
            PENDING, params={"worker_classes": bad, "timeout": "0"}, headers=auth("ws1")
        )
        assert resp.status == 422, (bad, await resp.text())
        assert (await resp.json())["code"] == "invalid_field"
