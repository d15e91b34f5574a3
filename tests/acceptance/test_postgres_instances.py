"""Acceptance: three real `cv-server` processes on one PostgreSQL database (issue 7).

- Writers on two instances to the same sub-doc get gap-free clocks and no double apply
  (`node.increment` shows one); a subscriber on the third instance sees every op once, in order.
- SIGKILL one instance mid-load: nothing acknowledged is lost, and its writers carry on through
  the others, resending the same op_ids.
- Workers attached to different instances never double-claim.

Each test starts its own three servers (together: their migrations race on purpose) in a fresh
schema, and stops them before the schema is dropped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cv_server.cli import _with_schema
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.pg.helpers import fresh_schema

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

WS = "acc"
SUB_DOC = "counter"
WRITERS = 4
OPS_PER_WRITER = 300
#: SIGKILL the first instance once this many ops are acknowledged (mid-load).
KILL_AFTER = 300
REQUESTS = 240
CLAIMERS = 30
#: Bound on every wait of these tests.
DEADLINE_S = 150.0


@dataclass
class Cluster:
    servers: list[ServerProcess]
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


@pytest.fixture
async def cluster(postgres_url: str, schema: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    url = _with_schema(postgres_url, schema)
    servers = [
        ServerProcess(None, free_port(), tmp_path / f"server{i}.log", database_url=url)
        for i in range(3)
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
        token = await asyncio.to_thread(mint_cli_token, None, WS, database_url=url)
        yield Cluster(servers, token)
    finally:
        for server in servers:
            await asyncio.to_thread(server.stop)


# -- helpers -------------------------------------------------------------------------------------


async def post_ops(session: aiohttp.ClientSession, url: str, ops: list[dict[str, Any]]) -> Any:
    async with session.post(f"{url}/v1/workspaces/{WS}/docs/{SUB_DOC}/ops", json={"ops": ops}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def read_log(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    while True:
        params = {"since": len(entries)}
        async with session.get(f"{url}/v1/workspaces/{WS}/docs/{SUB_DOC}/ops", params=params) as r:
            page = await r.json()
        entries += page["ops"]
        if len(entries) >= page["clock"]:
            return entries


async def subscribe(
    session: aiohttp.ClientSession, url: str
) -> tuple[aiohttp.ClientWebSocketResponse, int]:
    """A websocket subscribed to the sub-doc from clock 0; returns it once synced, with the
    clock it synced at."""
    ws = await session.ws_connect(f"{url}/v1/workspaces/{WS}/socket")
    await ws.send_json({"type": "subscribe", "sub_doc": SUB_DOC, "since": 0})
    while True:
        frame = await ws.receive_json()
        if frame["type"] == "synced":
            return ws, int(frame["clock"])


async def collect_ops(
    ws: aiohttp.ClientWebSocketResponse, first: int, until_clock: int
) -> list[tuple[int, str | None]]:
    """(clock, op_id) of every op frame, in arrival order, until `until_clock` arrived."""
    seen: list[tuple[int, str | None]] = []
    last = first
    while last < until_clock:
        frame = await ws.receive_json()
        if frame["type"] == "op":
            seen.append((frame["clock"], frame["op_id"]))
            last = frame["clock"]
    return seen


class Acks:
    """The acknowledgements writer processes print, followed as they arrive."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._arrived = asyncio.Condition()

    async def follow(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            async with self._arrived:
                self.lines.append(raw.decode().strip())
                self._arrived.notify_all()

    async def wait_for(self, count: int) -> None:
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self.lines) >= count)

    def by_op_id(self) -> dict[str, int]:
        acked: dict[str, int] = {}
        for line in self.lines:
            op_id, clock, _duplicate = line.split()
            assert op_id not in acked, f"{op_id} acknowledged twice"
            acked[op_id] = int(clock)
        return acked


# -- writers, a subscriber, and a SIGKILL ----------------------------------------------------------


async def test_writers_on_two_instances_and_a_subscriber_on_a_third_survive_a_sigkill(
    cluster: Cluster,
) -> None:
    first, second, third = cluster.servers
    total = 1 + WRITERS * OPS_PER_WRITER  # the seed, then every increment exactly once
    async with aiohttp.ClientSession(
        headers=cluster.headers, timeout=aiohttp.ClientTimeout(total=DEADLINE_S)
    ) as session:
        await post_ops(
            session, first.url, [{"type": "node.insert", "node_id": "n", "parent_id": "root"}]
        )
        ws, synced_at = await subscribe(session, third.url)
        watcher = asyncio.create_task(collect_ops(ws, synced_at, total))

        acks = Acks()
        # Half the writers start on the first instance, half on the second; each fails over
        # to the next instance of its list when its own stops answering.
        orders = [[first, second, third], [second, third, first]]
        writers = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.acceptance.failover_writer",
                ",".join(server.url for server in orders[i % 2]),
                cluster.token,
                WS,
                SUB_DOC,
                str(OPS_PER_WRITER),
                str(DEADLINE_S),
                stdout=asyncio.subprocess.PIPE,
            )
            for i in range(WRITERS)
        ]
        followers = [
            asyncio.create_task(acks.follow(writer.stdout))
            for writer in writers
            if writer.stdout is not None
        ]
        await asyncio.wait_for(acks.wait_for(KILL_AFTER), DEADLINE_S)
        acked_before_kill = acks.by_op_id()
        await asyncio.to_thread(first.kill)
        codes = await asyncio.wait_for(
            asyncio.gather(*(writer.wait() for writer in writers)), DEADLINE_S
        )
        await asyncio.gather(*followers)
        assert codes == [0] * WRITERS
        acked = acks.by_op_id()
        seen = await asyncio.wait_for(watcher, DEADLINE_S)
        await ws.close()
        log = await read_log(session, second.url)
        async with session.get(f"{third.url}/v1/workspaces/{WS}/docs/{SUB_DOC}") as r:
            doc = await r.json()

    assert set(acked_before_kill) <= set(acked)
    assert len(acked_before_kill) < WRITERS * OPS_PER_WRITER  # the kill came mid-load
    assert len(acked) == WRITERS * OPS_PER_WRITER  # every writer finished, through the others
    # Gap-free clocks, each op once.
    assert [entry["clock"] for entry in log] == list(range(1, total + 1))
    increments = [entry for entry in log if entry["op"]["type"] == "node.increment"]
    by_id = {entry["op_id"]: entry["clock"] for entry in increments}
    assert len(by_id) == len(increments) == WRITERS * OPS_PER_WRITER
    # Nothing acknowledged is lost: every ack is in the log, at the clock it was acked with.
    assert {op_id: by_id.get(op_id) for op_id in acked} == acked
    # No double apply: the non-idempotent increments add up exactly.
    assert doc["clock"] == total
    assert doc["state"]["nodes"]["n"]["fields"]["count"] == WRITERS * OPS_PER_WRITER
    # The subscriber on the third instance saw every op after its sync once, in order.
    assert [clock for clock, _ in seen] == list(range(synced_at + 1, total + 1))
    assert [op_id for _, op_id in seen] == [entry["op_id"] for entry in log[synced_at:]]


# -- workers on different instances ----------------------------------------------------------------


async def test_workers_attached_to_different_instances_never_double_claim(
    cluster: Cluster,
) -> None:
    urls = [server.url for server in cluster.servers]
    claims: list[tuple[str, str]] = []

    async def enqueue(session: aiohttp.ClientSession, i: int) -> str:
        body = {"stage": "evaluate", "job_id": f"job-{i}", "input": {"i": i}}
        async with session.post(f"{urls[i % 3]}/v1/workspaces/{WS}/requests", json=body) as r:
            assert r.status == 202, await r.text()
            return str((await r.json())["request_id"])

    async def claimer(session: aiohttp.ClientSession, k: int) -> None:
        """Claims through instance k % 3 (one at a time or in batches of 4) until nothing is
        left, completing each batch through the next instance."""
        claim_url, complete_url = urls[k % 3], urls[(k + 1) % 3]
        body: dict[str, Any] = {"worker_classes": ["evaluate"], "worker_id": f"w{k}"}
        if k % 2:
            body["limit"] = 4
        while True:
            async with session.post(f"{claim_url}/v1/queue/claim", json=body) as r:
                if r.status == 204:
                    return
                assert r.status == 200, await r.text()
                answer = await r.json()
            rows = answer["requests"] if "requests" in answer else [answer["request"]]
            claims.extend((row["request_id"], row["claim_token"]) for row in rows)
            done = {
                "completions": [
                    {"request_id": row["request_id"], "claim_token": row["claim_token"]}
                    for row in rows
                ]
            }
            async with session.post(f"{complete_url}/v1/queue/complete", json=done) as r:
                assert r.status == 200, await r.text()
                results = (await r.json())["results"]
            assert [result.get("status") for result in results] == ["done"] * len(rows)

    async with aiohttp.ClientSession(
        headers=cluster.headers, timeout=aiohttp.ClientTimeout(total=DEADLINE_S)
    ) as session:
        enqueued = await asyncio.gather(*(enqueue(session, i) for i in range(REQUESTS)))
        started = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(*(claimer(session, k) for k in range(CLAIMERS))), DEADLINE_S
        )
        assert time.monotonic() - started < DEADLINE_S
        params = {"workspace": WS, "limit": "1000"}
        async with session.get(f"{urls[2]}/v1/queue/requests", params=params) as r:
            rows = (await r.json())["requests"]

    claimed_ids = [request_id for request_id, _ in claims]
    assert len(claimed_ids) == len(set(claimed_ids)) == REQUESTS  # each row claimed once
    assert set(claimed_ids) == set(enqueued)
    assert len({token for _, token in claims}) == REQUESTS
    assert len(rows) == REQUESTS
    assert {(row["status"], row["dequeue_count"]) for row in rows} == {("done", 1)}
