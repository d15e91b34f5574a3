"""LISTEN/NOTIFY across connections: delivered on commit only, and the listener comes back by
itself after its backend is killed, telling its subscribers to catch up."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import (
    NOTIFY_PAYLOAD_LIMIT,
    Notifier,
    NotifyPayloadTooLarge,
    PostgresSettings,
    connect,
    notify,
)
from cv_server.pg.notifier import reconnect_delays

pytestmark = pytest.mark.postgres

TIMEOUT = 5.0


class Inbox:
    """Collects payloads; `wait_for(p)` returns once `p` arrived."""

    def __init__(self) -> None:
        self.payloads: list[str] = []
        self.reconnects = 0
        self._changed = asyncio.Event()

    def on_payload(self, payload: str) -> None:
        self.payloads.append(payload)
        self._changed.set()

    def on_reconnect(self) -> None:
        self.reconnects += 1
        self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        async def loop() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), TIMEOUT)

    async def wait_for(self, payload: str) -> None:
        await self.wait_until(lambda: payload in self.payloads)


def no_delays() -> Iterator[float]:
    while True:
        yield 0.0


@pytest.fixture
def channel() -> str:
    return f"cv_test_{secrets.token_hex(6)}"


@pytest.fixture
async def notifier(postgres_url: str) -> AsyncIterator[Notifier]:
    notifier = Notifier(postgres_url, delays=no_delays)
    await notifier.start()
    try:
        yield notifier
    finally:
        await notifier.close()


@pytest.fixture
async def sender(postgres_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(postgres_url)
    try:
        yield conn
    finally:
        await conn.close()


async def test_a_notification_is_delivered_on_commit_and_not_before(
    notifier: Notifier, sender: asyncpg.Connection, postgres_url: str, channel: str
) -> None:
    inbox = Inbox()
    await notifier.listen(channel, inbox.on_payload)
    fence = await asyncpg.connect(postgres_url)
    try:
        async with sender.transaction():
            await notify(sender, channel, "in-transaction")
            # A notification committed after ours was queued arrives first: ours waits for commit.
            await notify(fence, channel, "fence")
            await inbox.wait_for("fence")
            assert inbox.payloads == ["fence"]
        await inbox.wait_for("in-transaction")
        assert inbox.payloads == ["fence", "in-transaction"]
    finally:
        await fence.close()


async def test_a_rolled_back_notification_is_never_delivered(
    notifier: Notifier, sender: asyncpg.Connection, channel: str
) -> None:
    inbox = Inbox()
    await notifier.listen(channel, inbox.on_payload)
    transaction = sender.transaction()
    await transaction.start()
    await notify(sender, channel, "rolled-back")
    await transaction.rollback()
    await notify(sender, channel, "after")
    await inbox.wait_for("after")
    assert inbox.payloads == ["after"]


async def test_the_listener_reconnects_after_its_backend_is_terminated_and_says_so(
    notifier: Notifier, sender: asyncpg.Connection, channel: str
) -> None:
    inbox = Inbox()
    await notifier.listen(channel, inbox.on_payload, inbox.on_reconnect)
    old_pid = notifier.backend_pid
    assert old_pid is not None
    assert await sender.fetchval("SELECT pg_terminate_backend($1)", old_pid)
    await inbox.wait_until(lambda: inbox.reconnects == 1)
    assert notifier.reconnects == 1
    assert notifier.backend_pid not in (None, old_pid)
    await notify(sender, channel, "after-reconnect")
    await inbox.wait_for("after-reconnect")
    assert inbox.payloads == ["after-reconnect"]


async def test_a_channel_subscribed_while_disconnected_is_listened_after_reconnect(
    postgres_url: str, sender: asyncpg.Connection, channel: str
) -> None:
    database_down = False
    failed_attempt = asyncio.Event()
    database_back = asyncio.Event()

    async def flaky_connect(dsn: str, settings: PostgresSettings) -> asyncpg.Connection:
        if database_down:
            raise ConnectionRefusedError("database down")
        return await connect(dsn, settings)

    async def sleep_until_database_back(delay: float) -> None:
        failed_attempt.set()
        await database_back.wait()

    notifier = Notifier(
        postgres_url, delays=no_delays, sleep=sleep_until_database_back, connector=flaky_connect
    )
    await notifier.start()
    try:
        first = Inbox()
        await notifier.listen(channel, first.on_payload, first.on_reconnect)
        database_down = True
        assert await sender.fetchval("SELECT pg_terminate_backend($1)", notifier.backend_pid)
        await asyncio.wait_for(failed_attempt.wait(), TIMEOUT)
        assert not notifier.connected
        second_channel = channel + "_late"
        second = Inbox()
        await notifier.listen(second_channel, second.on_payload)  # must not wait for the outage
        database_down = False
        database_back.set()
        await first.wait_until(lambda: first.reconnects == 1)
        await notify(sender, second_channel, "hello")
        await notify(sender, channel, "again")
        await second.wait_for("hello")
        await first.wait_for("again")
        assert second.payloads == ["hello"]
        assert first.payloads == ["again"]
    finally:
        database_back.set()
        await notifier.close()


async def test_a_closed_subscription_receives_nothing_more(
    notifier: Notifier, sender: asyncpg.Connection, channel: str
) -> None:
    kept, dropped = Inbox(), Inbox()
    await notifier.listen(channel, kept.on_payload)
    subscription = await notifier.listen(channel, dropped.on_payload)
    await notify(sender, channel, "both")
    await kept.wait_for("both")
    await dropped.wait_for("both")
    await subscription.close()
    await notify(sender, channel, "kept-only")
    await kept.wait_for("kept-only")
    assert kept.payloads == ["both", "kept-only"]
    assert dropped.payloads == ["both"]


async def test_a_payload_at_the_postgres_limit_is_refused_before_it_is_sent(
    notifier: Notifier, sender: asyncpg.Connection, channel: str
) -> None:
    inbox = Inbox()
    await notifier.listen(channel, inbox.on_payload)
    with pytest.raises(NotifyPayloadTooLarge) as caught:
        await notify(sender, channel, "x" * NOTIFY_PAYLOAD_LIMIT)
    assert caught.value.code == "notify_payload_too_large"
    largest = "é" * ((NOTIFY_PAYLOAD_LIMIT - 1) // 2)
    await notify(sender, channel, largest)
    await inbox.wait_for(largest)
    assert inbox.payloads == [largest]


def test_reconnect_delays_grow_with_full_jitter_up_to_the_cap() -> None:
    highest = reconnect_delays(uniform=lambda low, high: high)
    assert [next(highest) for _ in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    lowest = reconnect_delays(uniform=lambda low, high: low)
    assert [next(lowest) for _ in range(3)] == [0.0, 0.0, 0.0]
