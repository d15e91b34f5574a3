"""Cross-instance notifications with LISTEN/NOTIFY (docs/postgres.md, issue 7).

Sending: `notify(conn, channel, payload)` inside the transaction whose commit it announces. It is
`pg_notify` on that transaction's connection, so PostgreSQL delivers it at commit and drops it on
rollback: a listener can never be woken before the rows are readable (docs/queue.md).

Receiving: one `Notifier` per process holds a **dedicated** connection (never a pooled one: a
pooled connection goes back to the pool and its LISTENs would wake whoever borrows it next). When
that connection dies, the notifier reconnects by itself with backoff, LISTENs again on every
channel, and only then calls each subscriber's `on_reconnect`. Notifications sent while it was
away are lost for good; the subscriber's answer is to catch up from the log, which is complete
because LISTEN was active again before the catch-up started. A missed notification is covered by
catch-up, never by re-applying anything.

A connection can also die without a word: a NAT or firewall that dropped an idle flow, or a
database host gone in a failover, leaves a half-open TCP connection that neither closes nor
errors, and then simply delivers nothing more. So the notifier also asks the connection a
trivial query every sweep interval, and treats one it does not answer in time like one that was
terminated.

Payloads stay well under PostgreSQL's 8000-byte limit: send ids and clocks, never bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.config import ServerConfig
from cv_server.pg.errors import NotifyPayloadTooLarge
from cv_server.pg.pool import PostgresSettings, connect

__all__ = [
    "NOTIFY_PAYLOAD_LIMIT",
    "Notifier",
    "Subscription",
    "check_payload",
    "notify",
    "reconnect_delays",
]

logger = logging.getLogger(__name__)

#: PostgreSQL refuses payloads of this many bytes or more (default build).
NOTIFY_PAYLOAD_LIMIT: Final = 8000

#: Reconnect backoff: the default polling schedule (100 ms doubling to 2 s, docs/configuration.md)
#: with full jitter. Not the client's 1 s / 300 s: while this connection is down no live op
#: crosses instances, so waiting minutes would be a needless outage.
_RECONNECT_BASE_SECONDS: Final = 0.1
_RECONNECT_CAP_SECONDS: Final = 2.0

#: How often the LISTEN connection must prove it is alive: the waiter sweep of docs/configuration.md
#: (5 s, docs/queue.md), the same bound on how long a lost push may go unnoticed. It must answer
#: within its `statement_timeout` (PostgreSQL session guards, 5 s).
_CHECK_EVERY_SECONDS: Final = ServerConfig().sweep_seconds


def check_payload(payload: str) -> None:
    """Raise `NotifyPayloadTooLarge` unless PostgreSQL would accept `payload`."""
    size = len(payload.encode("utf-8"))
    if size >= NOTIFY_PAYLOAD_LIMIT:
        raise NotifyPayloadTooLarge(
            f"{size} bytes >= {NOTIFY_PAYLOAD_LIMIT}: send ids and clocks, not bodies"
        )


async def notify(conn: asyncpg.Connection, channel: str, payload: str) -> None:
    """Queue a notification on `conn`'s transaction: delivered on commit, dropped on rollback."""
    check_payload(payload)
    await conn.execute("SELECT pg_notify($1, $2)", channel, payload)


def reconnect_delays(
    base: float = _RECONNECT_BASE_SECONDS,
    cap: float = _RECONNECT_CAP_SECONDS,
    uniform: Callable[[float, float], float] = random.uniform,
) -> Iterator[float]:
    """Endless full-jitter delays `uniform(0, min(cap, base · 2^n))` between reconnect attempts."""
    attempt = 0
    while True:
        yield uniform(0.0, min(cap, base * 2**attempt))
        attempt += 1


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber of one channel. Callbacks run on the event loop and must not block: hand the
    payload to a queue or set an event, and do the reading elsewhere."""

    channel: str
    on_payload: Callable[[str], None]
    on_reconnect: Callable[[], None] | None
    _notifier: Notifier | None = None

    async def close(self) -> None:
        """Stop receiving. Idempotent."""
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            await notifier._unsubscribe(self)


class Notifier:
    """LISTEN on a dedicated connection that reconnects by itself.

    Call `await start()` once (it raises if the first connection fails, so a misconfigured server
    fails at start), `await listen(...)` per channel subscriber, and `await close()` at the end.
    `check_every`: seconds between checks that the connection answers a trivial query within
    `settings.statement_timeout_seconds` (one that does not is replaced).
    """

    def __init__(
        self,
        dsn: str,
        settings: PostgresSettings | None = None,
        *,
        delays: Callable[[], Iterator[float]] = reconnect_delays,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        connector: Callable[[str, PostgresSettings], Awaitable[asyncpg.Connection]] = connect,
        check_every: float = _CHECK_EVERY_SECONDS,
    ) -> None:
        if check_every <= 0:
            raise ValueError("check_every must be positive")
        self._dsn = dsn
        self._check_every = check_every
        self._connector = connector
        self._settings = settings or PostgresSettings(application_name="cv-server-listen")
        self._delays = delays
        self._sleep = sleep
        self._subscriptions: dict[str, list[Subscription]] = {}
        self._conn: asyncpg.Connection | None = None
        self._listening: set[str] = set()
        # Serialises (re)connecting with adding channels, so no channel is LISTENed twice on one
        # connection (that would dispatch every notification twice) or missed by a reconnect.
        self._lock = asyncio.Lock()
        self._lost = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        #: How many times the connection was re-established (for metrics and tests).
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    @property
    def backend_pid(self) -> int | None:
        """The server process id of the listening connection (None while disconnected)."""
        conn = self._conn
        if conn is None or conn.is_closed():
            return None
        return int(conn.get_server_pid())

    async def start(self) -> None:
        async with self._lock:
            await self._connect()
        self._supervisor = asyncio.create_task(self._supervise(), name="pg-notifier")

    async def listen(
        self,
        channel: str,
        on_payload: Callable[[str], None],
        on_reconnect: Callable[[], None] | None = None,
    ) -> Subscription:
        """Subscribe to `channel`. Once this returns, every notification committed afterwards
        reaches `on_payload` (or, if the connection drops, `on_reconnect` is called instead)."""
        subscription = Subscription(channel, on_payload, on_reconnect, self)
        async with self._lock:
            self._subscriptions.setdefault(channel, []).append(subscription)
            if self.connected and channel not in self._listening:
                assert self._conn is not None
                try:
                    await self._command(self._conn.add_listener(channel, self._dispatch))
                except Exception as exc:
                    # The reconnect LISTENs on every channel, this one included, and then
                    # calls `on_reconnect`: the promise above holds either way.
                    self._replace(f"LISTEN {channel!r} failed ({exc!r})")
                else:
                    self._listening.add(channel)
        return subscription

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        async with self._lock:
            conn, self._conn = self._conn, None
            self._listening.clear()
            if conn is not None and not conn.is_closed():
                try:
                    # A graceful close waits for the server to hang up: on a dead path it never
                    # does, and an unbounded wait here held the server's shutdown forever.
                    await conn.close(timeout=self._settings.statement_timeout_seconds)
                except Exception:  # timed out or already broken: asyncpg aborted the socket
                    conn.terminate()

    # -- internals -------------------------------------------------------------------------------

    async def _unsubscribe(self, subscription: Subscription) -> None:
        async with self._lock:
            subscribers = self._subscriptions.get(subscription.channel, [])
            if subscription in subscribers:
                subscribers.remove(subscription)
            if subscribers or subscription.channel not in self._listening:
                return
            del self._subscriptions[subscription.channel]
            self._listening.discard(subscription.channel)
            if self.connected:
                assert self._conn is not None
                try:
                    await self._command(
                        self._conn.remove_listener(subscription.channel, self._dispatch)
                    )
                except Exception as exc:  # the reconnect will not LISTEN on it again
                    self._replace(f"UNLISTEN {subscription.channel!r} failed ({exc!r})")

    async def _connect(self) -> None:
        """Open a connection and LISTEN on every channel; call with `_lock` held."""
        conn = await self._connector(self._dsn, self._settings)
        try:
            for channel in self._subscriptions:
                await self._command(conn.add_listener(channel, self._dispatch))
        except BaseException:
            conn.terminate()
            raise
        self._lost.clear()
        conn.add_termination_listener(self._on_terminated)
        self._conn = conn
        self._listening = set(self._subscriptions)

    async def _command(self, command: Awaitable[object]) -> None:
        """Await one command on a LISTEN connection for at most its `statement_timeout`. On a
        dead path a command is never answered, and it runs holding `_lock`: unbounded, it held
        every reconnect (and every `listen`) forever."""
        await asyncio.wait_for(command, self._settings.statement_timeout_seconds)

    def _replace(self, reason: str) -> None:
        """Have the supervisor replace the connection (call holding `_lock` or not)."""
        logger.warning("notification connection unusable: %s", reason)
        self._lost.set()

    def _on_terminated(self, conn: asyncpg.Connection) -> None:
        if conn is self._conn and not self._closing:
            self._lost.set()

    def _dispatch(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for subscription in list(self._subscriptions.get(channel, ())):
            try:
                subscription.on_payload(payload)
            except Exception:  # one broken subscriber must not starve the others
                logger.exception("notification subscriber of %r failed", channel)

    async def _until_lost(self) -> None:
        """Return once the connection is lost: terminated, or silent and deaf to a check."""
        while True:
            try:
                await asyncio.wait_for(self._lost.wait(), self._check_every)
                return
            except TimeoutError:
                pass
            if not await self._answers():
                return

    async def _answers(self) -> bool:
        """Whether the connection answers a trivial query in time. A half-open connection never
        terminates by itself: without this, the notifier stayed connected to nothing, with no
        error and no reconnect, and no other instance's commit reached a subscriber again."""
        async with self._lock:  # one query at a time on the connection (`listen` uses it too)
            conn = self._conn
            if conn is None or conn.is_closed():
                return False
            try:
                await self._command(conn.execute("SELECT 1"))
            except Exception as exc:  # a timeout or a broken connection: replace it either way
                logger.warning("notification connection did not answer (%r)", exc)
                return False
        return True

    async def _supervise(self) -> None:
        while not self._closing:
            await self._until_lost()
            logger.warning("notification connection lost; reconnecting")
            async with self._lock:
                old, self._conn = self._conn, None
                self._listening.clear()
            if old is not None:
                old.terminate()
            delays = self._delays()
            while True:
                # The lock is released between attempts so `listen` never waits out an outage:
                # a channel added meanwhile is picked up by the next `_connect`.
                async with self._lock:
                    try:
                        await self._connect()
                        break
                    except Exception as exc:  # retry whatever failed: the operator may fix it
                        delay = next(delays)
                        logger.warning(
                            "notification reconnect failed (%s); retry in %.2fs", exc, delay
                        )
                await self._sleep(delay)
            self.reconnects += 1
            # LISTEN is active again on every channel before anyone is told to catch up, so the
            # catch-up reads everything a lost notification announced.
            for subscribers in list(self._subscriptions.values()):
                for subscription in list(subscribers):
                    if subscription.on_reconnect is None:
                        continue
                    try:
                        subscription.on_reconnect()
                    except Exception:
                        logger.exception("reconnect subscriber of %r failed", subscription.channel)
