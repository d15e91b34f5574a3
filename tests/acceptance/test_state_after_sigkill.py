"""After a real `cv-server` is SIGKILLed mid-load and restarted on the same
SQLite file (or PostgreSQL database, next to a second instance that keeps serving), every
sub-doc's state is still exactly the fold of its committed log.

The load is random op programs on four sub-docs (the same names in two workspaces): applies and
reducer rejections (node_exists, missing parents, cycles, not_a_number...), atomic batches,
every op under an op_id that its writer resends after a lost answer. The server runs with
`snapshot_every=2` and `subdoc_cache_limit=1`, so snapshots and cache rebuilds happen all the
time. Checked at the end, and again after a second SIGKILL of an idle server:

- each log is gap-free from clock 1, replays without a rejection, holds each op_id once;
- `GET .../docs/{sub_doc}` on every instance answers the head and exactly `fold(log)`;
- the stored snapshot is at most the head and equals the fold up to its clock;
- every op answered as committed is in the log at its clock, as sent; every op answered as
  rejected is not; nothing is in the log that no answer reported committed;
- every state read during the load (the kill included) equals the fold of a prefix of the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import REJECTION_CODES, SubDocState, new_op_id
from cv_server.cli import _with_schema
from cv_server.oplog.pipeline import ATOMIC_ABORTED
from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token
from tests.pg.helpers import fresh_schema
from tests.server.test_state_is_fold_of_log import (
    fold,
    pg_snapshot_reader,
    sqlite_snapshot_reader,
)

pytestmark = pytest.mark.acceptance

KEYS: Final = tuple((ws, doc) for ws in ("w1", "w2") for doc in ("a", "b"))
#: Small enough that the test stays well under its time budget, large enough that the kill
#: lands mid-load with group commits, snapshots and evictions in flight.
WRITERS: Final = 6
BATCHES_PER_WRITER: Final = 100
KILL_AFTER: Final = 200
#: What the server is told (`--set`): snapshots and cache rebuilds on almost every append.
TUNING: Final = ("snapshot_every=2", "subdoc_cache_limit=1")
DEADLINE_S: Final = 60.0
NODES: Final = tuple(f"n{i}" for i in range(8))
#: Mostly inserts, so the trees fill up and moves, deletes and increments find their nodes.
KINDS: Final = ("insert", "move", "delete", "update", "increment")
WEIGHTS: Final = (5, 3, 1, 1, 3)

Key = tuple[str, str]
Raw = dict[str, Any]


def random_batch(rng: random.Random) -> tuple[list[Raw], bool]:
    """1-4 ops over a small pool of node ids: many apply, many are rejected."""
    ops: list[Raw] = []
    for _ in range(rng.randint(1, 4)):
        node = rng.choice(NODES)
        parent = "root" if rng.random() < 0.4 else rng.choice(NODES)
        kind = rng.choices(KINDS, WEIGHTS)[0]
        op: Raw
        if kind == "insert":
            op = {"type": "node.insert", "node_id": node, "parent_id": parent}
            op["fields"] = {"count": rng.randint(0, 3)}
        elif kind == "move":
            op = {"type": "node.move", "node_id": node, "parent_id": parent}
            op["index"] = rng.randint(0, 2)
        elif kind == "delete":
            op = {"type": "node.delete", "node_id": node}
        elif kind == "update":
            value = rng.choice((rng.randint(-5, 5), "text", True, 1.5))
            op = {"type": "node.update", "node_id": node, "set": {"count": value}}
        else:
            op = {"type": "node.increment", "node_id": node, "field": "count"}
            op["by"] = rng.randint(-3, 3)
        op["op_id"] = new_op_id()  # minted once, before the first send
        ops.append(op)
    return ops, rng.random() < 0.3


@dataclass
class Load:
    servers: list[ServerProcess]
    #: (key, op as sent, its final answer).
    answers: list[tuple[Key, Raw, Raw]] = field(default_factory=list)
    #: (key, clock, state text) read while the load ran.
    reads: list[tuple[Key, int, str]] = field(default_factory=list)
    acked: int = 0
    done: bool = False

    async def post(self, session: aiohttp.ClientSession, key: Key, body: Raw, turn: int) -> Raw:
        """Send `body` until some instance answers it (the same op_ids every time)."""
        deadline = time.monotonic() + DEADLINE_S
        ws, doc = key
        while True:
            assert time.monotonic() < deadline, "a batch was never answered"
            server = self.servers[turn % len(self.servers)]
            try:
                async with session.post(
                    f"{server.url}/v1/workspaces/{ws}/docs/{doc}/ops", json=body
                ) as resp:
                    if resp.status < 500:
                        assert resp.status == 200, await resp.text()
                        answer: Raw = await resp.json()
                        return answer
            except (TimeoutError, aiohttp.ClientError):
                pass
            turn += 1
            await asyncio.sleep(0.05)  # the server is restarting: back off, resend

    async def writer(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        for turn in range(BATCHES_PER_WRITER):
            key = rng.choice(KEYS)
            ops, atomic = random_batch(rng)
            answer = await self.post(session, key, {"ops": ops, "atomic": atomic}, seed + turn)
            for op, result in zip(ops, answer["results"], strict=True):
                self.answers.append((key, op, result))
            self.acked += 1

    async def reader(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while not self.done:
            (ws, doc), server = rng.choice(KEYS), rng.choice(self.servers)
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with session.get(f"{server.url}/v1/workspaces/{ws}/docs/{doc}") as resp:
                    if resp.status == 200:
                        body = await resp.json()
                        state = SubDocState.from_json(body["state"]).dumps()
                        self.reads.append(((ws, doc), body["clock"], state))
            await asyncio.sleep(0.01)

    async def kill_mid_load(self, victim: ServerProcess) -> None:
        while self.acked < KILL_AFTER:
            assert not self.done, "the load ended before the kill"
            await asyncio.sleep(0.01)
        await asyncio.to_thread(victim.kill)
        await asyncio.to_thread(victim.start)


async def read_log(session: aiohttp.ClientSession, url: str, key: Key) -> tuple[int, list[Raw]]:
    ws, doc = key
    entries: list[Raw] = []
    while True:
        async with session.get(
            f"{url}/v1/workspaces/{ws}/docs/{doc}/ops", params={"since": len(entries)}
        ) as resp:
            assert resp.status == 200, await resp.text()
            page = await resp.json()
        entries += page["ops"]
        if not page["ops"] or len(entries) >= page["clock"]:
            return page["clock"], entries


Snapshot = Callable[[Key], Awaitable[tuple[int, str] | None]]


async def check(load: Load, session: aiohttp.ClientSession, snapshot: Snapshot) -> None:
    """The invariants of the module docstring, on every sub-doc and instance."""
    folds: dict[Key, list[str]] = {}
    for key in KEYS:
        head, log = await read_log(session, load.servers[0].url, key)
        assert [entry["clock"] for entry in log] == list(range(1, head + 1)), key
        prefixes = folds[key] = fold(log)
        for server in load.servers:
            ws, doc = key
            async with session.get(f"{server.url}/v1/workspaces/{ws}/docs/{doc}") as resp:
                body = await resp.json()
            assert body["clock"] == head, (key, body["clock"], head)
            assert SubDocState.from_json(body["state"]).dumps() == prefixes[head], key
        stored = await snapshot(key)
        if stored is not None:
            clock, text = stored
            assert clock <= head, f"{key}: snapshot at {clock} is ahead of the head {head}"
            assert SubDocState.loads(text).dumps() == prefixes[clock], f"{key}: snapshot {clock}"
        by_op_id = {entry["op_id"]: entry for entry in log}
        assert len(by_op_id) == len(log), f"{key}: an op_id committed twice, or without op_id"
        answered = [(op, result) for k, op, result in load.answers if k == key]
        committed = {op["op_id"] for op, result in answered if "clock" in result}
        assert set(by_op_id) == committed, f"{key}: the log and the answers disagree"
        for op, result in answered:
            entry = by_op_id.get(op["op_id"])
            if "clock" in result:
                assert entry is not None, (key, op, result)
                assert entry["clock"] == result["clock"], (key, op, result)
                assert entry["op"] == op, (key, op, entry)
            else:
                assert result["error"]["code"] in REJECTION_CODES | {ATOMIC_ABORTED}, result
                assert entry is None, (key, op, result)
    for key, clock, text in load.reads:
        assert clock < len(folds[key]), (key, clock)
        assert text == folds[key][clock], (key, clock)


@contextlib.asynccontextmanager
async def session_for(token: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {token}"}, timeout=aiohttp.ClientTimeout(total=10)
    ) as session:
        yield session


async def check_against_snapshot(
    servers: list[ServerProcess], token: str, snapshot: Snapshot
) -> None:
    load = Load(servers)
    try:
        idle = [server for server in servers if server.proc is None]
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in idle))
        async with session_for(token) as session:
            readers = [asyncio.create_task(load.reader(session, 1000 + i)) for i in range(2)]
            killer = asyncio.create_task(load.kill_mid_load(servers[0]))
            try:
                async with asyncio.timeout(DEADLINE_S):
                    await asyncio.gather(*(load.writer(session, i) for i in range(WRITERS)))
                    await killer
            finally:
                load.done = True
                killer.cancel()
                await asyncio.gather(*readers, killer, return_exceptions=True)
            assert load.reads, "no state was read during the load"
            await check(load, session, snapshot)
            # Killed idle, then rebuilt from its snapshots and the log's tail: the same states.
            await asyncio.to_thread(servers[0].kill)
            await asyncio.to_thread(servers[0].start)
            load.reads.clear()
            await check(load, session, snapshot)
    finally:
        for server in servers:
            await asyncio.to_thread(server.stop)


async def test_sqlite_state_equals_the_fold_of_its_log_after_a_sigkill_mid_load(
    tmp_path: Path,
) -> None:
    db = tmp_path / "cv.db"
    token = await asyncio.to_thread(mint_cli_token, db, "*")

    snapshot = sqlite_snapshot_reader(db)
    server = ServerProcess(db, free_port(), tmp_path / "server.log", settings=TUNING)
    await check_against_snapshot([server], token, snapshot)


@pytest.mark.postgres
async def test_postgres_state_equals_the_fold_of_its_log_after_one_instance_is_sigkilled(
    postgres_url: str, tmp_path: Path
) -> None:
    async with fresh_schema(postgres_url) as schema:
        url = _with_schema(postgres_url, schema)
        conn = await asyncpg.connect(postgres_url, server_settings={"search_path": schema})
        try:
            snapshot = pg_snapshot_reader(conn)
            servers = [
                ServerProcess(
                    None,
                    free_port(),
                    tmp_path / f"server{i}.log",
                    database_url=url,
                    settings=TUNING,
                )
                for i in range(2)
            ]
            # The first start migrates the schema; the token needs it.
            await asyncio.to_thread(servers[1].start)
            token = await asyncio.to_thread(mint_cli_token, None, "*", database_url=url)
            await check_against_snapshot(servers, token, snapshot)
        finally:
            await conn.close()
