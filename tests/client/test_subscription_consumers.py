"""Subscriptions from the application's side, through the real server on loopback: a consumer
cancelled mid catch-up, a subscription the server refused next to others of its sub-doc, and a
Hypothesis state machine that opens, consumes, cancels and closes subscriptions at random while
another client commits and a FaultProxy cuts the connections. Each subscription must yield
exactly `since+1 .. head`, in order, with the server's op_ids, once consumed to the head."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from cv_mutations import NodeIncrement, NodeInsert
from cv_server import ServerConfig, create_app
from cv_workspace_client import (
    Committed,
    InvalidRequestError,
    Snapshot,
    Subscription,
    WorkspaceClient,
)
from cv_workspace_client.testing import FaultProxy
from tests.stateful import AsyncStateMachine

from .helpers import SECRET, WS, collect, fast_config, server_log, token_for

TIMEOUT = 10
OTHER = "ws2"


async def increments(client: WorkspaceClient, sub_doc: str, count: int, ws: str = WS) -> None:
    await client.apply_ops(ws, sub_doc, [NodeIncrement(node_id="n", field="c")] * count)


# -- cancellation of the consuming task ------------------------------------------------------------


async def test_a_consumer_cancelled_during_a_catch_up_read_still_gets_every_op_after(
    server_url: str, token: str
) -> None:
    """`wait_for(anext(sub), t)` is how an app polls: its timeout cancels `__anext__` wherever it
    is, a catch-up read from the log included. The read is lost, not the ops it was to fetch."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as writer:
        await writer.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await increments(writer, "tree", 29)
    async with WorkspaceClient(
        server_url, token=token, config=fast_config(catchup_page=10)
    ) as reader:
        reading = asyncio.Event()
        real_read_log = reader.read_log

        async def spy(
            workspace_id: str, sub_doc: str, since: int, limit: int
        ) -> tuple[int, Sequence[Committed | Snapshot]]:
            reading.set()  # a catch-up read is under way
            return await real_read_log(workspace_id, sub_doc, since, limit)

        reader.read_log = spy  # type: ignore[method-assign]
        async with reader.subscribe(WS, "tree", since=30) as first:
            # `first` is the one the server streams from; once it has a live op, its `synced`
            # is behind it, and nothing but the catch-up below is left for the second one.
            await reader.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
            assert await asyncio.wait_for(collect(first, 31), TIMEOUT) == [31]
            async with reader.subscribe(WS, "tree", since=0) as second:
                consumer = asyncio.create_task(anext(second))
                await asyncio.wait_for(reading.wait(), TIMEOUT)
                consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consumer
                assert consumer.cancelled()
                # No op is committed from here on: only the catch-up can deliver them.
                clocks = await asyncio.wait_for(collect(second, 31), TIMEOUT)
    assert clocks == list(range(1, 32))


# -- a subscribe the server refused ---------------------------------------------------------------


async def test_a_refused_subscription_does_not_fail_or_starve_the_others_of_its_sub_doc(
    server_url: str, token: str
) -> None:
    """The server refuses a `since` past its head (a client resuming against a restored
    database) and drops its feed of the sub-doc. A subscription opened next to the refused one,
    from a valid clock, must neither get the refusal nor be left without live ops."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        await client.connect(WS, timeout=TIMEOUT)
        async with (
            client.subscribe(WS, "tree", since=6) as stale,  # sent to the server: past the head
            client.subscribe(WS, "tree", since=0) as fresh,  # the same sub-doc's feed
        ):
            with pytest.raises(InvalidRequestError) as caught:
                await asyncio.wait_for(anext(stale), TIMEOUT)
            assert caught.value.code == "invalid_field"
            assert await asyncio.wait_for(collect(fresh, 1), TIMEOUT) == [1]
            # Caught up from the log by now: 2 and 3 can only come live.
            reader = asyncio.create_task(collect(fresh, 3))
            await increments(client, "tree", 2)
            assert await asyncio.wait_for(reader, TIMEOUT) == [2, 3]


async def test_a_subscription_opened_after_a_refused_one_gets_live_ops(
    server_url: str, token: str
) -> None:
    """The app's answer to the refusal: start over from the head. The refused subscription
    raised (its iteration is over, as a generator's that raised); the new one must be fed live,
    not only caught up once from the log."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(anext(client.subscribe(WS, "tree", since=6)), TIMEOUT)
        clock, _ = await client.get_state(WS, "tree")
        async with client.subscribe(WS, "tree", since=clock) as sub:
            reader = asyncio.create_task(collect(sub, 2))
            await increments(client, "tree", 1)
            assert await asyncio.wait_for(reader, TIMEOUT) == [2]
            # Caught up by now whichever way 2 came: 3 can only come live.
            reader = asyncio.create_task(collect(sub, 3))
            await increments(client, "tree", 1)
            assert await asyncio.wait_for(reader, TIMEOUT) == [3]


# -- everything at random --------------------------------------------------------------------------

TARGETS = [(WS, "a"), (WS, "b"), (OTHER, "a")]
#: Bounds one step of the machine (a commit, a consume, a close) and the final drain.
STEP_TIMEOUT = 15.0


@dataclass
class Tracked:
    sub: Subscription
    target: tuple[str, str]
    since: int
    clocks: list[int] = field(default_factory=list)
    op_ids: list[str | None] = field(default_factory=list)
    closed: bool = False

    def take(self, committed: Committed | Snapshot) -> None:
        assert isinstance(committed, Committed)  # never compacted here
        expected = self.since + len(self.clocks) + 1
        assert committed.clock == expected, (self.target, self.since, self.clocks[-3:], committed)
        self.clocks.append(committed.clock)
        self.op_ids.append(committed.op_id)


class SubscriptionsAtRandom(AsyncStateMachine):
    """One reader client behind a FaultProxy, a writer straight to the server."""

    step_timeout = STEP_TIMEOUT

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.heads = dict.fromkeys(TARGETS, 0)
        self.subs: list[Tracked] = []
        self.started = False
        try:
            self.run(self._start())
        except BaseException:
            self.teardown()  # Hypothesis tears down only a machine that was made
            raise

    async def _start(self) -> None:
        config = ServerConfig(db_path=Path(self.tmp.name) / "server.db", token_secret=SECRET)
        self.server = TestServer(create_app(config), host="127.0.0.1")
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        self.proxy = await FaultProxy(self.url).start()
        token = token_for(WS, OTHER)
        self.writer = WorkspaceClient(self.url, token=token, config=fast_config())
        await self.writer.start()
        # Small buffer and pages: overflow, lagging and paged catch-up happen within a few ops.
        # The heartbeat and request timeout bound what a silenced connection costs.
        reader_config = fast_config(
            subscription_buffer=6,
            catchup_page=4,
            socket_heartbeat_seconds=0.2,
            request_timeout_seconds=1.0,
        )
        self.reader = WorkspaceClient(self.proxy.url, token=token, config=reader_config)
        await self.reader.start()
        for ws, sub_doc in TARGETS:
            await self.writer.apply_op(ws, sub_doc, NodeInsert(node_id="n", parent_id="root"))
            self.heads[(ws, sub_doc)] = 1
        self.started = True

    def open_subs(self) -> list[Tracked]:
        return [t for t in self.subs if not t.closed]

    # -- rules ------------------------------------------------------------------------------------

    @rule(
        where=st.sampled_from(TARGETS),
        back=st.integers(min_value=0, max_value=12),
        enter=st.booleans(),
    )
    def open_subscription(self, where: tuple[str, str], back: int, enter: bool) -> None:
        target = where
        since = max(0, self.heads[target] - back)
        sub = self.reader.subscribe(target[0], target[1], since=since)
        if enter:  # registered now; otherwise at its first `anext`
            self.run(sub.__aenter__())
        self.subs.append(Tracked(sub, target, since))

    @rule(where=st.sampled_from(TARGETS), count=st.integers(min_value=1, max_value=25))
    def commit(self, where: tuple[str, str], count: int) -> None:
        self.run(increments(self.writer, where[1], count, ws=where[0]))
        self.heads[where] += count

    @precondition(lambda self: bool(self.open_subs()))
    @rule(
        which=st.integers(min_value=0),
        count=st.integers(min_value=1, max_value=30),
        patience=st.sampled_from([0.001, 0.01, 0.05]),
    )
    def consume(self, which: int, count: int, patience: float) -> None:
        """Take up to `count` ops, waiting at most `patience` for each: the timeout cancels
        `__anext__` wherever it is (waiting, or reading the log)."""
        tracked = self.open_subs()[which % len(self.open_subs())]

        async def take() -> None:
            for _ in range(count):
                try:
                    committed = await asyncio.wait_for(anext(tracked.sub), patience)
                except TimeoutError:
                    return
                tracked.take(committed)

        self.run(take())

    @precondition(lambda self: bool(self.open_subs()))
    @rule(which=st.integers(min_value=0), spins=st.integers(min_value=0, max_value=150))
    def cancel_while_consuming(self, which: int, spins: int) -> None:
        """The consuming task is cancelled after `spins` turns of the loop: inside `__anext__`
        wherever it is (a catch-up read under way, say), or not at all if it got an op first."""
        tracked = self.open_subs()[which % len(self.open_subs())]

        async def race() -> None:
            consumer = asyncio.ensure_future(anext(tracked.sub))
            for _ in range(spins):
                await asyncio.sleep(0)
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                tracked.take(await consumer)

        self.run(race())

    @precondition(lambda self: bool(self.open_subs()))
    @rule(which=st.integers(min_value=0), spins=st.integers(min_value=0, max_value=20))
    def close_while_consuming(self, which: int, spins: int) -> None:
        """`aclose()` from another task while the app's task is inside `__anext__` (waiting, or
        in a catch-up read): the iteration ends, having yielded nothing out of order."""
        tracked = self.open_subs()[which % len(self.open_subs())]

        async def race() -> None:
            consumer = asyncio.ensure_future(anext(tracked.sub))
            for _ in range(spins):
                await asyncio.sleep(0)
            await tracked.sub.aclose()
            with contextlib.suppress(StopAsyncIteration):
                tracked.take(await consumer)
            with pytest.raises(StopAsyncIteration):
                await anext(tracked.sub)

        self.run(race())
        tracked.closed = True

    @precondition(lambda self: bool(self.open_subs()))
    @rule(which=st.integers(min_value=0))
    def close(self, which: int) -> None:
        tracked = self.open_subs()[which % len(self.open_subs())]
        self.run(tracked.sub.aclose())
        tracked.closed = True

    @rule(
        fault=st.sampled_from(["drop_all", "cut_open", "cut_open_torn", "silence_open"]),
    )
    def cut(self, fault: str) -> None:
        if fault == "drop_all":
            self.proxy.drop_all()
        elif fault == "cut_open":
            self.proxy.cut_open()
        elif fault == "cut_open_torn":
            self.proxy.cut_open(forward_bytes=3)
        else:
            self.proxy.silence_open()

    @rule(chunks=st.sampled_from([0.0, 0.0, 0.05]), delay=st.sampled_from([0.0, 0.0, 0.002]))
    def weather(self, chunks: float, delay: float) -> None:
        self.proxy.cut_chunks(chunks, skip_chunks=1)
        self.proxy.delay = delay

    # -- the promise ------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.started:
                self.proxy.cut_chunks(0.0)
                self.proxy.delay = 0.0
                self.run(self._drain_and_check())
        finally:
            try:
                self.loop.run_until_complete(self._stop())
            finally:
                try:
                    self.loop.run_until_complete(_end_leftovers())
                finally:
                    self.close_loop()
                    self.tmp.cleanup()

    async def _drain_and_check(self) -> None:
        logs = {t: await server_log(self.url, t[1], workspace=t[0]) for t in TARGETS}
        for target, log in logs.items():
            assert [e["clock"] for e in log] == list(range(1, self.heads[target] + 1))
        for tracked in self.subs:
            head = self.heads[tracked.target]
            if not tracked.closed:
                while tracked.since + len(tracked.clocks) < head:
                    tracked.take(await anext(tracked.sub))
                assert tracked.clocks == list(range(tracked.since + 1, head + 1))
            log = logs[tracked.target]
            taken = log[tracked.since : tracked.since + len(tracked.clocks)]
            assert tracked.op_ids == [e["op_id"] for e in taken]

    async def _stop(self) -> None:
        for tracked in self.subs:
            await tracked.sub.aclose()
        for name in ("reader", "writer"):
            client = getattr(self, name, None)
            if client is not None:
                await client.close()
        if hasattr(self, "proxy"):
            await self.proxy.close()
        if hasattr(self, "server"):
            await self.server.close()


async def _end_leftovers() -> None:
    """After a failed step, the tasks it left (a consumer, a server handler) end here, not as
    "destroyed but pending" noise once the loop is closed."""
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


SubscriptionsAtRandom.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: a failure here is a step or the drain running into STEP_TIMEOUT, and
    # shrinking replays dozens of those. The failing steps are printed as they ran.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
test_subscriptions_at_random_yield_since_to_head_exactly_once = SubscriptionsAtRandom.TestCase
