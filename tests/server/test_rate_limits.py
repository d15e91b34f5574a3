"""Rate limits per token and route class (`cv_server.ratelimit`, docs/reliability.md): the pure
token bucket with an injected clock, the settings, and the server answering 429 `rate_limited`
with `Retry-After` over HTTP and on the websocket, without applying what it refused."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.cli import parse_overrides
from cv_server.http.ratelimit import ROUTE_CLASS_OF
from cv_server.keys import RATE_LIMITS
from cv_server.ratelimit import (
    ROUTE_CLASSES,
    Rate,
    RateLimits,
    TokenBuckets,
    rates_of,
    retry_after_header,
)
from tests.server.conftest import ClientFactory, auth, token_for

WS = "ws1"


def _op(i: int) -> dict[str, Any]:
    return {
        "type": "node.insert",
        "node_id": f"n{i}",
        "parent_id": "root",
        "op_id": f"rl-op-{i:04d}",
    }


# -- the pure bucket -------------------------------------------------------------------------------


def test_a_bucket_spends_its_burst_then_refuses_with_the_exact_wait() -> None:
    buckets = TokenBuckets(Rate(per_second=2.0, burst=3.0))
    assert [buckets.take("t", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("t", now=10.0) == pytest.approx(0.5)  # one token takes 1/2 s
    assert buckets.take("t", now=10.25) == pytest.approx(0.25)  # a refusal takes nothing
    assert buckets.take("t", now=10.5) == 0.0
    assert buckets.take("t", now=10.5) == pytest.approx(0.5)


def test_a_bucket_refills_to_its_burst_and_no_further() -> None:
    buckets = TokenBuckets(Rate(per_second=1.0, burst=2.0))
    buckets.take("t", now=0.0)
    buckets.take("t", now=0.0)
    # An hour idle saves up two tokens, not 3600.
    assert [buckets.take("t", now=3600.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]


def test_keys_have_their_own_buckets() -> None:
    buckets = TokenBuckets(Rate(per_second=1.0, burst=1.0))
    assert buckets.take("a", now=0.0) == 0.0
    assert buckets.take("a", now=0.0) > 0
    assert buckets.take("b", now=0.0) == 0.0


def test_full_buckets_are_dropped_past_max_keys_and_no_other() -> None:
    buckets = TokenBuckets(Rate(per_second=1.0, burst=2.0), max_keys=10)
    for key in range(10):
        buckets.take(key, now=0.0)
    buckets.take("busy", now=0.5)
    buckets.take("busy", now=0.5)
    assert len(buckets) == 11  # none was full at 0.5 s: none dropped, though past max_keys
    buckets.take("x", now=1.0)  # keys 0-9 are full again at 1.0 s: dropped (a full bucket
    assert len(buckets) == 2  # is what a missing key gets); "busy" (0.5 tokens) is kept
    assert buckets.take("busy", now=1.0) == pytest.approx(0.5)
    assert buckets.take(3, now=1.0) == 0.0


def test_a_rate_must_be_positive_and_a_burst_at_least_one() -> None:
    for per_second, burst in [(0.0, 1.0), (float("inf"), 1.0), (1.0, 0.5), (1.0, float("nan"))]:
        with pytest.raises(ValueError, match="must be a finite number"):
            Rate(per_second, burst)


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert [retry_after_header(s) for s in (0.001, 0.5, 1.0, 1.01, 7.9)] == [
        "1",
        "1",
        "1",
        "2",
        "8",
    ]


# -- settings --------------------------------------------------------------------------------------


def test_limits_are_off_by_default() -> None:
    assert all(rate is None for rate in rates_of(ServerConfig()).values())


def test_each_class_is_settable_with_set_and_off_switches_it_back() -> None:
    overrides = parse_overrides(
        [f"rate_limit_{cls}_per_second=5" for cls in ROUTE_CLASSES]
        + ["rate_limit_burst_seconds=2", "rate_limit_ops_per_second=off"]
    )
    rates = rates_of(ServerConfig(**overrides))
    assert rates.pop("ops") is None
    assert set(rates.values()) == {Rate(5.0, 10.0)}


def test_a_rate_that_cannot_work_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="rate_limit_reads_per_second must be"):
        ServerConfig(rate_limit_reads_per_second=0.0)


def test_every_route_with_a_token_has_a_class() -> None:
    app = create_app(ServerConfig())
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    unlimited = {r for r in routes if r not in ROUTE_CLASS_OF}
    public = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}
    public |= {("GET", "/openapi.json"), ("GET", "/docs")}  # the API's own description
    public |= {("GET", "/dashboard"), ("GET", "/dashboard/{name}")}  # the page; its calls carry it
    assert unlimited == public
    assert set(ROUTE_CLASS_OF) <= routes  # no stale entry


# -- the server ------------------------------------------------------------------------------------


async def _limited(
    aiohttp_client: ClientFactory, make_config: Any, **rates: float
) -> TestClient[Any, Any]:
    """A server with `rates`, a second's worth saved up, whose buckets never refill: their
    clock stands still, so what a test sends over the budget is refused however slowly the
    machine sends it."""
    config = make_config(rate_limit_burst_seconds=1.0, **rates)
    app = create_app(config)
    app[RATE_LIMITS] = RateLimits(config, clock=lambda: 0.0)
    return await aiohttp_client(app)


async def _ops_log(client: TestClient[Any, Any]) -> list[str]:
    r = await client.get(f"/v1/workspaces/{WS}/docs/d/ops", headers=auth(WS))
    assert r.status == 200
    return [entry["op_id"] for entry in (await r.json())["ops"]]


async def test_a_client_over_its_budget_gets_429_with_retry_after_and_nothing_applied(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_ops_per_second=3.0)
    path = f"/v1/workspaces/{WS}/docs/d/ops"
    headers = auth(WS)
    statuses = []
    for i in range(5):
        r = await client.post(path, json={"ops": [_op(i)]}, headers=headers)
        statuses.append(r.status)
        last = r
    assert statuses[:3] == [200, 200, 200]
    assert statuses[3:] == [429, 429]
    assert last.content_type == "application/problem+json"
    body = await last.json()
    assert body["code"] == "rate_limited"
    assert body["route_class"] == "ops"
    assert body["retry_after"] == pytest.approx(1 / 3, abs=0.001)  # a token in 1/3 s, to the ms
    assert last.headers["Retry-After"] == "1"
    # A refused request had no effect: only the three accepted ops are in the log.
    assert await _ops_log(client) == [f"rl-op-{i:04d}" for i in range(3)]
    # Another token has its own budget; reads are another class, unlimited here.
    other = {"Authorization": f"Bearer {token_for(WS, 'other')}"}
    assert (await client.post(path, json={"ops": [_op(9)]}, headers=other)).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'cv_rate_limited_total{route_class="ops"} 2' in metrics


async def test_an_apply_that_enqueues_pays_the_enqueue_budget_too_and_nothing_applied(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_enqueue_per_second=1.0)
    path = f"/v1/workspaces/{WS}/docs/d/ops"
    work = [{"stage": "evaluate"}]
    first = await client.post(path, json={"ops": [_op(0)], "enqueue": work}, headers=auth(WS))
    assert first.status == 200
    refused = await client.post(path, json={"ops": [_op(1)], "enqueue": work}, headers=auth(WS))
    assert refused.status == 429
    body = await refused.json()
    assert (body["code"], body["route_class"]) == ("rate_limited", "enqueue")
    # An apply that enqueues nothing is not an enqueue.
    plain = await client.post(path, json={"ops": [_op(2)]}, headers=auth(WS))
    assert plain.status == 200
    assert await _ops_log(client) == ["rl-op-0000", "rl-op-0002"]


async def test_a_request_without_a_valid_token_is_answered_401_not_counted(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_reads_per_second=1.0)
    path = f"/v1/workspaces/{WS}/docs/d"
    for _ in range(3):
        r = await client.get(path, headers={"Authorization": "Bearer cvt1.forged.sig"})
        assert r.status == 401
    assert (await client.get(path, headers=auth(WS))).status == 200
    assert "cv_rate_limited_total{" not in await (await client.get("/metrics")).text()


async def test_an_apply_frame_over_budget_gets_a_rate_limited_error_naming_its_req(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_ops_per_second=2.0)
    ws = await client.ws_connect(f"/v1/workspaces/{WS}/socket", headers=auth(WS))
    try:
        for req in range(3):
            await ws.send_json({"type": "apply", "sub_doc": "d", "req": req, "ops": [_op(req)]})
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 10
        while len(answers) < 3 and time.monotonic() < deadline:
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.TEXT
            frame = msg.json()
            answers[frame["req"]] = frame
    finally:
        await ws.close()
    assert [answers[r]["type"] for r in range(3)] == ["ack", "ack", "error"]
    refusal = answers[2]
    assert refusal["code"] == "rate_limited"
    assert refusal["retry_after"] == pytest.approx(0.5)
    assert await _ops_log(client) == ["rl-op-0000", "rl-op-0001"]


async def test_a_socket_handshake_over_budget_is_refused_429(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_socket_per_second=1.0)
    path = f"/v1/workspaces/{WS}/socket"
    first = await client.ws_connect(path, headers=auth(WS))
    await first.close()
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect(path, headers=auth(WS))
    assert refused.value.status == 429
    assert refused.value.headers is not None
    assert refused.value.headers["Retry-After"] == "1"


async def _channel_frames(ws: aiohttp.ClientWebSocketResponse, count: int) -> list[Any]:
    """The next `count` frames of a worker channel (which may batch them in a JSON array)."""
    frames: list[Any] = []
    while len(frames) < count:
        body = (await ws.receive(timeout=10)).json()
        frames.extend(body if isinstance(body, list) else [body])
    return frames


async def test_a_channel_report_over_budget_gets_a_rate_limited_error_and_changes_nothing(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    """A worker channel's frames pay the classes of the HTTP verbs they stand for: a heartbeat
    `queue`, an offer of slots `claim` (a refused offer names its `slots`: none were offered)."""
    client = await _limited(
        aiohttp_client,
        make_config,
        rate_limit_queue_per_second=1.0,
        rate_limit_claim_per_second=1.0,
    )
    r = await client.post(f"/v1/workspaces/{WS}/requests", json={"stage": "s"}, headers=auth(WS))
    rid = (await r.json())["request_id"]
    ws = await client.ws_connect("/v1/queue/channel", headers=auth(WS))
    try:
        await ws.send_json({"type": "hello", "worker_classes": ["s"], "slots": 1})
        frames = await _channel_frames(ws, 2)
        assert [f["type"] for f in frames] == ["welcome", "claimed"]
        token = frames[1]["requests"][0]["claim_token"]
        beat = {"type": "heartbeat", "request_id": rid, "claim_token": token}
        await ws.send_json({**beat, "id": 1})
        await ws.send_json({**beat, "id": 2})
        await ws.send_json({"type": "free", "slots": 1})
        await ws.send_json({"type": "free", "slots": 3})
        answers = await _channel_frames(ws, 3)
    finally:
        await ws.close()
    assert answers[0]["type"] == "answer"
    assert "lease_expires_at" in answers[0]
    refused, offer = answers[1], answers[2]
    assert (refused["code"], refused["id"], refused["route_class"]) == ("rate_limited", 2, "queue")
    assert refused["retry_after"] == pytest.approx(1.0)
    assert (offer["code"], offer["slots"], offer["route_class"]) == ("rate_limited", 3, "claim")


async def test_a_channel_handshake_over_budget_is_refused_429(
    aiohttp_client: ClientFactory, make_config: Any
) -> None:
    client = await _limited(aiohttp_client, make_config, rate_limit_socket_per_second=1.0)
    first = await client.ws_connect("/v1/queue/channel", headers=auth(WS))
    await first.close()
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect("/v1/queue/channel", headers=auth(WS))
    assert refused.value.status == 429
