"""Edge cases of the SDK through the real server on loopback: cancelled callers, crashes and
closes mid-flight, reconnects, shared and out-of-range subscriptions, a server restart, one bad op
among good ones, and outbox files the SDK must refuse."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from cv_mutations import NodeIncrement, NodeInsert, NodeUpdate
from cv_server import ServerConfig, create_app
from cv_workspace_client import (
    ClientClosedError,
    Commit,
    Committed,
    InvalidRequestError,
    OutboxError,
    Snapshot,
    StillPendingError,
    Subscription,
    WorkspaceClient,
)
from cv_workspace_client.testing import FaultProxy, ProxyStats, restart_client

from .helpers import SECRET, WS, collect, fast_config, server_log, server_state, token_for

TIMEOUT = 30

ServerFactory = Callable[..., Awaitable[TestServer]]


def counter(state: dict[str, Any], node: str = "n", field: str = "c") -> object:
    return state["state"]["nodes"][node]["fields"].get(field)


def op_ids(log: list[dict[str, Any]]) -> list[str]:
    return [entry["op_id"] for entry in log]


def accepted_more_than(count: int) -> Callable[[ProxyStats], bool]:
    return lambda stats: stats.accepted > count


# -- ops ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_a_cancelled_apply_op_is_still_committed_once_and_not_overtaken(
    server_url: str, token: str, tmp_path: Path, websocket: bool
) -> None:
    config = fast_config(ops_over_websocket=websocket)
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(
            proxy.url, token=token, outbox=tmp_path / "outbox", config=config
        ) as client,
    ):
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        # Every answer from now on is held a while: the op is in flight, and still unanswered
        # when the app gives up on it, a few loop steps later however loaded the machine.
        proxy.delay = 2.0
        proxy.drop_all()  # over HTTP the op then needs a new connection: a visible send
        before = proxy.stats.accepted
        first = asyncio.ensure_future(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1))
        )
        if not websocket:
            await asyncio.wait_for(proxy.wait_until(accepted_more_than(before)), TIMEOUT)
        else:
            await asyncio.sleep(0)  # let the caller's task start: it submits, then awaits
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The app gave up waiting, the client did not: the op stays pending until answered.
        assert client.pending_count() == 1
        proxy.delay = 0
        second = await asyncio.wait_for(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=10)),
            TIMEOUT,
        )
        await client.wait_synced(timeout=TIMEOUT)
        assert client.pending_count() == 0
    log = await server_log(server_url, "tree")
    assert [entry["op"].get("by") for entry in log] == [None, 1, 10]  # each once, in order
    assert second.clock == 3
    assert counter(await server_state(server_url, "tree")) == 11


async def test_an_atomic_group_in_flight_at_a_crash_is_replayed_whole_and_applied_once(
    server_url: str, token: str, tmp_path: Path
) -> None:
    config = fast_config(ops_over_websocket=False)
    async with FaultProxy(server_url) as proxy:
        client = WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox", config=config)
        await client.start()
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        proxy.delay = 60  # the group reaches the server; its answer never reaches this client
        proxy.drop_all()  # the idle keep-alive connection: the group goes on a new one
        before = proxy.stats.accepted
        group = asyncio.ensure_future(
            client.apply_ops(
                WS,
                "tree",
                [
                    NodeIncrement(node_id="n", field="c", by=1),
                    NodeInsert(node_id="m", parent_id="n"),
                ],
                atomic=True,
            )
        )
        after = asyncio.ensure_future(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=100))
        )
        await asyncio.wait_for(proxy.wait_until(accepted_more_than(before)), TIMEOUT)
        proxy.delay = 0
        fresh = await restart_client(client)  # crash with the group in flight
        try:
            assert fresh.pending_count() == 3
            await fresh.wait_synced(timeout=TIMEOUT)
        finally:
            await fresh.close()
        for orphan in (group, after):  # the crashed client's callers heard nothing definite
            with pytest.raises(ClientClosedError):
                await orphan
    log = await server_log(server_url, "tree")
    types = [(entry["op"]["type"], entry["op"].get("by")) for entry in log]
    assert types == [
        ("node.insert", None),
        ("node.increment", 1),
        ("node.insert", None),
        ("node.increment", 100),
    ]
    assert len(set(op_ids(log))) == 4
    assert counter(await server_state(server_url, "tree")) == 101


async def test_ops_left_pending_by_close_are_replayed_by_the_next_client_in_order(
    server_url: str, token: str, tmp_path: Path
) -> None:
    config = fast_config(ops_over_websocket=False)
    async with FaultProxy(server_url) as proxy:
        proxy.delay = 60  # nothing is answered before the close
        client = WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox", config=config)
        await client.start()
        before = proxy.stats.accepted
        ops = [NodeInsert(node_id="n", parent_id="root")] + [
            NodeIncrement(node_id="n", field="c", by=i) for i in range(1, 5)
        ]
        pending = [asyncio.ensure_future(client.apply_op(WS, "tree", op)) for op in ops]
        atomic = asyncio.ensure_future(
            client.apply_ops(
                WS, "tree", [NodeIncrement(node_id="n", field="c", by=100)] * 2, atomic=True
            )
        )
        await asyncio.wait_for(proxy.wait_until(accepted_more_than(before)), TIMEOUT)
        await client.close()
        outcomes = await asyncio.gather(*pending, atomic, return_exceptions=True)
        assert all(isinstance(outcome, StillPendingError) for outcome in outcomes)
        left = [o.op_id for o in outcomes[:-1] if isinstance(o, StillPendingError)]
    async with WorkspaceClient(
        server_url, token=token, outbox=tmp_path / "outbox", config=config
    ) as fresh:
        assert fresh.pending_count() == len(ops) + 2
        await fresh.wait_synced(timeout=TIMEOUT)
    log = await server_log(server_url, "tree")
    assert op_ids(log)[: len(ops)] == left
    assert len(log) == len(ops) + 2  # each once, whether the first send got through or not
    assert counter(await server_state(server_url, "tree")) == sum(range(1, 5)) + 200


async def test_ops_given_up_while_the_socket_is_down_are_replayed_when_it_is_back(
    server_url: str, token: str
) -> None:
    config = fast_config(retry_attempts=2)
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(proxy.url, token=token, config=config) as client,
    ):
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        proxy.refuse = True
        proxy.drop_all()
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                    for _ in range(5)
                ),
                return_exceptions=True,
            ),
            TIMEOUT,
        )
        assert all(isinstance(o, StillPendingError) for o in outcomes)
        assert client.pending_count() == 5
        assert not client.synced
        with pytest.raises(TimeoutError):
            await client.wait_synced(timeout=0.05)  # still down: nothing can be synced
        proxy.refuse = False  # the socket's reconnect replays them, no retry_pending()
        await client.wait_synced(timeout=TIMEOUT)
        assert client.synced
    assert counter(await server_state(server_url, "tree")) == 5


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_an_op_too_large_among_good_ones_fails_alone_and_the_rest_commit_in_order(
    aiohttp_server: ServerFactory, tmp_path: Path, token: str, websocket: bool
) -> None:
    limit = 64 * 1024
    server = await aiohttp_server(
        create_app(
            ServerConfig(
                db_path=tmp_path / "server.db",
                token_secret=SECRET,
                max_body_bytes=limit,
                max_ws_frame_bytes=limit,
            )
        )
    )
    server_url = str(server.make_url("")).rstrip("/")
    # The client's byte cap is above the server's limit: the server has to refuse the batch.
    config = fast_config(ops_over_websocket=websocket, max_batch_bytes=4 * limit)
    big = NodeUpdate(node_id="n", set={"blob": "x" * (limit + 1000)})
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        if websocket:
            await client.connect(WS, timeout=TIMEOUT)
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1)),
                client.apply_op(WS, "tree", big),
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=2)),
                return_exceptions=True,
            ),
            TIMEOUT,
        )
        assert client.pending_count() == 0
    assert isinstance(outcomes[0], Commit)
    assert isinstance(outcomes[1], InvalidRequestError)
    assert outcomes[1].code == "body_too_large"
    assert isinstance(outcomes[2], Commit)
    assert outcomes[2].clock == outcomes[0].clock + 1
    log = await server_log(server_url, "tree")
    assert [entry["op"].get("by") for entry in log] == [None, 1, 2]


async def test_a_frame_too_large_for_one_sub_doc_does_not_fail_another_sub_docs_op(
    server_url: str, token: str
) -> None:
    """The server closes the socket (1009) over one frame; another sub-doc's batch in flight on
    the same socket is innocent — and may already be committed, its ack lost with the socket."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.connect(WS, timeout=TIMEOUT)
        await client.apply_op(WS, "big", NodeInsert(node_id="n", parent_id="root"))
        small = client.apply_op(WS, "small", NodeInsert(node_id="n", parent_id="root"))
        huge = client.apply_op(WS, "big", NodeUpdate(node_id="n", set={"x": "y" * 1_100_000}))
        outcomes = await asyncio.wait_for(
            asyncio.gather(small, huge, return_exceptions=True), TIMEOUT
        )
        assert client.pending_count() == 0
    assert isinstance(outcomes[0], Commit), outcomes[0]
    assert isinstance(outcomes[1], InvalidRequestError)
    assert outcomes[1].code == "body_too_large"
    assert op_ids(await server_log(server_url, "small")) == [outcomes[0].op_id]


# -- subscriptions --------------------------------------------------------------------------------


async def test_a_lagging_subscription_reads_the_log_a_page_at_a_time_as_the_app_consumes(
    server_url: str, token: str
) -> None:
    """Bounded memory: a subscription far behind must not pull the whole backlog into memory."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as writer:
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await writer.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 2000)
    page = 50
    config = fast_config(subscription_buffer=8, catchup_page=page)
    async with WorkspaceClient(server_url, token=token, config=config) as reader:
        taken = 0
        ahead: list[int] = []  # at each log read: how far past what the app took it starts
        real_read_log = reader.read_log

        async def spy(
            workspace_id: str, sub_doc: str, since: int, limit: int
        ) -> tuple[int, Sequence[Committed | Snapshot]]:
            ahead.append(since - taken)
            return await real_read_log(workspace_id, sub_doc, since, limit)

        reader.read_log = spy  # type: ignore[method-assign]
        clocks: list[int] = []
        async with reader.subscribe(WS, "tree") as sub:
            async for committed in sub:
                clocks.append(committed.clock)
                taken = committed.clock
                if committed.clock == 2001:
                    break
            assert sub.frames_dropped > 0  # the server's catch-up did overflow the buffer
    assert clocks == list(range(1, 2002))
    assert len(ahead) >= 2000 // page
    assert max(ahead) <= page


async def test_closing_one_of_two_subscriptions_leaves_the_other_exact(
    server_url: str, token: str
) -> None:
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(proxy.url, token=token, config=fast_config()) as reader,
    ):
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        first = reader.subscribe(WS, "tree", since=0)  # the one the server streams from
        second = reader.subscribe(WS, "tree", since=1)
        async with second:
            async with first:
                first_seen = await asyncio.wait_for(collect(first, 1), TIMEOUT)
                await writer.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 10)
                assert await asyncio.wait_for(collect(second, 6), TIMEOUT) == list(range(2, 7))
            # `first` is closed: the sub-doc's feed must go on for `second`, across a cut too.
            await writer.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 10)
            proxy.drop_all()
            await writer.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 10)
            rest = await asyncio.wait_for(collect(second, 31), TIMEOUT)
            third = await asyncio.wait_for(
                collect(reader.subscribe(WS, "tree", since=29), 31), TIMEOUT
            )
    assert first_seen == [1]
    assert rest == list(range(7, 32))
    assert third == [30, 31]
    assert [c async for c in _closed_clocks(first)] == []


async def _closed_clocks(sub: Subscription) -> Any:
    async for committed in sub:
        yield committed.clock


async def test_a_subscription_from_the_head_yields_only_later_clocks(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await client.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 4)
        async with client.subscribe(WS, "tree", since=5) as sub:
            await client.connect(WS, timeout=TIMEOUT)
            reader = asyncio.create_task(collect(sub, 8))
            await client.apply_ops(WS, "tree", [NodeIncrement(node_id="n", field="c")] * 3)
            clocks = await asyncio.wait_for(reader, TIMEOUT)
            assert sub.clock == 8
    assert clocks == [6, 7, 8]


@pytest.mark.parametrize("shared", [False, True], ids=["socket", "second_on_sub_doc"])
async def test_a_subscription_from_past_the_head_is_refused_not_silently_skipped(
    server_url: str, token: str, shared: bool
) -> None:
    """`since` names clocks the server does not have (a client resuming against a restored or a
    different database): ops later committed at those clocks would be skipped as already seen.
    Refused with `invalid_field`, whether the server sees the subscribe (the first subscription
    of the sub-doc) or the client catches up from the log itself (a second one)."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with contextlib.AsyncExitStack() as stack:
            if shared:
                first = await stack.enter_async_context(client.subscribe(WS, "tree", since=0))
                assert await asyncio.wait_for(collect(first, 1), TIMEOUT) == [1]
            sub = await stack.enter_async_context(client.subscribe(WS, "tree", since=6))
            with pytest.raises(InvalidRequestError) as caught:
                await asyncio.wait_for(collect(sub, 7), TIMEOUT)
            assert caught.value.code == "invalid_field"
            assert sub.clock == 6
            if shared:  # the other subscription of the sub-doc goes on
                await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                assert await asyncio.wait_for(collect(first, 2), TIMEOUT) == [2]


async def test_a_server_restart_on_the_same_database_loses_and_duplicates_nothing(
    aiohttp_server: ServerFactory, tmp_path: Path, token: str
) -> None:
    config = ServerConfig(db_path=tmp_path / "server.db", token_secret=SECRET)
    server = await aiohttp_server(create_app(config))
    port = server.port
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(
        url, token=token, outbox=tmp_path / "outbox", config=fast_config()
    ) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with client.subscribe(WS, "tree") as sub:
            seen = asyncio.create_task(collect(sub, 201))
            writes = asyncio.gather(
                *(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                    for _ in range(100)
                ),
                return_exceptions=True,
            )
            await server.close()  # with ops in flight and the subscription live
            server = await aiohttp_server(create_app(config), port=port)
            more = [
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                for _ in range(100)
            ]
            outcomes = await asyncio.wait_for(
                asyncio.gather(writes, *more, return_exceptions=True), TIMEOUT
            )
            client.retry_pending()  # any that gave up while the server was away
            await client.wait_synced(timeout=TIMEOUT)
            clocks = await asyncio.wait_for(seen, TIMEOUT)
    assert clocks == list(range(1, 202))
    assert not [o for o in outcomes if isinstance(o, BaseException)]
    log = await server_log(url, "tree")
    assert len(log) == 201
    assert len(set(op_ids(log))) == 201
    assert counter(await server_state(url, "tree")) == 200


# -- the outbox file ------------------------------------------------------------------------------


async def test_an_outbox_from_a_newer_schema_is_refused_and_left_untouched(
    server_url: str, token: str, tmp_path: Path
) -> None:
    path = tmp_path / "outbox"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, future_column TEXT)")
        conn.execute("INSERT INTO outbox VALUES (1, 'from a newer SDK')")
        conn.execute("PRAGMA user_version = 2")
    conn.close()
    client = WorkspaceClient(server_url, token=token, outbox=path, config=fast_config())
    with pytest.raises(OutboxError) as caught:
        await client.start()
    assert caught.value.code == "outbox_version"
    with pytest.raises(RuntimeError):
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        assert conn.execute("SELECT * FROM outbox").fetchall() == [(1, "from a newer SDK")]
    conn.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
async def test_a_damaged_outbox_file_is_refused_with_a_typed_error(
    server_url: str, token: str, tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "outbox"
    if damage == "garbage":
        path.write_bytes(b"this is not a SQLite database, just bytes " * 200)
    else:
        async with WorkspaceClient(
            server_url, token=token, outbox=path, config=fast_config()
        ) as client:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        data = path.read_bytes()
        assert len(data) > 4096
        path.write_bytes(data[: 4096 + 100])  # cut mid-page
    client = WorkspaceClient(server_url, token=token, outbox=path, config=fast_config())
    (outcome,) = await asyncio.gather(client.start(), return_exceptions=True)
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, OutboxError)
        assert outcome.code == "outbox_open_failed"
    else:  # a truncation SQLite can read past is an empty outbox, never a half-read row
        assert client.pending_count() == 0
        await client.close()


async def test_an_outbox_whose_directory_cannot_be_made_fails_with_a_typed_error(
    server_url: str, token: str, tmp_path: Path
) -> None:
    (tmp_path / "a_file").write_text("not a directory")
    client = WorkspaceClient(
        server_url, token=token, outbox=tmp_path / "a_file" / "outbox", config=fast_config()
    )
    with pytest.raises(OutboxError) as caught:
        await client.start()
    assert caught.value.code == "outbox_open_failed"


async def test_an_unexpected_failure_of_a_send_is_retried_instead_of_wedging_the_sub_doc(
    server_url: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cv_workspace_client._io.http import HttpApi

    real_post = HttpApi.post_ops
    calls = 0

    async def flaky_post(self: HttpApi, workspace_id: str, sub_doc: str, body: str) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # not a WorkspaceError: a library surprise
            raise RuntimeError("something the transport did not expect")
        return await real_post(self, workspace_id, sub_doc, body)

    monkeypatch.setattr(HttpApi, "post_ops", flaky_post)
    config = fast_config(ops_over_websocket=False)
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        first = await asyncio.wait_for(
            client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root")), TIMEOUT
        )
        second = await asyncio.wait_for(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")), TIMEOUT
        )
        await client.wait_synced(timeout=TIMEOUT)
    assert calls == 3
    assert (first.clock, second.clock) == (1, 2)
    assert op_ids(await server_log(server_url, "tree")) == [first.op_id, second.op_id]


@pytest.mark.parametrize("websocket", [True, False], ids=["websocket", "http"])
async def test_wait_synced_returns_once_earlier_ops_are_answered_while_others_keep_writing(
    server_url: str, token: str, websocket: bool
) -> None:
    """`wait_synced` covers what was submitted before the call: a writer that always keeps an op
    in flight (so the client is never without pending ops) must not hold it up forever."""
    config = fast_config(ops_over_websocket=websocket)
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        stop, flowing = asyncio.Event(), asyncio.Event()
        written = 0

        async def keep_writing() -> None:
            nonlocal written
            previous = asyncio.ensure_future(
                client.apply_op(WS, "other", NodeInsert(node_id=f"k{written}", parent_id="root"))
            )
            while not stop.is_set():
                written += 1
                current = asyncio.ensure_future(
                    client.apply_op(
                        WS, "other", NodeInsert(node_id=f"k{written}", parent_id="root")
                    )
                )
                await asyncio.sleep(0)  # let it submit before the previous one is answered
                await previous  # one more is already pending: the client is never synced
                previous = current
                if written == 20:
                    flowing.set()
            await previous

        writer = asyncio.create_task(keep_writing())
        await asyncio.wait_for(flowing.wait(), TIMEOUT)  # in full flow before the wait
        mine = asyncio.ensure_future(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
        )
        await asyncio.sleep(0)  # let the caller's task start: it submits, then awaits
        await client.wait_synced(timeout=TIMEOUT)
        assert mine.done()
        assert (await mine).clock == 2
        assert client.pending_count() > 0  # the writer's ops were still pending meanwhile
        stop.set()
        await asyncio.wait_for(writer, TIMEOUT)
        await client.wait_synced(timeout=TIMEOUT)
        assert client.pending_count() == 0


async def test_ops_over_websocket_false_sends_ops_over_http_even_with_a_socket_open(
    server_url: str,
) -> None:
    """`ops_over_websocket=False` says "HTTP only". A subscription opens the workspace's
    websocket anyway, and ops went over it as soon as it was open: an app that kept ops off
    websockets (a proxy that buffers them, a gateway that bills them) had them sent there."""
    async with WorkspaceClient(
        server_url, token=token_for(WS), config=fast_config(ops_over_websocket=False)
    ) as client:
        subscription = client.subscribe(WS, "tree")
        await client.connect(WS, timeout=10)
        http = client._api()
        posted: list[str] = []
        post_ops = http.post_ops

        async def counting(workspace_id: str, sub_doc: str, body: str) -> Any:
            posted.append(sub_doc)
            return await post_ops(workspace_id, sub_doc, body)

        http.post_ops = counting  # type: ignore[method-assign]
        commits = await asyncio.wait_for(
            asyncio.gather(
                client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root")),
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")),
            ),
            10,
        )
        assert [commit.clock for commit in commits] == [1, 2]
        assert posted, "no op went over HTTP"
        assert set(posted) == {"tree"}
        assert await asyncio.wait_for(collect(subscription, 2), 10) == [1, 2]
