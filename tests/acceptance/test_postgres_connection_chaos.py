"""Acceptance: the PostgreSQL backend when its database connections die under load.

Two server instances on one schema, in this process, on real loopback HTTP and websockets:

- SDK writers (HTTP and websocket) hammer one instance while every connection of that instance
  (its pool and its LISTEN connection) is killed with `pg_terminate_backend`, a bounded number of
  times: nothing acknowledged is lost, every op is applied once, clocks stay gap-free, every
  subscriber on every instance sees 1..n once in order, and no request is answered 4xx for it.
- Queue workers claim and complete under the same chaos: no job completed twice, none lost.
- A COMMIT whose answer is lost (outcome unknown to the server) is answered with a retryable
  error, and the retry under the same op_id is answered from the dedupe record, exactly once.
- While the database is unreachable the routes answer a retryable 5xx and `/readyz` says 503,
  so a load balancer stops sending traffic until the database is back.

Chaos is paced by progress (kill again once more work was acknowledged), never by sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.cli import _with_schema
from cv_server.keys import STORES, TOKEN_SECRET
from cv_server.pg import PostgresOpLogStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.stores import listen_application_name
from cv_workspace_client import ClientConfig, Commit, StillPendingError, WorkspaceClient
from tests.pg.helpers import fresh_schema

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

WS = "chaos"
SUB_DOC = "counter"
WRITERS = 8
OPS_PER_WRITER = 40
TOTAL_OPS = WRITERS * OPS_PER_WRITER
#: How many times every connection of the victim instance is killed.
KILL_ROUNDS = 6
#: Bound on every wait of these tests.
DEADLINE_S = 90.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- instances -----------------------------------------------------------------------------------


@dataclass
class Instance:
    """One in-process server on loopback, with every HTTP status it answered."""

    server: TestServer
    statuses: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def app(self) -> web.Application:
        return self.server.app

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def token(self) -> str:
        return mint_token(self.app[TOKEN_SECRET].value, [WS], now=time.time())

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client_errors(self) -> list[tuple[str, str, int]]:
        return [entry for entry in self.statuses if 400 <= entry[2] < 500]

    def pool_pids(self) -> list[int]:
        oplog = self.app[STORES].oplog
        assert isinstance(oplog, PostgresOpLogStore)
        # asyncpg keeps no public list of a pool's connections; the holders are it.
        return [
            int(holder._con.get_server_pid())
            for holder in oplog.pool._holders
            if holder._con is not None and not holder._con.is_closed()
        ]

    def listen_name(self) -> str:
        queue = self.app[STORES].queue
        assert isinstance(queue, PostgresQueueStore)
        return listen_application_name(queue)


async def start_instance(config: ServerConfig) -> Instance:
    app = create_app(config)
    instance = Instance(TestServer(app, host="127.0.0.1"))

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        instance.statuses.append((request.method, request.path, response.status))
        return response

    app.middlewares.insert(0, record)  # outermost: sees the answer problems_middleware made
    await instance.server.start_server()
    return instance


async def terminate_instance_connections(admin: asyncpg.Connection, victim: Instance) -> int:
    """Kill every connection of `victim`: its pool's and its LISTEN connection (only those:
    the server is shared)."""
    killed = await admin.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database()"
        " AND (application_name = $2 OR (application_name = 'cv-server' AND pid = ANY($1)))",
        victim.pool_pids(),
        victim.listen_name(),
    )
    return int(killed)


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


@pytest.fixture
async def admin(postgres_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(postgres_url, server_settings={"application_name": "cv-chaos"})
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reached the event loop's exception handler (an unretrieved task exception, a
    callback that raised): a server that crashes a task shows up here."""
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield errors
    loop.set_exception_handler(previous)


@contextlib.asynccontextmanager
async def two_instances(
    postgres_url: str, schema: str, **overrides: Any
) -> AsyncIterator[tuple[Instance, Instance]]:
    config = ServerConfig(database_url=_with_schema(postgres_url, schema), **overrides)
    first = await start_instance(config)
    try:
        second = await start_instance(config)
        try:
            yield first, second
        finally:
            await second.server.close()
    finally:
        await first.server.close()


# -- subscribers ---------------------------------------------------------------------------------


@dataclass
class Watcher:
    """A raw websocket subscriber (no SDK: its dedupe would hide a server's duplicate). It
    resubscribes from the last clock it holds whenever the server closes its socket."""

    instance: Instance
    clocks: list[int] = field(default_factory=list)
    reconnects: int = 0
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, session: aiohttp.ClientSession, until: int) -> None:
        url = f"{self.instance.url}/v1/workspaces/{WS}/socket"
        while not self.clocks or self.clocks[-1] < until:
            since = self.clocks[-1] if self.clocks else 0
            async with session.ws_connect(url, headers=self.instance.headers) as ws:
                await ws.send_json({"type": "subscribe", "sub_doc": SUB_DOC, "since": since})
                async for msg in ws:
                    if msg.type != WSMsgType.TEXT:
                        break
                    frame = msg.json()
                    if frame["type"] == "synced":
                        self.synced.set()
                    elif frame["type"] == "op":
                        self.clocks.append(frame["clock"])
                        if frame["clock"] >= until:
                            return
            self.reconnects += 1


# -- writers -------------------------------------------------------------------------------------


@dataclass
class Writer:
    """One SDK client writing increments one after another; every op_id it minted is kept."""

    client: WorkspaceClient
    minted: list[str]
    commits: list[Commit] = field(default_factory=list)
    still_pending: int = 0

    async def run(self, count: int, progress: asyncio.Condition) -> None:
        for _ in range(count):
            op = {"type": "node.increment", "node_id": "root", "field": "n", "by": 1}
            try:
                commit = await self.client.apply_op(WS, SUB_DOC, op)
            except StillPendingError:  # not lost: replayed by `wait_synced` at the end
                self.still_pending += 1
                continue
            self.commits.append(commit)
            async with progress:
                progress.notify_all()


def make_writer(url: str, token: str, *, over_websocket: bool) -> Writer:
    minted: list[str] = []

    def mint() -> str:
        op_id = new_op_id()
        minted.append(op_id)
        return op_id

    config = ClientConfig(
        retry_base_seconds=0.01,
        retry_cap_seconds=0.2,
        request_timeout_seconds=30,
        ops_over_websocket=over_websocket,
    )
    return Writer(WorkspaceClient(url, token=token, config=config, new_op_id=mint), minted)


async def read_whole_log(session: aiohttp.ClientSession, instance: Instance) -> list[Any]:
    entries: list[Any] = []
    while True:
        async with session.get(
            f"{instance.url}/v1/workspaces/{WS}/docs/{SUB_DOC}/ops",
            params={"since": str(len(entries))},
            headers=instance.headers,
        ) as resp:
            assert resp.status == 200, await resp.text()
            page = await resp.json()
        entries += page["ops"]
        if len(entries) >= page["clock"]:
            return entries


class DatabaseProxy:
    """A TCP relay to PostgreSQL that the test can cut: `cut()` drops every relayed connection
    and refuses new ones (the database is unreachable for whoever connects through it)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.reachable = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self.reachable = False
        for writer in list(self._writers):
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.reachable:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}


# -- tests ---------------------------------------------------------------------------------------


async def test_writers_and_subscribers_survive_the_repeated_death_of_one_instances_connections(
    postgres_url: str, schema: str, admin: asyncpg.Connection, loop_errors: list[Any]
) -> None:
    async with (
        two_instances(postgres_url, schema, sweep_seconds=600) as (victim, other),
        aiohttp.ClientSession() as session,
    ):
        watchers = [Watcher(victim), Watcher(victim), Watcher(other), Watcher(other)]
        watching = [asyncio.create_task(w.run(session, TOTAL_OPS)) for w in watchers]
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*(w.synced.wait() for w in watchers))
        writers = [
            make_writer(victim.url, victim.token, over_websocket=i % 2 == 0) for i in range(8)
        ]
        progress = asyncio.Condition()
        kills: list[int] = []

        def acknowledged() -> int:
            return sum(len(w.commits) + w.still_pending for w in writers)

        async def chaos(writing: asyncio.Future[Any]) -> None:
            for round_ in range(KILL_ROUNDS):
                target = (round_ + 1) * TOTAL_OPS // (KILL_ROUNDS + 2)

                def reached(t: int = target) -> bool:
                    return acknowledged() >= t or writing.done()

                async with progress:
                    await progress.wait_for(reached)
                if writing.done():
                    return
                kills.append(await terminate_instance_connections(admin, victim))

        try:
            async with asyncio.timeout(DEADLINE_S):
                for writer in writers:
                    await writer.client.start()
                writing = asyncio.gather(*(w.run(OPS_PER_WRITER, progress) for w in writers))
                killer = asyncio.create_task(chaos(writing))
                await writing
                await killer
                for writer in writers:  # what gave up during the chaos is replayed now
                    writer.client.retry_pending()
                    await writer.client.wait_synced()
                    assert writer.client.pending_count() == 0
                await asyncio.gather(*watching)
            log = await read_whole_log(session, other)
            async with session.get(
                f"{other.url}/v1/workspaces/{WS}/docs/{SUB_DOC}", headers=other.headers
            ) as resp:
                doc = await resp.json()
        finally:
            for task in watching:
                task.cancel()
            for writer in writers:
                await writer.client.close()

        assert len(kills) == KILL_ROUNDS
        assert all(killed >= 1 for killed in kills), kills
        # Every op minted was applied exactly once: the counter, the log, and its op_ids agree.
        minted = [op_id for writer in writers for op_id in writer.minted]
        assert len(minted) == TOTAL_OPS
        assert doc["clock"] == TOTAL_OPS
        assert doc["state"]["nodes"]["root"]["fields"]["n"] == TOTAL_OPS
        assert [entry["clock"] for entry in log] == list(range(1, TOTAL_OPS + 1))
        assert sorted(entry["op_id"] for entry in log) == sorted(minted)
        # Each acknowledgement names the clock its op holds in the log (a duplicate answer too).
        by_clock = {entry["clock"]: entry["op_id"] for entry in log}
        for writer in writers:
            for commit in writer.commits:
                assert by_clock[commit.clock] == commit.op_id
        # Every subscriber, on either instance, saw 1..n once, in order (across its resumes).
        for watcher in watchers:
            assert watcher.clocks == list(range(1, TOTAL_OPS + 1)), watcher.reconnects
        # A dead connection is the server's trouble, never answered as the client's mistake.
        assert victim.client_errors() == []
        assert other.client_errors() == []
        for instance in (victim, other):
            async with session.get(f"{instance.url}/readyz") as resp:
                assert resp.status == 200
        assert loop_errors == []


async def test_while_the_database_is_unreachable_routes_answer_5xx_and_readyz_says_503(
    postgres_url: str, schema: str, loop_errors: list[Any]
) -> None:
    proxy = DatabaseProxy(("127.0.0.1", 5432))
    await proxy.start()
    relayed = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert relayed != postgres_url
    instance = await start_instance(
        ServerConfig(database_url=_with_schema(relayed, schema), sweep_seconds=600)
    )
    ops_url = f"{instance.url}/v1/workspaces/{WS}/docs/{SUB_DOC}/ops"
    op = {"type": "node.increment", "node_id": "root", "field": "n", "by": 1}
    try:
        async with aiohttp.ClientSession(headers=instance.headers) as session:
            async with session.get(f"{instance.url}/readyz") as resp:
                assert resp.status == 200
            proxy.cut()
            op_id = new_op_id()
            async with session.post(ops_url, json={"ops": [{**op, "op_id": op_id}]}) as resp:
                assert resp.status >= 500, await resp.text()
                assert (await resp.json())["code"] in ("internal", "unavailable")
            async with session.get(f"{instance.url}/v1/workspaces/{WS}/docs/{SUB_DOC}") as resp:
                assert resp.status >= 500
            async with session.post(
                f"{instance.url}/v1/workspaces/{WS}/requests", json={"stage": "s", "job_id": "j"}
            ) as resp:
                assert resp.status >= 500
            async with session.post(
                f"{instance.url}/v1/queue/claim", json={"worker_classes": ["s"]}
            ) as resp:
                assert resp.status >= 500
            async with session.ws_connect(f"{instance.url}/v1/workspaces/{WS}/socket") as ws:
                await ws.send_json({"type": "apply", "sub_doc": SUB_DOC, "req": 1, "ops": [op]})
                frame = await asyncio.wait_for(ws.receive_json(), DEADLINE_S)
                assert frame["type"] == "error", frame
                assert frame["code"] == "internal", frame
            # A load balancer must stop sending this instance traffic it cannot serve.
            async with session.get(f"{instance.url}/readyz") as resp:
                assert resp.status == 503
                assert (await resp.json())["code"] == "unavailable"
            async with session.get(f"{instance.url}/healthz") as resp:
                assert resp.status == 200  # alive: restarting it would not bring the database
            proxy.reachable = True
            async with asyncio.timeout(DEADLINE_S):
                async with session.get(f"{instance.url}/readyz") as resp:
                    assert resp.status == 200
                async with session.post(ops_url, json={"ops": [{**op, "op_id": op_id}]}) as resp:
                    assert resp.status == 200
                    [result] = (await resp.json())["results"]
                    assert result["clock"] == 1
                    assert not result["duplicate"]
        assert instance.client_errors() == []
        assert loop_errors == []
    finally:
        await instance.server.close()
        await proxy.close()


JOBS = 60
CLAIMERS = 6


async def test_queue_claims_and_completions_survive_the_repeated_death_of_one_instances_connections(
    postgres_url: str, schema: str, admin: asyncpg.Connection, loop_errors: list[Any]
) -> None:
    # A short lease: a claim whose answer died with its connection comes back soon.
    async with (
        two_instances(
            postgres_url, schema, sweep_seconds=600, lease_seconds=1.0, max_dequeues=1000
        ) as (victim, other),
        aiohttp.ClientSession() as session,
    ):
        for job in range(JOBS):
            async with session.post(
                f"{other.url}/v1/workspaces/{WS}/requests",
                json={"stage": "evaluate", "job_id": f"j{job}"},
                headers=other.headers,
            ) as resp:
                assert resp.status == 202, await resp.text()
        #: (request_id, claim_token) of every complete answered 200.
        completed: list[tuple[str, str]] = []
        refused: list[Any] = []
        progress = asyncio.Condition()

        def done_ids() -> set[str]:
            return {request_id for request_id, _ in completed}

        async def call(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            """POST to the victim, resent as is while it answers 5xx (the worker's retry)."""
            while True:
                async with session.post(
                    f"{victim.url}{path}", json=body, headers=victim.headers
                ) as resp:
                    if resp.status < 500:
                        return resp.status, await resp.json() if resp.status != 204 else None

        async def worker(name: str) -> None:
            while len(done_ids()) < JOBS:
                status, body = await call("/v1/queue/claim", {"worker_classes": ["evaluate"]})
                if status == 204:
                    async with progress:  # idle: wait for news instead of spinning
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.2):
                                await progress.wait()
                    continue
                assert status == 200, body
                row = body["request"]
                path = f"/v1/workspaces/{WS}/requests/{row['request_id']}/complete"
                answer = {"claim_token": row["claim_token"], "result": {"by": name}}
                status, body = await call(path, answer)
                if status == 200:
                    completed.append((row["request_id"], row["claim_token"]))
                    async with progress:
                        progress.notify_all()
                else:
                    refused.append(body)

        async def chaos() -> None:
            for round_ in range(KILL_ROUNDS):
                target = (round_ + 1) * JOBS // (KILL_ROUNDS + 2)

                def reached(t: int = target) -> bool:
                    return len(done_ids()) >= t

                async with progress:
                    await progress.wait_for(reached)
                await terminate_instance_connections(admin, victim)

        async with asyncio.timeout(DEADLINE_S):
            killer = asyncio.create_task(chaos())
            await asyncio.gather(*(worker(f"w{i}") for i in range(CLAIMERS)))
            await killer

        queue = other.app[STORES].queue
        rows = await queue.list(workspace_id=WS, limit=1000)
        assert len(rows) == JOBS
        assert all(row.status == "done" for row in rows), [r.status for r in rows]
        # None completed twice: each request's 200s all carry one token, the one on its row
        # (a retried complete whose first answer died is answered from the row, unchanged).
        tokens: dict[str, set[str]] = {}
        for request_id, token in completed:
            tokens.setdefault(request_id, set()).add(token)
        assert {row.request_id: {row.claim_token} for row in rows} == tokens
        # Only a lost lease may refuse a complete (its claim's answer died with a connection).
        assert all(body["code"] == "lease_lost" for body in refused), refused
        assert [e for e in victim.client_errors() if e[2] != 409] == []
        assert other.client_errors() == []
        assert loop_errors == []
