"""`Subscription`: the async iterator `WorkspaceClient.subscribe` returns.

It yields every committed op of one sub-doc after `since`, in clock order, each clock exactly once,
across reconnects, server-side resets (close 4008) and its own buffer overflowing. Where the ops
after the last clock were compacted away, it yields a `Snapshot` (the state at a clock) instead,
then the ops after that clock. The judging is done by the pure `ResumeTracker`; this shell only
buffers frames and fetches holes from the log.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from cv_mutations import InvalidOp, SubDocState, parse_op
from cv_workspace_client._core.subscription import ResumeTracker, Verdict
from cv_workspace_client._core.wire import commit_time
from cv_workspace_client.errors import InvalidRequestError, ProtocolError, WorkspaceError
from cv_workspace_client.models import Committed, Snapshot

__all__ = ["PARSED", "Subscription", "parse_frame_op"]

#: Where `parse_frame_op` leaves a frame's parsed `Committed` (not a key the server sends).
PARSED = "\x00committed"

#: Subscriptions whose consumer is parked waiting for a frame. The client holds subscriptions
#: weakly (one dropped without `aclose()` is released), and a parked consumer task that the app
#: did not keep is referenced by nothing but its subscription's waiter: this holds them, as the
#: event loop holds a task that waits on a socket.
_parked: set[Subscription] = set()


class StreamOwner(Protocol):
    def register(self, sub: Subscription) -> None: ...

    def unregister(self, sub: Subscription) -> None: ...

    async def read_log(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, Sequence[Committed | Snapshot]]:
        """The head and the entries after `since`; when the log was compacted past `since`,
        one `Snapshot` (the state) in their place."""
        ...


class Subscription:
    """Committed ops of `workspace_id/sub_doc` after `since`. Use as `async for committed in sub`;
    leave with `break` then `await sub.aclose()`, or `async with client.subscribe(...) as sub`.
    One left without `aclose()` and no longer referenced is released all the same (its buffer,
    and the server's feed once no other subscription needs it).

    `clock` is the last clock handed to the app: to resume in a later process, subscribe again
    with `since=sub.clock`.
    """

    def __init__(
        self,
        owner: StreamOwner,
        workspace_id: str,
        sub_doc: str,
        *,
        since: int,
        buffer: int,
        page: int,
    ) -> None:
        self.workspace_id = workspace_id
        self.sub_doc = sub_doc
        self._owner = owner
        self._tracker = ResumeTracker(since)
        self._buffer = buffer
        self._page = page
        #: Highest live clock buffered: where a resubscribe can resume without refetching.
        self._received = since
        self._frames: deque[dict[str, Any]] = deque()
        self._ready: deque[Committed | Snapshot] = deque()
        self._lagging = False
        #: Live frames dropped because the buffer was full (then fetched from the log instead).
        self.frames_dropped = 0
        self._error: WorkspaceError | None = None
        self._ended = False
        self._registered = False
        self._waiter: asyncio.Future[None] | None = None
        #: The catch-up read under way, if any (`end` cancels it).
        self._reading: asyncio.Future[tuple[int, Sequence[Committed | Snapshot]]] | None = None

    # -- app side ----------------------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The clock of the last op yielded (or `since` before the first)."""
        return self._tracker.last

    @property
    def duplicates_dropped(self) -> int:
        return self._tracker.duplicates

    @property
    def gaps_filled(self) -> int:
        return self._tracker.gaps

    def __aiter__(self) -> Subscription:
        return self

    async def __aenter__(self) -> Subscription:
        self._register()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop receiving; the iterator ends."""
        # The app asked to stop: what is still buffered is not handed out afterwards (nor
        # caught up from the log), as after an async generator's aclose().
        self._frames.clear()
        self._ready.clear()
        self._lagging = False
        self.end()
        if self._registered:
            self._owner.unregister(self)

    async def __anext__(self) -> Committed | Snapshot:
        self._register()
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._frames:
                frame = self._frames.popleft()
                clock = frame["clock"]
                if frame.get("type") == "snapshot":
                    if self._tracker.reset_to(clock):
                        try:
                            return Snapshot(clock, SubDocState.from_json(frame.get("state")))
                        except (KeyError, TypeError, ValueError) as exc:
                            raise ProtocolError(
                                "bad_frame", f"{self.sub_doc}: unreadable snapshot: {exc}"
                            ) from None
                    continue
                if frame.get("type") == "synced":
                    if self._tracker.behind(clock):
                        if await self._read_page():
                            # More to fetch up to that head: the next page once this one is
                            # taken.
                            self._frames.appendleft(frame)
                    elif clock < self._tracker.last:
                        # The server says its head is behind what it already sent: it lost
                        # those clocks (restored from an older copy), and the ops it commits
                        # next at them would be dropped here as already seen. Or the frame is
                        # stale (a previous subscription's): the log tells which, and the read
                        # refuses a head behind the last clock delivered.
                        await self._read_page()
                    continue
                verdict = self._tracker.offer(clock)
                if verdict is Verdict.DELIVER:
                    committed = frame.get(PARSED)
                    if isinstance(committed, Committed):
                        return committed
                    try:
                        return _committed(frame)
                    except (InvalidOp, KeyError, TypeError, ValueError):
                        # The frame's op cannot be read (mangled on the way, say): this clock
                        # is not delivered, and is taken from the log instead. Raising the
                        # parse error with the clock counted as delivered skipped it for good.
                        self._tracker.retract(clock)
                        await self._read_page()
                        if self._tracker.last < clock:
                            raise ProtocolError(
                                "bad_frame",
                                f"{self.sub_doc}: the op at clock {clock} could not be read",
                            ) from None
                        continue
                if verdict is Verdict.GAP:
                    # Something between was lost: fetch it from the log (a page at a time), then
                    # judge this again.
                    self._frames.appendleft(frame)
                    before = self._tracker.last
                    await self._read_page()
                    if self._tracker.last == before:
                        raise ProtocolError(
                            "gap_unfillable",
                            f"{self.sub_doc}: ops after clock {before} are missing from the log",
                        )
                continue
            if self._lagging:
                # Catch up to the head one page at a time, each read only once the app has taken
                # the previous page: reading the whole backlog at once would hold all of it in
                # memory, which the bounded buffer exists to avoid.
                # Cleared before the read: `feed` or a reconnect may mark the subscription lagging
                # again while it is under way, and that mark must survive the read's answer.
                self._lagging = False
                try:
                    more = await self._read_page(full_only=True)
                except BaseException:
                    # The read did not deliver (the app's task cancelled mid-read, by its own
                    # `wait_for` timeout say): the catch-up is still due. Left cleared, the
                    # subscription waited for a live frame to expose the hole, and none may come.
                    self._lagging = True
                    raise
                if more:
                    self._lagging = True
                continue
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            _parked.add(self)
            try:
                await self._waiter
            finally:
                self._waiter = None
                _parked.discard(self)

    # -- socket side -------------------------------------------------------------------------------

    def resume_since(self) -> int:
        """The clock a (re)subscribe may start after: everything up to it is delivered or
        buffered."""
        return max(self._received, self._tracker.last)

    def feed(self, frame: dict[str, Any]) -> None:
        """An `op`, `snapshot` or `synced` frame for this sub-doc arrived; its `clock` is an int
        (the socket checked it, once for every subscription it feeds the frame to)."""
        if self._ended:
            return
        clock: int = frame["clock"]
        if len(self._frames) >= self._buffer:
            # Bounded memory: drop live frames and fill the hole from the log once drained.
            self._lagging = True
            self.frames_dropped += 1
        else:
            self._frames.append(frame)
            if frame.get("type") in ("op", "snapshot") and not self._lagging:
                self._received = max(self._received, clock)
        self._wake()

    def mark_lagging(self) -> None:
        """Catch up from the log (to the head) as soon as the buffer is drained."""
        self._lagging = True
        self._wake()

    def fail(self, error: WorkspaceError) -> None:
        """End the iteration with `error` once what is buffered has been yielded."""
        self._error = error
        self._wake()

    def end(self) -> None:
        self._ended = True
        if self._reading is not None:
            self._reading.cancel()
        self._wake()

    # -- internals ---------------------------------------------------------------------------------

    def _register(self) -> None:
        if not self._registered and not self._ended:
            self._registered = True
            self._owner.register(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _read_page(self, *, full_only: bool = False) -> bool:
        """Read one page of the log after the last delivered clock, queueing what is new. True
        if it delivered something (with `full_only`: and the page was full, so more may follow).
        One page per call: `_ready` never holds more than `catchup_page` ops."""
        # Once ended (the client closed, `aclose` from another task), a read can only fail or
        # hold the app up: the app iterating got the client's `RuntimeError` (session gone), or
        # waited out a retry delay of up to `retry_cap_seconds` (reads are retried forever here)
        # before it saw the end of the iteration. `end()` cancels the read; what is already
        # delivered stays delivered.
        if self._ended:
            raise StopAsyncIteration
        reading = asyncio.ensure_future(
            self._owner.read_log(self.workspace_id, self.sub_doc, self._tracker.last, self._page)
        )
        self._reading = reading
        try:
            head, entries = await reading
        except (Exception, asyncio.CancelledError):
            current = asyncio.current_task()
            if self._ended and (current is None or not current.cancelling()):
                raise StopAsyncIteration from None
            raise  # the app's own task is being cancelled, or a real error
        finally:
            self._reading = None
        if head < self._tracker.last:
            # The log ends before what this subscription already holds (a `since` naming clocks
            # that do not exist, or a server restored from an older copy): ops later committed
            # at those clocks would be skipped as already seen. Refused, as the server refuses
            # such a subscribe.
            raise InvalidRequestError(
                "invalid_field", f"since {self._tracker.last} is past the head clock {head}"
            )
        progressed = False
        for entry in entries:
            if isinstance(entry, Snapshot):
                if self._tracker.reset_to(entry.clock):
                    self._ready.append(entry)
                    progressed = True
                continue
            verdict = self._tracker.offer(entry.clock)
            if verdict is Verdict.DELIVER:
                self._ready.append(entry)
                progressed = True
            elif verdict is Verdict.GAP:
                raise ProtocolError(
                    "log_gap",
                    f"{self.sub_doc}: the log skips from {self.clock} to {entry.clock}",
                )
        return progressed and (not full_only or len(entries) >= self._page)


def parse_frame_op(frame: dict[str, Any]) -> None:
    """Parse an `op` frame's op once, for every subscription the frame is fed to (several
    subscriptions to one sub-doc share a socket). A frame that fails to parse is left alone: each
    subscription then raises the error when it reaches the frame."""
    # Not contextlib.suppress: this runs once per delivered op, and a bare try costs nothing.
    try:  # noqa: SIM105
        frame[PARSED] = _committed(frame)
    except (InvalidOp, KeyError, TypeError, ValueError):
        pass


def _committed(frame: dict[str, Any]) -> Committed:
    op_id = frame.get("op_id")
    return Committed(
        clock=frame["clock"],
        op_id=op_id if isinstance(op_id, str) else None,
        op=parse_op(frame.get("op")),
        committed_at=commit_time(frame.get("committed_at")),
    )
