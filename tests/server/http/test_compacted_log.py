"""Readers behind the horizon (docs/protocol.md, "Behind the horizon"; docs/operating.md,
"Storage over time"): after compaction, a subscriber from an old clock gets the state as one
`snapshot` frame and then the ops after it, and the HTTP log read answers 410 `log_compacted`.
On both backends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_mutations import SubDocState, apply_op, parse_op
from cv_server import create_app
from cv_server.compaction import compact_once
from cv_server.keys import CONFIG, STORES
from tests.server.conftest import auth
from tests.server.helpers import get_doc, get_ops, increment, post_ops

SOCKET = "/v1/workspaces/ws1/socket"
TIMEOUT = 30.0


async def compact_now(client: TestClient[Any, Any]) -> int:
    """One compaction pass as if every op were past the retention."""
    app = client.app
    assert app is not None
    config = app[CONFIG]
    later = time.time() + config.oplog_retention_seconds + 60
    report = await compact_once(app[STORES], config, now=lambda: later)
    return report.ops


async def written(client: TestClient[Any, Any], count: int) -> None:
    for _ in range(count):  # one op per request: a snapshot at each multiple of snapshot_every
        await post_ops(client, [increment("root")])


async def frames_until_synced(ws: ClientWebSocketResponse) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(TIMEOUT):
        while not frames or frames[-1]["type"] != "synced":
            message = await ws.receive()
            assert message.type == WSMsgType.TEXT, message
            body = message.json()
            frames.extend(body if isinstance(body, list) else [body])
    return frames


def fold(frames: list[dict[str, Any]]) -> tuple[int, SubDocState]:
    """What a subscriber builds from its frames: the snapshot, then each op after it."""
    clock, state = 0, SubDocState.empty()
    for frame in frames:
        if frame["type"] == "snapshot":
            clock, state = frame["clock"], SubDocState.from_json(frame["state"])
        elif frame["type"] == "op":
            assert frame["clock"] == clock + 1, (clock, frame)
            apply_op(state, parse_op(frame["op"]))
            clock = frame["clock"]
    return clock, state


async def test_a_subscriber_from_clock_zero_after_compaction_gets_the_snapshot_then_the_tail(
    make_server_config: Any, aiohttp_client: Any
) -> None:
    client = await aiohttp_client(create_app(make_server_config(snapshot_every=5)))
    await written(client, 12)  # snapshots at 5 and 10: clocks 1..9 may go
    assert await compact_now(client) == 9
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    frames = await frames_until_synced(ws)
    assert [f["type"] for f in frames] == ["snapshot", "synced"]
    assert frames[0]["sub_doc"] == "tree"
    assert frames[0]["clock"] == frames[1]["clock"] == 12
    await written(client, 3)  # the tail, live
    async with asyncio.timeout(TIMEOUT):
        while frames[-1]["clock"] < 15:
            message = await ws.receive()
            body = message.json()
            frames.extend(body if isinstance(body, list) else [body])
    clock, state = fold(frames)
    doc = await get_doc(client)
    assert (clock, state.to_json()) == (doc["clock"], doc["state"])
    assert state.nodes["root"].fields["count"] == 15
    await ws.close()


async def test_a_subscriber_behind_the_horizon_with_ops_after_the_snapshot_folds_to_the_state(
    make_server_config: Any, aiohttp_client: Any
) -> None:
    client = await aiohttp_client(create_app(make_server_config(snapshot_every=5)))
    await written(client, 12)
    await compact_now(client)
    ws = await client.ws_connect(SOCKET, headers=auth("ws1"))
    # Behind the horizon (10): the state; at horizon - 1: the log, as before compaction.
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 4})
    behind = await frames_until_synced(ws)
    assert behind[0]["type"] == "snapshot"
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 9})
    at_horizon = await frames_until_synced(ws)
    assert [f["clock"] for f in at_horizon] == [10, 11, 12, 12]
    assert all(f["type"] != "snapshot" for f in at_horizon)
    doc = await get_doc(client)
    clock, state = fold(behind)
    assert (clock, state.to_json()) == (doc["clock"], doc["state"])
    await ws.close()


async def test_no_op_goes_from_a_sub_doc_without_a_snapshot(
    server: TestClient[Any, Any],
) -> None:
    await written(server, 12)  # the default snapshot_every is far above: nothing may go
    assert await compact_now(server) == 0
    assert len((await get_ops(server, since=0))["ops"]) == 12


async def test_the_http_log_read_behind_the_horizon_answers_410_with_where_to_read(
    make_server_config: Any, aiohttp_client: Any
) -> None:
    client = await aiohttp_client(create_app(make_server_config(snapshot_every=5)))
    await written(client, 12)
    await compact_now(client)
    resp = await client.get(
        "/v1/workspaces/ws1/docs/tree/ops", params={"since": 0}, headers=auth("ws1")
    )
    assert resp.status == 410
    assert resp.content_type == "application/problem+json"
    problem = await resp.json(content_type=None)
    assert problem["code"] == "log_compacted"
    assert problem["horizon"] == 10
    assert problem["clock"] == 12
    assert problem["state_url"] == "/v1/workspaces/ws1/docs/tree"
    state = await client.get(problem["state_url"], headers=auth("ws1"))
    assert (await state.json())["clock"] == 12
    # From the horizon on, the log answers as always.
    assert [op["clock"] for op in (await get_ops(client, since=9))["ops"]] == [10, 11, 12]


async def test_the_server_compacts_by_itself_and_counts_it_on_metrics(
    make_server_config: Any, aiohttp_client: Any
) -> None:
    # A retention of a millisecond and a pass every 50 ms: the background task's own passes.
    config = make_server_config(
        snapshot_every=5,
        oplog_retention_seconds=0.001,
        minted_at_skew_seconds=0.0005,
        compact_seconds=0.05,
    )
    client = await aiohttp_client(create_app(config))
    await written(client, 12)
    async with asyncio.timeout(TIMEOUT):
        while True:
            resp = await client.get("/v1/workspaces/ws1/docs", headers=auth("ws1"))
            (doc,) = (await resp.json())["docs"]
            if doc["horizon"] == 10:
                break
            await asyncio.sleep(0.05)  # the pass runs on its own cadence: look again after one
    metrics = await (await client.get("/metrics")).text()
    assert 'cv_compaction_deleted_total{kind="ops"} 9.0' in metrics
    assert "cv_compaction_pass_seconds_count" in metrics
    assert "cv_oplog_rows " in metrics
    assert "cv_oplog_oldest_op_age_seconds " in metrics
