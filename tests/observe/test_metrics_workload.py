"""A known workload on the real server, then `/metrics` read with prometheus_client's parser: every
counter adds up exactly, on SQLite and on PostgreSQL.

The workload: N ops committed, D sent again (duplicates), R rejected by code; K queue requests of
which one coalesces, one is poisoned, one has its lease lapse and one is replayed; contended and
expired compute locks; worker telemetry on completions; one live subscriber.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.keys import STORES
from tests.clocks import SkippingClock
from tests.observe.scrape import Samples, scrape
from tests.pg.helpers import fresh_schema
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.helpers import insert, post_ops

WS = "ws1"
OPS_ROUTE = "/v1/workspaces/{ws}/docs/{sub_doc}/ops"
N, D = 12, 5


async def _enqueue(client: TestClient[Any, Any], **body: Any) -> dict[str, Any]:
    resp = await client.post(f"/v1/workspaces/{WS}/requests", json=body, headers=auth(WS))
    assert resp.status == 202, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def _claim(client: TestClient[Any, Any], worker_class: str) -> dict[str, Any] | None:
    resp = await client.post(
        "/v1/queue/claim", json={"worker_classes": [worker_class]}, headers=auth(WS)
    )
    if resp.status == 204:
        return None
    assert resp.status == 200, await resp.text()
    row: dict[str, Any] = (await resp.json())["request"]
    return row


async def _verb(client: TestClient[Any, Any], row: dict[str, Any], verb: str, **body: Any) -> Any:
    resp = await client.post(
        f"/v1/workspaces/{WS}/requests/{row['request_id']}/{verb}",
        json={"claim_token": row.get("claim_token"), **body},
        headers=auth(WS),
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _lock(client: TestClient[Any, Any], verb: str, **body: Any) -> dict[str, Any]:
    resp = await client.post(
        f"/v1/workspaces/{WS}/locks/{verb}", json={"job_id": "j", **body}, headers=auth(WS)
    )
    assert resp.status == 200, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def _until(predicate: Callable[[], Any], what: str, seconds: float = 20.0) -> Any:
    """Poll `predicate` (a coroutine function) until it answers something truthy; `what` is
    the failure if it never does within `seconds`."""
    try:
        return await asyncio.wait_for(_poll(predicate), seconds)
    except TimeoutError:
        raise AssertionError(what) from None


async def _poll(predicate: Callable[[], Any]) -> Any:
    while True:
        found = await predicate()
        if found:
            return found
        await asyncio.sleep(0.02)


async def test_every_counter_of_a_known_workload_adds_up_exactly(
    aiohttp_client: ClientFactory,
    make_server_config: Callable[..., ServerConfig],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tiny lease, so that a lapse happens within the test; only the row meant to lapse is left
    # alone long enough to. The compute locks keep their 60 s TTL, on a clock the test skips past
    # it when one is meant to expire.
    config = make_server_config(lease_seconds=0.05)
    client = await aiohttp_client(create_app(config))
    assert client.app is not None
    lock_clock = SkippingClock()
    lock_clock.drive(client.app[STORES].locks, monkeypatch)
    before = await scrape(client)
    assert before["cv_ops_committed_total"] == 0

    # -- one live subscriber, so every committed op is broadcast once
    ws = await client.ws_connect(f"/v1/workspaces/{WS}/socket", headers=auth(WS))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await ws.receive_json(timeout=10))["type"] == "synced"

    # -- op-log: N commits (in batches of 3 and singles), D duplicates, R rejections by code
    ops = [insert(f"n{i}", op_id=f"op-commit-{i:04d}") for i in range(N)]
    await post_ops(client, ops[:3])
    for op in ops[3:]:
        await post_ops(client, [op])
    await post_ops(client, ops[:D])  # answered from the record: duplicates
    rejected = [
        insert("n0", op_id="op-exists-0001"),  # node_exists
        insert("n1", op_id="op-exists-0002"),  # node_exists
        insert("n-new", op_id=ops[0]["op_id"]),  # op_id_reuse: another op under a used id
    ]
    results = (await post_ops(client, rejected))["results"]
    codes = [result["error"]["code"] for result in results]
    assert codes == ["node_exists", "node_exists", "op_id_reuse"]
    frames = 0
    async with asyncio.timeout(10):
        while frames < N:
            frame = await ws.receive_json()
            frames += frame["type"] == "op"
    await ws.close()

    # -- queue: K requests
    done_telemetry = {"provider_calls": 3, "provider_s": 0.25, "wall_s": 0.5}
    plain = [await _enqueue(client, stage="work") for _ in range(3)]
    first = await _enqueue(client, stage="work", job_id="job-1")
    again = await _enqueue(client, stage="work", job_id="job-1")  # coalesces into `first`
    assert again["coalesced"]
    assert again["request_id"] == first["request_id"]
    doomed = await _enqueue(client, stage="fragile", max_dequeues=1)
    lapsing = await _enqueue(client, stage="slow")
    k_enqueued = len(plain) + 1 + 1 + 1  # `again` wrote nothing
    for _ in range(4):  # the 3 plain requests and job-1, each done with telemetry
        row = await _claim(client, "work")
        assert row is not None
        assert (await _verb(client, row, "complete", result=1, telemetry=done_telemetry))[
            "status"
        ] == "done"
    # Telemetry the route cannot store never fails the completion it rides on.
    assert await _claim(client, "work") is None
    bad_telemetry: Any = {"deep": []}
    for _ in range(300):
        bad_telemetry = [bad_telemetry]
    # poison: dequeued once (its budget), then failed; then replayed and done
    row = await _claim(client, "fragile")
    assert row is not None
    assert row["request_id"] == doomed["request_id"]
    assert (await _verb(client, row, "fail", error={"code": "boom"}))["status"] == "poison"
    resp = await client.post(
        f"/v1/workspaces/{WS}/requests/{doomed['request_id']}/replay", headers=auth(WS)
    )
    assert resp.status == 200, await resp.text()
    row = await _claim(client, "fragile")
    assert row is not None
    assert (await _verb(client, row, "complete", result=2, telemetry=bad_telemetry))[
        "status"
    ] == "done"
    resp = await client.get(f"/v1/workspaces/{WS}/requests/{row['request_id']}", headers=auth(WS))
    assert (await resp.json())["telemetry"] is None  # dropped, and the completion went through
    # a lapse: claimed, never heartbeated, claimed again once the lease lapsed, then done
    stale = await _claim(client, "slow")
    assert stale is not None
    assert stale["request_id"] == lapsing["request_id"]
    fresh = await _until(lambda: _claim(client, "slow"), "the lease never lapsed")
    assert fresh["dequeue_count"] == 2
    await _verb(client, fresh, "complete", result=3)

    # -- compute locks: one acquired, two contended, it expires, is taken over, and the first
    # holder's late release is refused
    held = await _lock(client, "acquire", task="t", holder="w1")
    assert held["acquired"]
    for holder in ("w2", "w3"):
        assert (await _lock(client, "acquire", task="t", holder=holder))["locked"]
    lock_clock.skip(config.compute_lock_ttl_seconds)  # the first holder's lock expires
    taken = await _lock(client, "acquire", task="t", holder="w4")
    assert taken["acquired"]
    assert not (await _lock(client, "release", task="t", token=held["token"]))["released"]
    assert (await _lock(client, "release", task="t", token=taken["token"]))["released"]

    # -- one unmatched route
    assert (await client.get("/v1/nothing-here", headers=auth(WS))).status == 404

    socket_route = "/v1/workspaces/{ws}/socket"

    async def socket_session_counted() -> Samples | None:
        # The session's line and count come when its handler returns, just after the close.
        samples = await scrape(client)
        return (
            samples
            if samples["cv_http_requests_total", {"route": socket_route, "status": "101"}]
            else None
        )

    after = await _until(socket_session_counted, "the websocket session was never counted")
    delta = _Delta(before, after)
    # op-log
    assert delta("cv_ops_committed_total") == N
    assert delta("cv_ops_duplicate_total") == D
    assert delta("cv_ops_rejected_total", code="node_exists") == 2
    assert delta("cv_ops_rejected_total", code="op_id_reuse") == 1
    assert delta.total("cv_ops_rejected_total") == 3
    assert delta("cv_commit_batch_ops_sum") == N + D + len(rejected)
    # one append per POST; several may share one group commit, never more than one each
    posts = 1 + (N - 3) + 1 + 1
    assert 1 <= delta("cv_commit_seconds_count") <= posts
    assert delta("cv_commit_batch_ops_count") == delta("cv_commit_seconds_count")
    # Every op frame written live is measured once. On PostgreSQL this instance's own commit
    # notification may send the subscriber to the log before the publish (a loaded machine):
    # such a frame is measured only if its publish came first, so there it is at most N.
    lag_count = delta("cv_broadcast_lag_seconds_count")
    if config.database_url is None:
        assert lag_count == N
    else:
        assert 0 < lag_count <= N
    # HTTP, by route template
    assert delta("cv_http_requests_total", route=OPS_ROUTE, status="200") == posts
    assert delta("cv_http_request_seconds_count", route=OPS_ROUTE) == posts
    assert delta("cv_http_requests_total", route="unmatched", status="404") == 1
    assert delta("cv_http_requests_total", route=socket_route, status="101") == 1
    assert not any("ws1" in route for route in _routes(after))  # never a raw path
    # queue
    assert delta("cv_queue_enqueued_total") == k_enqueued
    assert delta("cv_queue_coalesced_total") == 1
    assert delta("cv_queue_claimed_total") == 4 + 2 + 2
    assert delta("cv_queue_lease_lapses_total") == 1
    assert delta("cv_queue_failed_total") == 1
    assert delta("cv_queue_poisoned_total") == 1
    assert delta("cv_queue_replayed_total") == 1
    assert delta("cv_queue_done_total") == 4 + 1 + 1
    assert delta("cv_queue_wait_seconds_count") == 4 + 2 + 1  # the lapsed re-claim: not a wait
    assert delta("cv_stage_seconds_count", stage="work") == 4
    assert delta.total("cv_stage_seconds_count") == 6
    assert after["cv_queue_requests", {"status": "done"}] == k_enqueued
    for status in ("pending", "in_progress", "poison"):
        assert after["cv_queue_requests", {"status": status}] == 0
    # locks
    assert delta("cv_lock_acquired_total") == 2
    assert delta("cv_lock_contended_total") == 2
    assert delta("cv_lock_expired_total") == 1
    # worker telemetry: 4 runs reported 3 calls each; the unusable telemetry was dropped
    assert delta("cv_provider_calls_total", stage="work") == 12
    assert delta.total("cv_provider_calls_total") == 12
    assert delta("cv_provider_seconds_count") == 4
    assert delta("cv_provider_seconds_sum") == 4 * 0.25


def _routes(samples: Samples) -> set[str]:
    return {
        value
        for (name, labels), _ in samples.values.items()
        if name == "cv_http_requests_total"
        for label, value in labels
        if label == "route"
    }


class _Delta:
    def __init__(self, before: Samples, after: Samples) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        return self.after[name, labels] - self.before[name, labels]

    def total(self, name: str, **labels: str) -> float:
        return self.after.total(name, **labels) - self.before.total(name, **labels)


async def test_every_family_has_help_and_type(client: TestClient[Any, Any]) -> None:
    samples = await scrape(client)
    wanted = {
        "cv_ops_committed": "counter",
        "cv_ops_duplicate": "counter",
        "cv_ops_rejected": "counter",
        "cv_commit_seconds": "histogram",
        "cv_commit_batch_ops": "histogram",
        "cv_subscriptions": "gauge",
        "cv_broadcast_lag_seconds": "histogram",
        "cv_http_requests": "counter",
        "cv_http_request_seconds": "histogram",
        "cv_queue_requests": "gauge",
        "cv_queue_held_by_key": "gauge",
        "cv_queue_enqueued": "counter",
        "cv_queue_coalesced": "counter",
        "cv_queue_lease_lapses": "counter",
        "cv_queue_poisoned": "counter",
        "cv_queue_wait_seconds": "histogram",
        "cv_stage_seconds": "histogram",
        "cv_lock_acquired": "counter",
        "cv_lock_contended": "counter",
        "cv_lock_expired": "counter",
        "cv_provider_calls": "counter",
        "cv_provider_seconds": "histogram",
    }
    for family, kind in wanted.items():
        assert samples.types.get(family) == kind, family
        assert samples.helps[family], family


@pytest.mark.postgres
async def test_with_two_instances_counters_are_each_ones_own_and_queue_gauges_are_shared(
    aiohttp_client: ClientFactory, postgres_url: str
) -> None:
    async with fresh_schema(postgres_url) as schema:
        config = ServerConfig(database_url=_with_schema(postgres_url, schema), token_secret=SECRET)
        first = await aiohttp_client(create_app(config))
        second = await aiohttp_client(create_app(config))
        await post_ops(first, [insert("a", op_id="op-first-0001")])
        await _enqueue(first, stage="work")
        await _enqueue(first, stage="work")
        row = await _claim(second, "work")  # the other instance claims one
        assert row is not None
        one, other = await scrape(first), await scrape(second)
        # counters: what each instance did itself
        assert (one["cv_ops_committed_total"], other["cv_ops_committed_total"]) == (1, 0)
        assert (one["cv_queue_enqueued_total"], other["cv_queue_enqueued_total"]) == (2, 0)
        assert (one["cv_queue_claimed_total"], other["cv_queue_claimed_total"]) == (0, 1)
        # the queue gauges: the shared table, the same on both
        for samples in (one, other):
            assert samples["cv_queue_requests", {"status": "pending"}] == 1
            assert samples["cv_queue_requests", {"status": "in_progress"}] == 1


async def test_held_by_key_counts_the_requests_a_full_key_holds_back(
    client: TestClient[Any, Any],
) -> None:
    keyed = {"stage": "keyed", "concurrency_key": "customer-1", "max_running_per_key": 1}
    for job in ("a", "b", "c"):
        await _enqueue(client, **keyed, job_id=job)
    await _enqueue(client, stage="keyed", job_id="plain")
    assert (await scrape(client))["cv_queue_held_by_key"] == 0.0
    assert await _claim(client, "keyed") is not None
    assert (await scrape(client))["cv_queue_held_by_key"] == 2.0  # b and c wait; plain does not
