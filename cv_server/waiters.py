"""Waiting for a request's outcome (the reply pump of docs/queue.md): push on completion, plus a
sweep.

A waiter registers *before* its first read of the row (the done-before-listen race), is woken by
the queue's post-commit announcements, and — because an announcement can be missed (another
instance, a dropped LISTEN connection) — every `sweep_seconds` all waiters re-read their rows.
A waiter's deadline only ends the wait, never the work: the result stays on the row.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from cv_server.queue import FINISHED_STATUSES, ProcessRequest, QueueStore, RequestEvent

__all__ = ["Waiters", "WorkSignals"]


class Waiters:
    def __init__(self, store: QueueStore, *, sweep_seconds: float) -> None:
        self.store = store
        self.sweep_seconds = sweep_seconds
        self._events: dict[str, set[asyncio.Event]] = {}
        self._unlisten = store.add_listener(self._on_event)
        self._sweeper: asyncio.Task[None] | None = None
        self._releasing = False

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        self._unlisten()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for events in self._events.values():
            for event in events:
                event.set()

    def release_all(self) -> None:
        """The server is shutting down: end every wait now, with the latest row. Called when the
        shutdown begins, not at cleanup: a stream waiting for its outcome would otherwise hold
        the drain until its own deadline and then be cut, instead of telling its client that the
        wait ended (the work goes on; the row keeps the outcome)."""
        self._releasing = True
        for events in self._events.values():
            for event in events:
                event.set()

    @property
    def count(self) -> int:
        return sum(len(events) for events in self._events.values())

    def _on_event(self, event: RequestEvent) -> None:
        if event.status in FINISHED_STATUSES:
            for waiter in self._events.get(event.request_id, ()):
                waiter.set()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_seconds)
            for events in list(self._events.values()):
                for waiter in events:
                    waiter.set()

    @contextlib.asynccontextmanager
    async def _registered(self, request_id: str) -> AsyncIterator[asyncio.Event]:
        event = asyncio.Event()
        self._events.setdefault(request_id, set()).add(event)
        try:
            yield event
        finally:
            events = self._events.get(request_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._events[request_id]

    async def wait(
        self,
        workspace_id: str,
        request_id: str,
        patience: float,
        *,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> ProcessRequest | None:
        """The finished row, or the latest row once `patience` seconds passed (None if unknown).

        `abandoned()` is asked at every wake-up (at the latest each sweep): once it is true (the
        client hung up) the wait ends at once with the latest row. A server whose handlers are
        not cancelled on disconnect (`web.AppRunner`'s default, so `cv-server serve`) otherwise
        kept every abandoned stream's waiter, and its row read per sweep, for the whole deadline.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        async with self._registered(request_id) as event:
            while True:
                event.clear()  # clear before reading: a completion after the read sets it again
                row = await self.store.get(workspace_id, request_id)
                if row is None or row.is_finished or self._releasing:
                    return row
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return row
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
                if abandoned():
                    return row


class _Sleeper:
    """One idle worker's long poll: its scope, and what woke it."""

    __slots__ = ("classes", "pushed", "recheck", "wake", "workspaces")

    def __init__(self, classes: frozenset[str], workspaces: frozenset[str] | None) -> None:
        self.classes = classes
        self.workspaces = workspaces
        self.wake = asyncio.Event()
        #: Work of its classes became pending (or the server is stopping).
        self.pushed = False
        #: A slot of a concurrency key freed: held-back work may be claimable now — or not.
        self.recheck = False


class WorkSignals:
    """Wakes idle workers early when claimable work appears (docs/queue.md: the worker's idle poll
    backs off 100 ms → 2 s; a push cuts that wait short). A missed push costs at most one poll.
    Work already claimable when a poll begins is the caller's to find (`wait`'s `pending_now`):
    a push only announces a change.

    A request with a concurrency key that this process saw finish frees a slot of its key, which
    may make requests its key held back claimable (docs/queue.md, "Concurrency keys"): each
    sleeper of that workspace looks again (`pending_now`) rather than being told of work, since
    the held-back requests may be of other classes, or none."""

    def __init__(self, store: QueueStore) -> None:
        self._sleepers: set[_Sleeper] = set()
        self._unlisten = store.add_listener(self._on_event)
        self._released = False

    def release_all(self) -> None:
        """The server is shutting down: every idle worker's long poll ends now with "no work",
        and so does any that arrives meanwhile. Left to its 2 s ceiling, each held the drain."""
        self._released = True
        for sleeper in self._sleepers:
            sleeper.pushed = True
            sleeper.wake.set()

    def close(self) -> None:
        self._unlisten()
        for sleeper in self._sleepers:
            sleeper.pushed = True
            sleeper.wake.set()

    def _on_event(self, event: RequestEvent) -> None:
        frees_a_slot = (
            event.row is not None
            and event.row.concurrency_key is not None
            and event.kind in ("done", "failed", "poisoned", "cancelled")
        )
        for sleeper in self._sleepers:
            if sleeper.workspaces is not None and event.workspace_id not in sleeper.workspaces:
                continue
            if event.status == "pending" and event.worker_class in sleeper.classes:
                sleeper.pushed = True
                sleeper.wake.set()
            elif frees_a_slot:
                sleeper.recheck = True
                sleeper.wake.set()

    async def wait(
        self,
        classes: frozenset[str],
        workspaces: frozenset[str] | None,
        patience: float,
        *,
        pending_now: Callable[[], Awaitable[bool]] | None = None,
    ) -> bool:
        """True if work for `classes` is pending: `pending_now()` says so (work already
        waiting, or after a concurrency key's slot freed), or work became pending within
        `patience` seconds.

        `pending_now` is asked once this wait listens, never before: work that becomes pending
        between the two is heard as a push, so none is missed (pinned by
        `tests/queue/test_queue_semantics.py`).
        """
        if self._released:
            return False
        sleeper = _Sleeper(classes, workspaces)
        self._sleepers.add(sleeper)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        try:
            if pending_now is not None and await pending_now():
                return not self._released
            while True:
                await asyncio.wait_for(sleeper.wake.wait(), max(0.0, deadline - loop.time()))
                if sleeper.pushed:
                    return not self._released
                sleeper.wake.clear()
                sleeper.recheck = False
                if pending_now is not None and await pending_now():
                    return not self._released
        except TimeoutError:
            return False
        finally:
            self._sleepers.discard(sleeper)
