"""The cross-instance broadcast on PostgreSQL: several instances on one schema, ops
committed on one, subscribers on another that learns of them only through LISTEN/NOTIFY (and
catches up from the log when that feed was interrupted).

Every test checks the promise from the subscriber's side: each op of its own workspace and
sub-doc exactly once, in clock order, with the op_id that was committed at that clock. The
LISTEN connection is killed (or made to stop answering) only when it is found by something the
test owns: the instance's `application_name`, or the port of a relay the test runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp import ClientWebSocketResponse, WSMsgType
from aiohttp.test_utils import TestClient

from cv_mutations import is_valid_sub_doc, is_valid_workspace_id
from cv_server import ServerConfig, create_app
from cv_server.hub import Subscription
from cv_server.keys import STORES
from cv_server.pg import NOTIFY_PAYLOAD_LIMIT, Notifier, PostgresSettings
from cv_server.pg.notifier import check_payload
from cv_server.pg.oplog import OPLOG_CHANNEL, oplog_payload, parse_oplog_payload
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.stores import channel_name, listen_application_name
from tests.pg.test_instances import bearer, dsn_in, increment
from tests.server.conftest import ClientFactory

pytestmark = pytest.mark.postgres

TIMEOUT = 30.0
#: How long a notifier's connection may take over a command before it is replaced as dead. The
#: healthy one answers its checks (every 0.2 s) within it however loaded the machine: one check
#: over it is one more reconnect than a test counts (the notifier's timer is the event loop's,
#: nothing to inject).
NOT_ANSWERING = 2.0

#: The longest ids allowed (docs/concepts.md): `[A-Za-z0-9_-]{1,64}` and `[a-z0-9_.-]{1,64}`.
LONG_WS = "W" * 63 + "-"
LONG_DOC = "d" * 62 + ".-"


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def make_config(postgres_url: str, schema: str) -> Callable[..., ServerConfig]:
    def make(**overrides: Any) -> ServerConfig:
        values: dict[str, Any] = {
            "database_url": dsn_in(postgres_url, schema),
            "sweep_seconds": 600,
        }
        values.update(overrides)
        return ServerConfig(**values)

    return make


@pytest.fixture
async def admin(postgres_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(
        postgres_url, server_settings={"application_name": "cv-broadcast-test"}
    )
    try:
        yield conn
    finally:
        await conn.close()


def listen_name(client: TestClient[Any, Any]) -> str:
    queue = client.app[STORES].queue
    assert isinstance(queue, PostgresQueueStore)
    return listen_application_name(queue)


async def listener_pid(admin: asyncpg.Connection, client: TestClient[Any, Any]) -> int | None:
    """The backend of `client`'s LISTEN connection, found by its instance's application_name."""
    pid = await admin.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND datname ="
        " current_database()",
        listen_name(client),
    )
    return None if pid is None else int(pid)


async def kill_listener(admin: asyncpg.Connection, client: TestClient[Any, Any]) -> int:
    """Terminate `client`'s LISTEN backend (only that one); returns its pid."""
    pid = await listener_pid(admin, client)
    assert pid is not None
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    return pid


async def new_listener(
    admin: asyncpg.Connection, client: TestClient[Any, Any], old_pid: int
) -> int:
    """Wait (bounded, polling the catalog) until `client` LISTENs again on a new backend."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            pid = await listener_pid(admin, client)
            if pid is not None and pid != old_pid:
                return pid
            await asyncio.sleep(0.02)  # polling pg_stat_activity: there is no event to wait on


@dataclass
class Feed:
    """One websocket on one workspace: the ops it received, per sub-doc, as (clock, op_id)."""

    workspace_id: str
    ws: ClientWebSocketResponse
    ops: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)

    async def receive_until(self, heads: dict[str, int], within: float = TIMEOUT) -> None:
        """Read frames until every sub-doc of `heads` reached its head, or `within` passed."""

        def done() -> bool:
            return all(
                (self.ops.get(doc) or [(0, "")])[-1][0] >= head for doc, head in heads.items()
            )

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while not done():
                    msg = await self.ws.receive()
                    if msg.type != WSMsgType.TEXT:
                        return
                    frames = msg.json()
                    for frame in frames if isinstance(frames, list) else [frames]:
                        if frame["type"] == "op":
                            self.ops.setdefault(frame["sub_doc"], []).append(
                                (frame["clock"], frame["op_id"])
                            )
                        elif frame["type"] == "error":
                            self.errors.append(frame)


async def open_feed(client: TestClient[Any, Any], workspace_id: str, sub_docs: list[str]) -> Feed:
    ws = await client.ws_connect(
        f"/v1/workspaces/{workspace_id}/socket", headers=bearer(client, workspace_id)
    )
    for sub_doc in sub_docs:
        await ws.send_json({"type": "subscribe", "sub_doc": sub_doc, "since": 0})
    feed = Feed(workspace_id, ws)
    synced: set[str] = set()
    async with asyncio.timeout(TIMEOUT):
        while synced != set(sub_docs):
            frame = await ws.receive_json()
            if frame["type"] == "synced":
                synced.add(frame["sub_doc"])
            elif frame["type"] == "op":
                feed.ops.setdefault(frame["sub_doc"], []).append((frame["clock"], frame["op_id"]))
    return feed


async def post_ops(
    client: TestClient[Any, Any], workspace_id: str, sub_doc: str, ops: list[dict[str, Any]]
) -> list[tuple[int, str]]:
    resp = await client.post(
        f"/v1/workspaces/{workspace_id}/docs/{sub_doc}/ops",
        json={"ops": ops},
        headers=bearer(client, workspace_id),
    )
    assert resp.status == 200, await resp.text()
    return [(r["clock"], r["op_id"]) for r in (await resp.json())["results"]]


class Committed:
    """What the writer was told it committed, per (workspace_id, sub_doc)."""

    def __init__(self) -> None:
        self.by_topic: dict[tuple[str, str], list[tuple[int, str]]] = {}

    def add(self, workspace_id: str, sub_doc: str, results: list[tuple[int, str]]) -> None:
        self.by_topic.setdefault((workspace_id, sub_doc), []).extend(results)

    def heads(self, workspace_id: str) -> dict[str, int]:
        return {
            doc: entries[-1][0]
            for (ws, doc), entries in self.by_topic.items()
            if ws == workspace_id
        }

    def check(self, feed: Feed) -> None:
        for (ws, doc), entries in self.by_topic.items():
            if ws == feed.workspace_id:
                assert feed.ops.get(doc) == entries, (ws, doc)
        assert set(feed.ops) <= {doc for ws, doc in self.by_topic if ws == feed.workspace_id}
        assert feed.errors == []


# -- repeated loss of the LISTEN connection, many workspaces with the same sub-doc names ---------


async def test_subscribers_see_only_their_workspaces_ops_once_in_order_while_the_listener_dies(
    aiohttp_client: ClientFactory,
    make_config: Callable[..., ServerConfig],
    admin: asyncpg.Connection,
) -> None:
    writer = await aiohttp_client(create_app(make_config()))
    # Small catch-up pages: a kill lands mid-catch-up too, between two pages of the log.
    reader = await aiohttp_client(create_app(make_config(catchup_page=2)))
    workspaces = ["ws1", "WS1", LONG_WS]  # ids differ only by case, or are as long as allowed
    sub_docs = ["tree", "jobs", LONG_DOC]
    feeds = [await open_feed(reader, ws, sub_docs) for ws in workspaces]
    committed = Committed()
    rounds, kills = 12, 4
    kill_every = rounds // kills
    pid: int | None = None
    for i in range(rounds):
        # Each round commits to every topic, concurrently, while (some rounds) the reader's
        # LISTEN backend is terminated: the first kill mid-stream, the next ones as soon as the
        # previous reconnect is up again (its catch-up may still be in flight).
        posts = [
            post_ops(writer, ws, doc, [increment() for _ in range(1 + (i + j) % 3)])
            for ws in workspaces
            for j, doc in enumerate(sub_docs)
        ]
        if i % kill_every == 1:
            if pid is not None:
                pid = await new_listener(admin, reader, pid)
            results, pid = await asyncio.gather(
                asyncio.gather(*posts), kill_listener(admin, reader)
            )
        else:
            results = await asyncio.gather(*posts)
        topics = [(ws, doc) for ws in workspaces for doc in sub_docs]
        for (ws, doc), result in zip(topics, results, strict=True):
            committed.add(ws, doc, result)
    for feed in feeds:
        await feed.receive_until(committed.heads(feed.workspace_id))
        committed.check(feed)
        await feed.ws.close()


# -- notifications that repeat, come late, or name what this instance never loaded ---------------


async def test_repeated_stale_and_foreign_notifications_send_no_op_twice_nor_across_workspaces(
    aiohttp_client: ClientFactory,
    make_config: Callable[..., ServerConfig],
    admin: asyncpg.Connection,
    schema: str,
) -> None:
    writer = await aiohttp_client(create_app(make_config()))
    reader = await aiohttp_client(create_app(make_config()))
    channel = channel_name(OPLOG_CHANNEL, schema)
    committed = Committed()
    # Committed before the reader subscribes, and never loaded by the reader's op-log cache.
    committed.add(
        "ws1", "tree", await post_ops(writer, "ws1", "tree", [increment() for _ in range(3)])
    )
    feeds = [await open_feed(reader, ws, ["tree", "jobs"]) for ws in ("ws1", "ws2")]
    for round_ in range(5):
        committed.add(
            "ws1", "tree", await post_ops(writer, "ws1", "tree", [increment(), increment()])
        )
        committed.add("ws2", "jobs", await post_ops(writer, "ws2", "jobs", [increment()]))
        head = committed.heads("ws1")["tree"]
        # The same announcements again, out of order, and for topics nobody here reads or that
        # do not exist: none may deliver anything (the log is the only source of ops), nor wake
        # the other workspace's subscriber with ops of this one.
        for payload in [
            oplog_payload("ws1", "tree", head),
            oplog_payload("ws1", "tree", 1),
            oplog_payload("ws2", "tree", head),
            oplog_payload("ws1", "jobs", head),
            oplog_payload("ws3", "tree", head),
            oplog_payload("ws2", "jobs", round_ + 1),
            "not/a/payload/at/all",
            "",
        ]:
            await admin.execute("SELECT pg_notify($1, $2)", channel, payload)
    for feed in feeds:
        await feed.receive_until(committed.heads(feed.workspace_id))
        committed.check(feed)
    # Nothing more arrives once the heads are reached: no late duplicate is on its way.
    marker = await post_ops(writer, "ws1", "jobs", [increment()])
    committed.add("ws1", "jobs", marker)
    await feeds[0].receive_until(committed.heads("ws1"))
    committed.check(feeds[0])
    for feed in feeds:
        await feed.ws.close()


# -- a LISTEN connection that stops answering (half-open TCP) ------------------------------------


@dataclass
class _Link:
    frozen: bool = False
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


class Relay:
    """A TCP relay to PostgreSQL owned by the test. `freeze(port)` makes one relayed connection
    (named by its upstream port, which is `client_port` in `pg_stat_activity`) go silent both
    ways while every socket stays open: what a NAT or firewall that dropped an idle flow, or a
    database host that vanished in a failover, leaves behind. No FIN, no RST, no error."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 5432
        self._target = parts
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.links: dict[int, _Link] = {}
        #: How many more connections to freeze as they send their first LISTEN.
        self.listens_to_freeze = 0

    async def start(self) -> str:
        """Start relaying; returns the target DSN rewritten to go through the relay."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._target.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        return urlunsplit(
            self._target._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
        )

    def freeze(self, upstream_port: int) -> None:
        self.links[upstream_port].frozen = True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in self.links.values():
            for writer in link.writers:
                writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self._host, self._port)
        link = _Link(writers=[down_w, up_w])
        self.links[up_w.get_extra_info("sockname")[1]] = link
        for reader, writer, upstream in ((down_r, up_w, True), (up_r, down_w, False)):
            task = asyncio.create_task(self._pump(reader, writer, link, upstream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        upstream: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if upstream and self.listens_to_freeze and b"LISTEN " in data:
                    self.listens_to_freeze -= 1
                    link.frozen = True
                if link.frozen:
                    continue  # lost on the way, as on a dead path
                writer.write(data)
                await writer.drain()
            if not link.frozen:
                writer.close()


@pytest.fixture
async def relay(postgres_url: str) -> AsyncIterator[Relay]:
    relay = Relay(postgres_url)
    try:
        yield relay
    finally:
        await relay.close()


async def listener_port(admin: asyncpg.Connection, client: TestClient[Any, Any]) -> int:
    port = await admin.fetchval(
        "SELECT client_port FROM pg_stat_activity WHERE application_name = $1",
        listen_name(client),
    )
    assert port is not None
    return int(port)


async def test_ops_reach_a_subscriber_whose_instances_listen_connection_stopped_answering(
    relay: Relay,  # first: closed after the servers that connect through it
    aiohttp_client: ClientFactory,
    make_config: Callable[..., ServerConfig],
    admin: asyncpg.Connection,
    schema: str,
) -> None:
    writer = await aiohttp_client(create_app(make_config()))
    through_relay = dsn_in(await relay.start(), schema)
    # The listener's liveness check runs every `sweep_seconds`: 1 s here (5 s by default).
    reader = await aiohttp_client(
        create_app(make_config(database_url=through_relay, sweep_seconds=1.0))
    )
    feed = await open_feed(reader, "ws1", ["tree"])
    committed = Committed()
    committed.add("ws1", "tree", await post_ops(writer, "ws1", "tree", [increment()]))
    await feed.receive_until(committed.heads("ws1"))
    committed.check(feed)  # the relay works: the reader hears the writer's commits
    relay.freeze(await listener_port(admin, reader))
    committed.add("ws1", "tree", await post_ops(writer, "ws1", "tree", [increment(), increment()]))
    # Nothing else will ever be committed: the reader must find out by itself that its LISTEN
    # connection is gone, replace it and catch up, never wait connected to nothing.
    await feed.receive_until(committed.heads("ws1"), within=TIMEOUT)
    committed.check(feed)
    await feed.ws.close()


def no_delays() -> Iterator[float]:
    while True:
        yield 0.0


async def test_a_notifier_whose_connection_stops_answering_replaces_it_and_says_so(
    relay: Relay, admin: asyncpg.Connection, postgres_url: str
) -> None:
    through_relay = await relay.start()
    name = f"cv-broadcast-test-{id(relay):x}"
    settings = PostgresSettings(application_name=name, statement_timeout_seconds=NOT_ANSWERING)
    notifier = Notifier(through_relay, settings, delays=no_delays, check_every=0.2)
    channel = f"cv_test_broadcast_{id(relay):x}"
    payloads: list[str] = []
    reconnected = asyncio.Event()
    heard = asyncio.Event()

    def on_payload(payload: str) -> None:
        payloads.append(payload)
        heard.set()

    await notifier.start()
    try:
        await notifier.listen(channel, on_payload, reconnected.set)
        frozen_pid = notifier.backend_pid
        port = await admin.fetchval(
            "SELECT client_port FROM pg_stat_activity WHERE pid = $1 AND application_name = $2",
            frozen_pid,
            name,
        )
        relay.freeze(int(port))
        await admin.execute("SELECT pg_notify($1, 'lost')", channel)
        async with asyncio.timeout(TIMEOUT):
            await reconnected.wait()  # found out by itself, and told its subscriber to catch up
        assert notifier.reconnects == 1
        assert notifier.backend_pid not in (None, frozen_pid)
        await admin.execute("SELECT pg_notify($1, 'after')", channel)
        async with asyncio.timeout(TIMEOUT):
            while "after" not in payloads:
                heard.clear()
                await heard.wait()
        assert payloads == ["after"]
    finally:
        await notifier.close()


async def test_a_reconnect_whose_listen_is_never_answered_is_given_up_and_retried(
    relay: Relay, admin: asyncpg.Connection
) -> None:
    through_relay = await relay.start()
    name = f"cv-broadcast-test-{id(relay):x}"
    settings = PostgresSettings(application_name=name, statement_timeout_seconds=NOT_ANSWERING)
    notifier = Notifier(through_relay, settings, delays=no_delays, check_every=0.2)
    channel = f"cv_test_broadcast_{id(relay):x}"
    reconnected = asyncio.Event()
    await notifier.start()
    try:
        await notifier.listen(channel, lambda payload: None, reconnected.set)
        port = await admin.fetchval(
            "SELECT client_port FROM pg_stat_activity WHERE pid = $1 AND application_name = $2",
            notifier.backend_pid,
            name,
        )
        # The path dies under the listening connection, and under the next one too, right when
        # it sends its LISTEN: a command that is never answered must not hold the notifier.
        relay.listens_to_freeze = 1
        relay.freeze(int(port))
        async with asyncio.timeout(TIMEOUT):
            await reconnected.wait()
        assert relay.listens_to_freeze == 0
        assert notifier.reconnects == 1
        # A channel added now is listened on at once (the lock is not held by a stuck command).
        async with asyncio.timeout(TIMEOUT):
            await notifier.listen(channel + "_late", lambda payload: None)
    finally:
        await notifier.close()


# -- payload size: ids at their maximum, a schema name at PostgreSQL's identifier limit ----------


def test_the_largest_commit_announcement_is_far_under_the_notify_payload_limit() -> None:
    assert is_valid_workspace_id(LONG_WS)
    assert is_valid_sub_doc(LONG_DOC)
    assert len(LONG_WS) == len(LONG_DOC) == 64
    payload = oplog_payload(LONG_WS, LONG_DOC, 2**63 - 1)  # a bigint clock at its maximum
    check_payload(payload)
    assert len(payload.encode()) < NOTIFY_PAYLOAD_LIMIT // 10
    assert parse_oplog_payload(payload) == (LONG_WS, LONG_DOC, 2**63 - 1)


async def test_instances_in_a_schema_named_at_the_identifier_limit_hear_each_other(
    aiohttp_client: ClientFactory, postgres_url: str
) -> None:
    schema = f"cv_test_{secrets.token_hex(6)}".ljust(63, "_")  # PostgreSQL's longest name
    assert len(channel_name(OPLOG_CHANNEL, schema).encode()) <= 63  # hashed: no truncation
    conn = await asyncpg.connect(postgres_url)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        config = ServerConfig(database_url=dsn_in(postgres_url, schema), sweep_seconds=600)
        writer = await aiohttp_client(create_app(config))
        reader = await aiohttp_client(create_app(config))
        feed = await open_feed(reader, LONG_WS, [LONG_DOC])
        committed = Committed()
        for _ in range(3):
            committed.add(
                LONG_WS, LONG_DOC, await post_ops(writer, LONG_WS, LONG_DOC, [increment()])
            )
        await feed.receive_until(committed.heads(LONG_WS))
        committed.check(feed)
        await feed.ws.close()
        await writer.close()
        await reader.close()
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


async def test_closing_a_notifier_whose_connection_stopped_answering_does_not_hang(
    relay: Relay, admin: asyncpg.Connection
) -> None:
    name = f"cv-broadcast-test-{id(relay):x}"
    settings = PostgresSettings(application_name=name, statement_timeout_seconds=0.5)
    notifier = Notifier(await relay.start(), settings, delays=no_delays)
    await notifier.start()
    port = await admin.fetchval(
        "SELECT client_port FROM pg_stat_activity WHERE pid = $1 AND application_name = $2",
        notifier.backend_pid,
        name,
    )
    relay.freeze(int(port))
    # A server shutting down while the database is unreachable must still get to the end.
    async with asyncio.timeout(TIMEOUT):
        await notifier.close()


# -- an announcement of a head the log does not hold ----------------------------------------------


async def test_a_head_announced_beyond_the_log_during_a_read_costs_one_more_read_not_a_loop(
    aiohttp_client: ClientFactory,
    make_config: Callable[..., ServerConfig],
    admin: asyncpg.Connection,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head no read can reach: sent by hand, or heard from a primary whose last commits a
    promoted replica never received. The subscriber reads the log once more and goes live on
    what the log holds, never re-reading in a tight loop until that clock is reached."""
    writer = await aiohttp_client(create_app(make_config()))
    reader = await aiohttp_client(create_app(make_config()))
    committed = Committed()
    committed.add("ws1", "tree", await post_ops(writer, "ws1", "tree", [increment()]))
    store = reader.app[STORES].oplog
    real_read = store.read_since
    heard = asyncio.Event()
    reads = 0
    real_on_head = Subscription.on_head

    def on_head(self: Subscription, head: int) -> None:
        real_on_head(self, head)
        if head == 1000:
            heard.set()

    async def read_since(ws: str, doc: str, since: int, limit: int) -> Any:
        nonlocal reads
        reads += 1
        answer = await real_read(ws, doc, since, limit)
        if reads == 1:  # the announcement lands while this read is in flight
            await admin.execute(
                "SELECT pg_notify($1, $2)",
                channel_name(OPLOG_CHANNEL, schema),
                oplog_payload("ws1", "tree", 1000),
            )
            async with asyncio.timeout(TIMEOUT):
                await heard.wait()
        return answer

    monkeypatch.setattr(Subscription, "on_head", on_head)
    monkeypatch.setattr(store, "read_since", read_since)
    async with asyncio.timeout(10):
        feed = await open_feed(reader, "ws1", ["tree"])
    assert reads == 2
    committed.check(feed)
    # Still live: the next commit arrives as usual.
    committed.add("ws1", "tree", await post_ops(writer, "ws1", "tree", [increment()]))
    await feed.receive_until(committed.heads("ws1"))
    committed.check(feed)
    await feed.ws.close()
