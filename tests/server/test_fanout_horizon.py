"""`fanout.Cursor` behind the horizon (pure): a log read that starts past `last + 1` means the ops
after `last` were compacted, and a snapshot moves the cursor to its clock, after which delivery
goes on gap-free and live frames the snapshot covers are dropped."""

from __future__ import annotations

import pytest

from cv_server.fanout import Cursor, Frame


def frame(clock: int) -> Frame:
    return Frame(clock, f"op {clock}")


def test_a_read_that_starts_past_the_next_clock_is_behind_the_horizon() -> None:
    cursor = Cursor(3)
    assert cursor.behind_horizon(first_clock=10, head=12)
    assert not cursor.behind_horizon(first_clock=4, head=12)
    assert not cursor.behind_horizon(first_clock=None, head=3)
    assert cursor.behind_horizon(first_clock=None, head=5)


def test_after_a_snapshot_delivery_resumes_after_its_clock_and_drops_what_it_covers() -> None:
    cursor = Cursor(3)
    cursor.offer([frame(11), frame(12), frame(13)])  # live, while catching up: pending
    cursor.reset_to(12)
    assert [f.clock for f in cursor.from_log([frame(13)])] == [13]
    out, live = cursor.go_live()
    assert (out, live) == ([], True)
    assert [f.clock for f in cursor.offer([frame(14)])] == [14]


def test_a_snapshot_behind_what_was_sent_is_refused() -> None:
    cursor = Cursor(8)
    with pytest.raises(ValueError, match="behind"):
        cursor.reset_to(5)
