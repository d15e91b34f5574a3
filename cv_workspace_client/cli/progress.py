"""What `cv-workspace` tells a person at a terminal while it works (stderr, never stdout, which
carries the answer): a request's status changes during `enqueue --wait` / `requests wait`, and a
progress line for bulk commands (`requests list --all`). Plain text, no dependency: the SDK stays
lean. On by default when stderr is a terminal (`--progress` / `--no-progress` decide otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO, Final

from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.queue_models import EnqueuedRequest, QueuedRequest

__all__ = ["Progress", "StatusWatch", "describe", "watch_status", "watching"]

#: How often a watched request is read: the idle poll of the workers (100 ms doubling to 2 s),
#: back to 100 ms after each change, so a change shows within 2 s and an idle wait costs one
#: read every 2 s.
POLL_FIRST_SECONDS: Final = 0.1
POLL_MAX_SECONDS: Final = 2.0


class Progress:
    """Lines on `stream` (stderr) when `enabled`. A bulk count rewrites one line in place on a
    terminal (`\\r`) and is printed once, at the end, elsewhere."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self._tty = enabled and self.stream.isatty()
        self._open_line = False

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        self._end_line()
        print(f"cv-workspace: {text}", file=self.stream, flush=True)

    def count(self, text: str) -> None:
        """A running figure (`fetched 300 requests`): rewritten in place on a terminal."""
        if not self._tty:
            return
        self.stream.write(f"\r\x1b[2Kcv-workspace: {text}")
        self.stream.flush()
        self._open_line = True

    def done(self, text: str) -> None:
        """The final figure of a bulk command."""
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r\x1b[2K")
            self._open_line = False
        self.say(text)

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False


def describe(row: QueuedRequest) -> str:
    """One status line of a request: `queued`, `claimed by w1 (attempt 2 of 5)`, `done in 1.2 s`."""
    status = row.status
    if status == "pending":
        text = "queued" if row.dequeue_count == 0 else "queued again (retry after a failure)"
    elif status == "in_progress":
        budget = f" of {row.max_dequeues}" if row.max_dequeues else ""
        text = f"claimed by {row.claimed_by or '?'} (attempt {row.dequeue_count}{budget})"
    elif status == "done":
        text = "done" if row.error is None else "done with an expected error"
        if row.claimed_at is not None and row.finished_at is not None:
            text += f" in {max(0.0, row.finished_at - row.claimed_at):.1f} s"
    else:
        text = f"{status} (dequeued {row.dequeue_count} times)"
    return f"{row.request_id} {text}"


class StatusWatch:
    """The status changes of one request, each told once: by the poller while the wait runs,
    and (`seen`) by the wait's own answer when it ends first."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._last: tuple[str, int, str | None] | None = None

    def enqueued(self, answer: EnqueuedRequest) -> None:
        """The enqueue's answer, told at once: a claim may follow before the first poll."""
        joined = " (coalesced into the request already there)" if answer.coalesced else ""
        if answer.status == "pending":
            self._last = ("pending", 0, None)
            self.progress.say(f"{answer.request_id} queued{joined}")
        else:
            self.progress.say(f"{answer.request_id} {answer.status}{joined}")

    def seen(self, row: QueuedRequest | None) -> bool:
        """Tell `row`'s status if it changed; True when the request is finished."""
        if row is None:
            return False
        key = (row.status, row.dequeue_count, row.claimed_by)
        if key != self._last:
            self._last = key
            self.progress.say(describe(row))
        return row.is_finished


async def watch_status(
    read: Callable[[], Awaitable[QueuedRequest]],
    watch: StatusWatch,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Tell each status change of the request `read` returns until it finishes or the task is
    cancelled (by the end of the wait it accompanies). A failed read is skipped: the wait
    itself reports what matters."""
    delay = POLL_FIRST_SECONDS
    while True:
        try:
            row: QueuedRequest | None = await read()
        except WorkspaceError:
            row = None
        before = watch._last
        if watch.seen(row):
            return
        if watch._last != before:
            delay = POLL_FIRST_SECONDS
        await sleep(delay)
        delay = min(POLL_MAX_SECONDS, delay * 2)


@contextlib.asynccontextmanager
async def watching(
    read: Callable[[], Awaitable[QueuedRequest]], progress: Progress
) -> AsyncIterator[StatusWatch]:
    """Poll the request's status for as long as the block runs (not at all when progress is
    off); the block passes the wait's final row to `StatusWatch.seen`."""
    watch = StatusWatch(progress)
    if not progress.enabled:
        yield watch
        return
    task = asyncio.create_task(watch_status(read, watch))
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
