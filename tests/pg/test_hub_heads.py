"""How the hub reacts to news from other instances (no database needed): a head a subscriber
already has sends nobody to the log (what the PostgreSQL backend's short grace before handing
its own commits' notifications to the hub relies on), a newer head does, and `wake_all` sends
every live subscriber to the log once — from where it stands, so nothing is sent twice."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

from cv_mutations import SubDocState
from cv_server.hub import Connection, Hub, Subscription
from cv_server.oplog import (
    Compaction,
    IncomingOp,
    LogEntry,
    OpLogStats,
    OpLogStore,
    Outcome,
    SubDocHead,
)

WS, DOC = "ws1", "tree"
TIMEOUT = 10.0


class Log(OpLogStore):
    """An in-memory log that counts reads."""

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []
        self.reads = 0

    def commit(self, count: int) -> list[LogEntry]:
        start = len(self.entries)
        new = [LogEntry(start + i + 1, f"op-{start + i + 1:08d}", {}) for i in range(count)]
        self.entries += new
        return new

    async def client_mark(self, workspace_id: str, sub_doc: str, client_id: str) -> int:
        raise NotImplementedError

    async def read_since(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[LogEntry]]:
        self.reads += 1
        return len(self.entries), self.entries[since : since + limit]

    def append_nowait(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> asyncio.Future[tuple[list[Outcome], list[LogEntry]]]:
        raise NotImplementedError

    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        raise NotImplementedError

    async def head(self, workspace_id: str, sub_doc: str) -> int:
        return len(self.entries)

    async def list_sub_docs(
        self, workspace_id: str, *, after: str | None = None, limit: int
    ) -> list[SubDocHead]:
        raise NotImplementedError

    async def horizon(self, workspace_id: str, sub_doc: str) -> int:
        return 1

    async def compact(
        self, older_than: float, *, limit: int, start: tuple[str, str] | None = None
    ) -> Compaction:
        raise NotImplementedError

    async def expire_rejections(self, older_than: float, *, limit: int) -> int:
        raise NotImplementedError

    async def stats(self) -> OpLogStats:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class Socket:
    """Records what a subscription sends. It reads at once, so catch-up never waits for room."""

    #: Frames one catch-up read may add (no smaller than any page these tests read).
    catch_up_page = 1_000_000

    def __init__(self) -> None:
        self.clocks: list[int] = []
        self.synced = asyncio.Event()
        self.changed = asyncio.Event()

    def send(self, text: str, stamp: float | None = None) -> bool:
        self.clocks.append(int(text.split('"clock":')[1].split(",")[0]))
        self.changed.set()
        return True

    def send_json(self, body: dict[str, Any]) -> bool:
        if body.get("type") == "synced":
            self.synced.set()
        return True

    def too_slow(self) -> None:
        raise AssertionError("not expected here")

    async def room(self) -> None:
        return None

    def close(self, code: int, message: bytes = b"") -> None:
        raise AssertionError(f"closed with {code}: {message!r}")

    async def until(self, clock: int) -> None:
        async def loop() -> None:
            while not self.clocks or self.clocks[-1] < clock:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), TIMEOUT)


async def subscribed(hub: Hub) -> tuple[Subscription, Socket]:
    socket = Socket()
    sub = Subscription(hub, cast(Connection, socket), WS, DOC, 0, page=100, pending_limit=100)
    sub.start()
    await asyncio.wait_for(socket.synced.wait(), TIMEOUT)
    return sub, socket


async def settled() -> None:
    """Let woken subscriptions run their reads to the end."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_head_a_subscriber_already_has_sends_nobody_to_the_log() -> None:
    log = Log()
    hub = Hub(log)
    sub, socket = await subscribed(hub)
    reads = log.reads
    hub.publish(WS, DOC, log.commit(3))
    hub.notify_head(WS, DOC, 3)  # our own commit, announced after we published it
    await settled()
    assert socket.clocks == [1, 2, 3]
    assert log.reads == reads
    sub.stop()


async def test_a_newer_head_sends_live_subscribers_to_the_log_for_the_ops_they_lack() -> None:
    log = Log()
    hub = Hub(log)
    sub, socket = await subscribed(hub)
    hub.publish(WS, DOC, log.commit(2))
    log.commit(3)  # committed by another instance: no publish here
    hub.notify_head(WS, DOC, 5)
    await socket.until(5)
    assert socket.clocks == [1, 2, 3, 4, 5]
    sub.stop()


async def test_wake_all_sends_every_live_subscriber_to_the_log_once() -> None:
    log = Log()
    hub = Hub(log)
    (first, one), (second, two) = await subscribed(hub), await subscribed(hub)
    log.commit(4)  # commits whose notifications were lost
    reads = log.reads
    hub.wake_all()
    await one.until(4)
    await two.until(4)
    await settled()
    assert one.clocks == two.clocks == [1, 2, 3, 4]
    assert log.reads - reads == 2  # one catch-up read each
    first.stop()
    second.stop()
