"""Gap-free, duplicate-free subscription resume, as a pure tracker (sans-I/O).

A subscription sees ops from several sources that overlap: the live stream, the server's catch-up
after a (re)subscribe with `since`, and the client's own HTTP catch-up when it notices a hole.
Clocks of one sub-doc are gap-free (docs/concepts.md), so the last delivered clock is the whole
state:

- clock <= last: already delivered → drop (a redelivery after reconnect, or a catch-up overlap);
- clock == last + 1: the next one → deliver and advance;
- clock > last + 1: something in between was lost (a dropped frame, a buffer overflow) → the
  shell must fetch `(last, clock)` first (`GAP`), then offer this op again.

On reconnect the shell resubscribes with `since=tracker.last` (or later, for ops it already
holds), and the tracker drops whatever overlaps.
"""

from __future__ import annotations

import enum

__all__ = ["ResumeTracker", "Verdict"]


class Verdict(enum.Enum):
    DELIVER = "deliver"
    DUPLICATE = "duplicate"
    GAP = "gap"


class ResumeTracker:
    """Tracks the last clock delivered to the app for one subscription."""

    __slots__ = ("_gap_at", "duplicates", "gaps", "last")

    def __init__(self, since: int = 0) -> None:
        if since < 0:
            raise ValueError("since must be >= 0")
        self.last = since
        self.duplicates = 0
        #: Holes found; one hole counts once, however many pages of the log it takes to fill.
        self.gaps = 0
        self._gap_at = 0

    def offer(self, clock: int) -> Verdict:
        """Judge an op at `clock`. `DELIVER` advances `last`; on `GAP` the caller fetches the ops
        after `last` up to `clock - 1` (offering each), then offers this one again."""
        if clock <= self.last:
            self.duplicates += 1
            return Verdict.DUPLICATE
        if clock == self.last + 1:
            self.last = clock
            return Verdict.DELIVER
        if clock != self._gap_at:
            self._gap_at = clock
            self.gaps += 1
        return Verdict.GAP

    def reset_to(self, clock: int) -> bool:
        """The server sent the state at `clock` in place of ops it compacted: deliver it (True,
        and `clock` is the last delivered) unless everything up to `clock` is delivered already
        (False: drop it)."""
        if clock <= self.last:
            self.duplicates += 1
            return False
        self.last = clock
        return True

    def retract(self, clock: int) -> None:
        """The op `offer` just delivered at `clock` could not be handed to the app after all (its
        frame was unreadable): it is due again, from another source."""
        if clock == self.last:
            self.last = clock - 1

    def behind(self, head: int) -> bool:
        """True when the server says the sub-doc is at `head` (a `synced` frame, a catch-up page)
        and ops up to it were not all delivered: the caller must catch up to `head`."""
        return head > self.last
