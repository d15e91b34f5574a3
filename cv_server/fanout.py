"""Gap-free, duplicate-free delivery to one subscriber (docs/protocol.md). Pure: no I/O, no asyncio.

A subscription is registered *before* its catch-up read, so every op committed after the read
began arrives live; live ops that arrive during catch-up wait in `pending`. Delivery is keyed on
the clock: an op at or below `last` was already sent (skip it), one at `last + 1` is next (send
it), anything higher means something is missing (a lost notification, another instance's commit,
a publish overtaken by a later one) — so the subscription goes back to reading the log, which is
the source of truth. Nothing is ever re-applied; at worst a subscriber re-reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Cursor", "Frame"]


@dataclass(frozen=True, slots=True)
class Frame:
    """One committed op, already encoded as the websocket text frame every subscriber gets."""

    clock: int
    text: str
    #: `time.perf_counter()` at the commit, on a frame published live (None: read from the log):
    #: what `cv_broadcast_lag_seconds` measures from.
    stamp: float | None = None


class Cursor:
    """Where one subscriber stands. Feed it frames; it returns the frames to send, in order."""

    __slots__ = ("_forgot", "last", "live", "pending")

    def __init__(self, since: int) -> None:
        self.last = since
        #: False while reading the log (initially and after a gap); live frames then wait.
        self.live = False
        self.pending: deque[Frame] = deque()
        self._forgot = False

    def offer(self, frames: Iterable[Frame]) -> list[Frame]:
        """Live frames from a commit. Returns what to send now; may switch to catch-up mode
        (check `live` afterwards: False means the caller must read the log)."""
        if not self.live:
            self.pending.extend(frames)
            return []
        out: list[Frame] = []
        iterator = iter(frames)
        for frame in iterator:
            if frame.clock <= self.last:
                continue
            if frame.clock == self.last + 1:
                out.append(frame)
                self.last = frame.clock
                continue
            # A gap: whatever follows waits until the log has filled it.
            self.live = False
            self.pending.append(frame)
            self.pending.extend(iterator)
            break
        return out

    def from_log(self, frames: Iterable[Frame]) -> list[Frame]:
        """Frames read from the log (in clock order, all > the `since` of the read)."""
        out: list[Frame] = []
        for frame in frames:
            if frame.clock == self.last + 1:
                out.append(frame)
                self.last = frame.clock
            elif frame.clock > self.last + 1:
                raise AssertionError(f"log read skipped from {self.last} to {frame.clock}")
        return out

    def behind_horizon(self, first_clock: int | None, head: int) -> bool:
        """A log read after `last` answered `head` and entries starting at `first_clock` (None:
        no entry): True when the ops right after `last` are compacted away, so the subscriber
        must be sent the state instead (`reset_to`). The log of a sub-doc is the gap-free
        range [horizon, head], so its first entry is `last + 1` unless the log starts later."""
        if first_clock is None:
            return head > self.last
        return first_clock > self.last + 1

    def reset_to(self, clock: int) -> None:
        """The subscriber was sent the state at `clock` (a snapshot frame): the next op due is
        `clock + 1`. Live frames at or below it are dropped by `go_live`, as sent."""
        if clock < self.last:
            raise ValueError(f"a snapshot at clock {clock} is behind {self.last}, already sent")
        self.last = clock

    def behind(self, head: int) -> bool:
        """Another instance committed up to `head` (a notification without the ops): if that is
        news to a live cursor, switch to catch-up. Returns True when the caller must read."""
        if self.live and head > self.last:
            self.live = False
            return True
        return False

    def forget_pending(self) -> None:
        """Drop the live frames waiting during catch-up (the log has every one of them), to
        bound memory; the next `go_live` then asks for one more read, past them."""
        self.pending.clear()
        self._forgot = True

    def go_live(self) -> tuple[list[Frame], bool]:
        """After the log read reached its head: flush what arrived meanwhile.

        Returns (frames to send, live). If `live` is False a gap remains and the caller must read
        the log again before trying once more.
        """
        out: list[Frame] = []
        if self._forgot:
            # Frames were forgotten, maybe ones committed after that read's snapshot.
            self._forgot = False
            return out, False
        while self.pending:
            frame = self.pending[0]
            if frame.clock <= self.last:
                self.pending.popleft()
            elif frame.clock == self.last + 1:
                self.pending.popleft()
                out.append(frame)
                self.last = frame.clock
            else:
                return out, False
        self.live = True
        return out, True
