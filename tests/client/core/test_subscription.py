"""The pure resume tracker: duplicates dropped, gaps detected, resume point kept."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_workspace_client._core.subscription import ResumeTracker, Verdict

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit


def test_the_next_clock_is_delivered_and_advances_the_resume_point() -> None:
    tracker = ResumeTracker(since=4)
    assert tracker.offer(5) is Verdict.DELIVER
    assert tracker.last == 5


def test_clocks_at_or_below_the_resume_point_are_dropped_as_duplicates() -> None:
    tracker = ResumeTracker(since=3)
    assert tracker.offer(3) is Verdict.DUPLICATE
    assert tracker.offer(1) is Verdict.DUPLICATE
    assert tracker.last == 3
    assert tracker.duplicates == 2


def test_a_clock_past_the_next_one_is_a_gap_and_changes_nothing() -> None:
    tracker = ResumeTracker(since=3)
    assert tracker.offer(6) is Verdict.GAP
    assert tracker.last == 3
    assert tracker.gaps == 1
    assert tracker.offer(4) is Verdict.DELIVER


def test_a_synced_head_beyond_the_resume_point_means_catch_up() -> None:
    tracker = ResumeTracker(since=2)
    assert tracker.behind(3)
    assert not tracker.behind(2)


@given(
    head=st.integers(min_value=0, max_value=60),
    since=st.integers(min_value=0, max_value=60),
    deliveries=st.lists(st.integers(min_value=1, max_value=60), max_size=200),
)
def test_any_mix_of_replays_and_losses_plus_catch_up_yields_each_clock_once_in_order(
    head: int, since: int, deliveries: list[int]
) -> None:
    """Feed arbitrary (duplicated, reordered, lossy) clocks; fill every gap from a 'log' exactly
    as the shell does; the app must see since+1..head, each once, in order."""
    since = min(since, head)
    tracker = ResumeTracker(since=since)
    seen: list[int] = []
    for clock in [*(c for c in deliveries if c <= head), head]:
        if clock == 0:
            continue
        verdict = tracker.offer(clock)
        if verdict is Verdict.GAP:
            for missing in range(tracker.last + 1, clock):  # the catch-up read
                assert tracker.offer(missing) is Verdict.DELIVER
                seen.append(missing)
            verdict = tracker.offer(clock)
        if verdict is Verdict.DELIVER:
            seen.append(clock)
    assert seen == list(range(since + 1, head + 1))
    assert tracker.last == head


def test_a_hole_filled_over_several_log_pages_counts_as_one_gap() -> None:
    tracker = ResumeTracker(since=0)
    assert tracker.offer(9) is Verdict.GAP  # found
    assert tracker.offer(1) is Verdict.DELIVER  # the first page of the hole arrives
    assert tracker.offer(9) is Verdict.GAP  # judged again after that page: the same hole
    assert tracker.gaps == 1
    for clock in range(2, 10):
        assert tracker.offer(clock) is Verdict.DELIVER
    assert tracker.offer(12) is Verdict.GAP  # a new hole
    assert tracker.gaps == 2
