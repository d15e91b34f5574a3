"""The conflict retry policy, pure (docs/ops.md#conflicts): 25, 50, 100 ms, each times a factor
drawn from [0.5, 1.5], one wait before each retry."""

from __future__ import annotations

import pytest

from cv_workspace_client._core.conflicts import ConflictRetryPolicy, conflict_delays


def test_the_default_waits_are_the_three_backoffs_scaled_by_the_drawn_factor() -> None:
    drawn: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        drawn.append((low, high))
        return 1.5

    delays = list(conflict_delays(ConflictRetryPolicy(), uniform))
    assert delays == pytest.approx([0.0375, 0.075, 0.15])
    assert drawn == [(0.5, 1.5)] * 3
    assert ConflictRetryPolicy().max_runs == 4


def test_a_policy_without_backoffs_never_retries() -> None:
    policy = ConflictRetryPolicy(backoffs=())
    assert list(conflict_delays(policy)) == []
    assert policy.max_runs == 1


@pytest.mark.parametrize(
    "kwargs", [{"backoffs": (-0.1,)}, {"jitter": (1.5, 0.5)}, {"jitter": (-1.0, 1.0)}]
)
def test_a_policy_that_makes_no_sense_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="conflict"):
        ConflictRetryPolicy(**kwargs)  # type: ignore[arg-type]
