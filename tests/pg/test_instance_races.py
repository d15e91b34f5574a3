"""Races between server instances on one PostgreSQL schema (real HTTP, websockets and database
connections on loopback, two instances in one process): news of another instance's commit that
lands while a subscriber is still reading the log, the same op_id sent to two instances at the
same moment, conflicting inserts judged on another instance's cache, and subscribers joining
mid-stream while their instance's LISTEN connection is killed.

Where a race needs a precise interleaving, the test pauses the subscriber's log read (after the
database answered, before the hub sees the answer) and waits on the event it is racing against,
never on a sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from cv_server.hub import Subscription
from cv_server.keys import STORES
from cv_server.oplog import LogEntry
from cv_server.pg import PostgresOpLogStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.stores import listen_application_name
from tests.contract.oplog_contract import incoming
from tests.pg.helpers import settings_for
from tests.pg.test_instances import WS, bearer, increment, instances, make_config, subscribe

pytestmark = pytest.mark.postgres

__all__ = ["instances", "make_config"]  # fixtures shared with test_instances

TIMEOUT = 30.0
#: How long a subscriber may take to deliver a clock the log already holds (generous: a
#: correct server does it in milliseconds; the buggy one never does).
DELIVERY_TIMEOUT = 10.0

ReadSince = Callable[[str, str, int, int], Awaitable[tuple[int, list[LogEntry]]]]


class PausedRead:
    """Pauses the first log read of `sub_doc` after the database answered it, until `release`."""

    def __init__(self, client: TestClient[Any, Any], sub_doc: str) -> None:
        self.store = client.app[STORES].oplog
        self.real: ReadSince = self.store.read_since
        self.sub_doc = sub_doc
        self.answered = asyncio.Event()
        self.released = asyncio.Event()

    async def read_since(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[LogEntry]]:
        result = await self.real(workspace_id, sub_doc, since, limit)
        if sub_doc == self.sub_doc and not self.released.is_set():
            self.answered.set()
            await self.released.wait()
        return result


def record_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> asyncio.Event:
    """An event set whenever `Subscription.<name>` is called (the call itself goes through)."""
    called = asyncio.Event()
    real = getattr(Subscription, name)

    def spy(self: Subscription, *args: Any) -> Any:
        called.set()
        return real(self, *args)

    monkeypatch.setattr(Subscription, name, spy)
    return called


async def post(client: TestClient[Any, Any], sub_doc: str, ops: list[dict[str, Any]]) -> Any:
    resp = await client.post(
        f"/v1/workspaces/{WS}/docs/{sub_doc}/ops", json={"ops": ops}, headers=bearer(client)
    )
    assert resp.status == 200, await resp.text()
    return (await resp.json())["results"]


async def clocks_until(ws: ClientWebSocketResponse, clock: int) -> list[int]:
    """The op clocks received until `clock` arrives, or whatever came by `DELIVERY_TIMEOUT`."""
    clocks: list[int] = []
    try:
        async with asyncio.timeout(DELIVERY_TIMEOUT):
            while not clocks or clocks[-1] < clock:
                msg = await ws.receive()
                if msg.type != WSMsgType.TEXT:
                    break
                frames = msg.json()
                for frame in frames if isinstance(frames, list) else [frames]:
                    if frame["type"] == "op":
                        clocks.append(frame["clock"])
    except TimeoutError:
        pass
    return clocks


async def kill_listener(client: TestClient[Any, Any], postgres_url: str) -> None:
    queue = client.app[STORES].queue
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


async def test_a_commit_announced_while_a_subscriber_reads_the_log_still_reaches_it(
    instances: list[TestClient[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = instances
    paused = PausedRead(reader, "tree")
    monkeypatch.setattr(paused.store, "read_since", paused.read_since)
    heard = record_calls(monkeypatch, "on_head")
    ws = await reader.ws_connect(f"/v1/workspaces/{WS}/socket", headers=bearer(reader))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    async with asyncio.timeout(TIMEOUT):
        await paused.answered.wait()  # the read answered "head 0, nothing yet"
    [result] = await post(writer, "tree", [increment()])
    assert result["clock"] == 1
    async with asyncio.timeout(TIMEOUT):
        await heard.wait()  # the reader's instance heard of clock 1 while the read was in flight
    paused.released.set()
    # Nothing else is ever committed: only that notification can bring clock 1 to the reader.
    assert await clocks_until(ws, 1) == [1]
    await ws.close()


async def test_a_listen_reconnect_while_a_subscriber_reads_the_log_still_brings_what_was_missed(
    instances: list[TestClient[Any, Any]],
    monkeypatch: pytest.MonkeyPatch,
    postgres_url: str,
    schema: str,
) -> None:
    _, reader = instances
    paused = PausedRead(reader, "tree")
    monkeypatch.setattr(paused.store, "read_since", paused.read_since)
    told = record_calls(monkeypatch, "catch_up")
    ws = await reader.ws_connect(f"/v1/workspaces/{WS}/socket", headers=bearer(reader))
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
    async with asyncio.timeout(TIMEOUT):
        await paused.answered.wait()
    # Committed after the read's snapshot, announced where nobody listens: a lost notification.
    silent = await PostgresOpLogStore.open(
        postgres_url, settings_for(schema), channel="cv_test_nobody_listens"
    )
    try:
        await silent.append(WS, "tree", [incoming(increment()) for _ in range(3)])
    finally:
        await silent.close()
    await kill_listener(reader, postgres_url)
    async with asyncio.timeout(TIMEOUT):
        await told.wait()  # the reconnect told every subscriber to catch up
    paused.released.set()
    assert await clocks_until(ws, 3) == [1, 2, 3]
    await ws.close()


async def test_one_op_id_sent_to_two_instances_at_once_commits_once_and_both_answer_its_clock(
    instances: list[TestClient[Any, Any]],
) -> None:
    first, second = instances
    rounds = 25
    for _ in range(rounds):
        op = increment()
        [a], [b] = await asyncio.gather(post(first, "race", [op]), post(second, "race", [op]))
        assert a["op_id"] == b["op_id"] == op["op_id"]
        assert a["clock"] == b["clock"]
        assert sorted([a["duplicate"], b["duplicate"]]) == [False, True]
    log = await (
        await first.get(f"/v1/workspaces/{WS}/docs/race/ops?since=0", headers=bearer(first))
    ).json()
    assert [entry["clock"] for entry in log["ops"]] == list(range(1, rounds + 1))
    state = await (
        await second.get(f"/v1/workspaces/{WS}/docs/race", headers=bearer(second))
    ).json()
    assert state["clock"] == rounds
    assert state["state"]["nodes"]["root"]["fields"]["n"] == rounds


async def test_an_insert_is_judged_on_the_log_not_on_a_stale_cache_of_another_instance(
    instances: list[TestClient[Any, Any]],
) -> None:
    first = instances[0]
    # Both instances cache the sub-doc first, so each holds a copy the other will make stale.
    await post(first, "tree", [increment()])
    for client in instances:
        await client.get(f"/v1/workspaces/{WS}/docs/tree", headers=bearer(client))
    nodes = [f"n{i}" for i in range(20)]
    answers = await asyncio.gather(
        *(
            post(client, "tree", [{"type": "node.insert", "node_id": node, "parent_id": "root"}])
            for node in nodes
            for client in instances
        )
    )
    for node, (one, other) in zip(
        nodes, zip(answers[::2], answers[1::2], strict=True), strict=True
    ):
        outcomes = sorted([one[0], other[0]], key=lambda result: "error" in result)
        assert "clock" in outcomes[0], node
        assert outcomes[1]["error"]["code"] == "node_exists", node
    states = [
        await (await client.get(f"/v1/workspaces/{WS}/docs/tree", headers=bearer(client))).json()
        for client in instances
    ]
    assert states[0] == states[1]
    assert states[0]["clock"] == 1 + len(nodes)
    assert set(nodes) <= set(states[0]["state"]["nodes"])


async def test_subscribers_joining_mid_stream_on_another_instance_see_every_clock_once(
    instances: list[TestClient[Any, Any]], postgres_url: str
) -> None:
    writer, reader = instances
    batches, per_batch = 30, 3
    total = batches * per_batch
    early = await subscribe(reader, "stream")
    joined: list[ClientWebSocketResponse] = []

    async def write() -> None:
        for i in range(batches):
            await post(writer, "stream", [increment() for _ in range(per_batch)])
            if i % 5 == 2:  # a subscriber joins while ops keep coming from the other instance
                ws = await reader.ws_connect(f"/v1/workspaces/{WS}/socket", headers=bearer(reader))
                await ws.send_json({"type": "subscribe", "sub_doc": "stream", "since": 0})
                joined.append(ws)
            if i == batches // 2:  # and once, mid-stream, the reader's LISTEN connection dies
                await kill_listener(reader, postgres_url)

    await asyncio.wait_for(write(), TIMEOUT)
    # The writers stopped: each subscriber must reach the head with what it already knows.
    for ws in [early, *joined]:
        assert await clocks_until(ws, total) == list(range(1, total + 1))
        await ws.close()


async def test_concurrent_writers_on_both_instances_get_every_clock_once_and_no_5xx(
    instances: list[TestClient[Any, Any]],
) -> None:
    writers, ops_each = 8, 12

    async def writer(index: int) -> list[int]:
        client = instances[index % 2]
        clocks = []
        for _ in range(ops_each):
            op_id = new_op_id()
            [result] = await post(client, "busy", [increment(op_id)])
            assert result == {"op_id": op_id, "clock": result["clock"], "duplicate": False}
            clocks.append(result["clock"])
        return clocks

    results = await asyncio.wait_for(asyncio.gather(*(writer(i) for i in range(writers))), TIMEOUT)
    every = sorted(clock for clocks in results for clock in clocks)
    assert every == list(range(1, writers * ops_each + 1))
    for clocks in results:
        assert clocks == sorted(clocks)


async def test_appends_to_one_sub_doc_share_one_lane_even_when_the_cache_is_full_of_busy_ones(
    postgres_url: str, schema: str
) -> None:
    store = await PostgresOpLogStore.open(
        postgres_url, settings_for(schema), channel=f"cv_oplog_{schema}", cache_limit=1
    )
    holder = await asyncpg.connect(postgres_url, server_settings={"search_path": schema})
    try:
        await store.append(WS, "busy", [incoming(increment())])
        # Another instance holds the row lock of "busy": this instance's lane for it stays busy
        # (an append in flight) and fills the cache of one.
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute(
            "SELECT clock FROM workspace_sub_doc_heads WHERE sub_doc = 'busy' FOR UPDATE"
        )
        stuck = asyncio.create_task(store.append(WS, "busy", [incoming(increment())]))
        await asyncio.sleep(0)  # let it queue in its lane (no timing: one event-loop turn)
        assert store._lanes[(WS, "busy")].drainer is not None
        groups = store.groups_committed
        first_id, second_id = new_op_id(), new_op_id()
        first, second = await asyncio.wait_for(
            asyncio.gather(
                store.append(WS, "other", [incoming(increment(first_id))]),
                store.append(WS, "other", [incoming(increment(second_id))]),
            ),
            TIMEOUT,
        )
        # One lane per sub-doc is what keeps one instance's appends in call order: a lane that
        # is evicted as it is created leaves each append with a drainer of its own, racing the
        # others to the row lock in separate transactions.
        assert store.groups_committed - groups == 1
        assert [o.to_json() for o in first[0] + second[0]] == [
            {"op_id": first_id, "clock": 1, "duplicate": False},
            {"op_id": second_id, "clock": 2, "duplicate": False},
        ]
        await transaction.rollback()
        await asyncio.wait_for(stuck, TIMEOUT)
    finally:
        await holder.close()
        await store.close()
