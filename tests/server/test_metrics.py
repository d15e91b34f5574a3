"""`/metrics` says what happened: every apply counted once by its outcome, whichever route it
came by; slow subscribers cut off are counted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.hub import CLOSE_TOO_SLOW
from cv_server.metrics import Metrics
from tests.observe.scrape import Samples
from tests.observe.scrape import scrape as scrape_metrics
from tests.server.conftest import ClientFactory, auth
from tests.server.helpers import insert, post_ops

SOCKET = "/v1/workspaces/ws1/socket"


async def scrape(client: TestClient[Any, Any]) -> Samples:
    return await scrape_metrics(client)


async def test_applies_are_counted_once_by_outcome_over_http_and_the_websocket(
    client: TestClient[Any, Any],
) -> None:
    before = await scrape(client)
    # HTTP: two commits, then the same two again (duplicates) and a rejection.
    first = [insert("a", op_id="op-aaaaaaaa"), insert("b", op_id="op-bbbbbbbb")]
    await post_ops(client, first)
    await post_ops(client, first)
    await post_ops(client, [insert("a", op_id="op-a2222222")])  # node_exists: rejected
    # Websocket: one commit, its replay (a duplicate), one rejection.
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    acks = 0
    for req, op in enumerate(
        [
            insert("c", op_id="op-cccccccc"),
            insert("c", op_id="op-cccccccc"),
            insert("c", op_id="op-c2222222"),
        ]
    ):
        await ws.send_json({"type": "apply", "req": req, "sub_doc": "tree", "ops": [op]})
        frame = await ws.receive_json(timeout=5)
        assert frame["type"] == "ack", frame
        acks += 1
    await ws.close()
    assert acks == 3
    after = await scrape(client)
    assert after["cv_ops_committed_total"] - before["cv_ops_committed_total"] == 3
    assert after["cv_ops_duplicate_total"] - before["cv_ops_duplicate_total"] == 3
    rejected = after.total("cv_ops_rejected_total") - before.total("cv_ops_rejected_total")
    assert rejected == 2


async def test_a_subscriber_cut_off_as_too_slow_is_counted(
    aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_config(subscriber_queue_limit=20)))
    assert (await scrape(client))["cv_ws_closed_too_slow_total"] == 0
    stalled = await client.ws_connect(SOCKET, headers=auth("ws1"), max_msg_size=0)
    await stalled.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    assert (await stalled.receive_json(timeout=5))["type"] == "synced"
    during = await scrape(client)
    assert during["cv_ws_connections"] == 1
    assert during["cv_subscriptions"] == 1
    # Big ops fill the stalled socket's kernel buffers, then its queue passes the limit (20).
    blob = "x" * 50_000
    for i in range(300):
        op = {"type": "node.insert", "node_id": f"n{i}", "parent_id": "root", "fields": {"b": blob}}
        await post_ops(client, [op])
    async with asyncio.timeout(30):
        while True:
            msg = await stalled.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING):
                break
    assert stalled.close_code == CLOSE_TOO_SLOW
    # Counted when the server cut it off, before the close frame left.
    assert (await scrape(client))["cv_ws_closed_too_slow_total"] == 1


def test_requests_are_counted_by_route_and_status_each_time() -> None:
    metrics = Metrics()
    for route, status in [("/a", 200), ("/a", 200), ("/a", 404), ("/b", 200)]:
        metrics.record_request(route, status, 0.001)

    def value(name: str, labels: dict[str, str]) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("cv_http_requests_total", {"route": "/a", "status": "200"}) == 2
    assert value("cv_http_requests_total", {"route": "/a", "status": "404"}) == 1
    assert value("cv_http_requests_total", {"route": "/b", "status": "200"}) == 1
    assert value("cv_http_request_seconds_count", {"route": "/a"}) == 3
    assert value("cv_http_request_seconds_count", {"route": "/b"}) == 1
