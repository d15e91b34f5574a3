"""`SyncSignals`: what a client tells the app about its unsynced changes, besides each op's own
answer — `wait_synced()` calls waiting for what was submitted before them, and
`watch_sync_status()` watchers following the pending count and the open websockets.

A watcher gets the status as it is when it asks, never a backlog: an app that redraws a "saving"
badge wants the latest value, and a queue per watcher would grow by one entry per op while the
app is busy. The status is only computed while someone watches, so a client nobody watches pays
an attribute check per pump.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, TypeVar

from cv_workspace_client.models import SyncStatus

if TYPE_CHECKING:
    from cv_workspace_client._core.machine import OutboxMachine

__all__ = ["SyncSignals"]

T = TypeVar("T")


class SyncSignals:
    """Call `update()` whenever the machine may have answered ops or a socket opened or closed,
    and `close()` once the client is closed."""

    def __init__(self, machine: OutboxMachine, status: Callable[[], SyncStatus]) -> None:
        self._machine = machine
        self._status = status
        #: `wait` calls: (the last seq submitted when it was called, its future).
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._last: SyncStatus | None = None
        self._watchers = 0
        self._wakes: set[asyncio.Future[None]] = set()
        #: `watch_value` watchers: woken at every update, each compares its own value.
        self._value_wakes: set[asyncio.Future[None]] = set()
        self._closed = False

    async def wait(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Until every op submitted so far is answered (`TimeoutError` after `timeout`)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self._machine.last_seq, future)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await future
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def update(self) -> None:
        if self._waiters:
            self._settle(closing=False)
        if self._watchers:
            self._publish()
        if self._value_wakes:
            _wake_all(self._value_wakes)

    def close(self) -> None:
        """Every wait returns (what is left stays in the outbox); every watch ends once it has
        yielded the final status."""
        self._closed = True
        self._settle(closing=True)
        self._publish()
        self._wake()
        _wake_all(self._value_wakes)

    async def watch(self) -> AsyncIterator[SyncStatus]:
        self._watchers += 1
        try:
            self._publish()  # nobody watched until now: what was last published may be stale
            yielded: SyncStatus | None = None
            while True:
                status = self._last
                if status is not None and status != yielded:
                    yielded = status
                    yield status
                    continue
                if self._closed:
                    return
                wake = asyncio.get_running_loop().create_future()
                self._wakes.add(wake)
                try:
                    await wake
                finally:
                    self._wakes.discard(wake)
        finally:
            self._watchers -= 1

    async def watch_value(self, value: Callable[[], T]) -> AsyncIterator[T]:
        """Yield `value()` now, then each time it differs after an update, until `close()`:
        for a part of the status the shared one does not show (one sub-doc's pending count,
        which can change while the client-wide count does not: one op answered as another
        sub-doc's is submitted). Coalesced like `watch`."""
        yielded = value()
        yield yielded
        while not self._closed:
            wake = asyncio.get_running_loop().create_future()
            self._value_wakes.add(wake)
            try:
                await wake
            finally:
                self._value_wakes.discard(wake)
            now = value()
            if now != yielded:
                yielded = now
                yield now

    def _settle(self, *, closing: bool) -> None:
        oldest = self._machine.oldest_pending_seq()
        waiting: list[tuple[int, asyncio.Future[None]]] = []
        for target, future in self._waiters:
            if future.done():
                continue
            if closing or oldest is None or oldest > target:
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._waiters = waiting

    def _publish(self) -> None:
        status = self._status()
        if status != self._last:
            self._last = status
            self._wake()

    def _wake(self) -> None:
        _wake_all(self._wakes)


def _wake_all(wakes: set[asyncio.Future[None]]) -> None:
    for wake in wakes:
        if not wake.done():
            wake.set_result(None)
