"""The websocket's reconnect policy as pure rules (`cv_workspace_client._reconnect`): which refused
upgrades are final, when the waits start over, and how long each wait may be. The same rules
through a real socket and `FaultProxy` are in `test_reconnect_backoff.py`."""

from __future__ import annotations

import itertools

import pytest

from cv_workspace_client import ClientConfig, ReconnectPolicy
from cv_workspace_client._reconnect import AFTER_DROP_SECONDS
from cv_workspace_client._retry import reconnect_policy_for


def ceiling(low: float, high: float) -> float:
    """A jitter source that always draws the top of the range: the waits' caps."""
    assert low == 0.0
    return high


def policy(**overrides: object) -> ReconnectPolicy:
    values: dict[str, object] = {"backoff": lambda failures: float(failures), "uniform": ceiling}
    values.update(overrides)
    return ReconnectPolicy(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 426])
def test_a_refused_upgrade_with_a_4xx_is_final(status: int) -> None:
    assert ReconnectPolicy.is_final(status)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 302])
def test_a_refused_upgrade_that_may_pass_later_is_retried(status: int) -> None:
    assert not ReconnectPolicy.is_final(status)


def test_a_connection_that_delivered_data_resets_the_waits() -> None:
    assert ReconnectPolicy.resets(delivered=True, close_code=1000, broke_protocol=False)
    assert ReconnectPolicy.resets(delivered=True, close_code=None, broke_protocol=False)
    assert ReconnectPolicy.resets(delivered=True, close_code=1006, broke_protocol=False)


@pytest.mark.parametrize(
    ("delivered", "close_code", "broke_protocol"),
    [
        (False, 1000, False),
        (True, 1011, False),
        (True, 1013, False),
        (True, 1014, False),
        (True, 1000, True),
    ],
    ids=["delivered_nothing", "internal_error", "try_again_later", "bad_gateway", "breach"],
)
def test_a_connection_that_proved_nothing_does_not_reset_the_waits(
    delivered: bool, close_code: int, broke_protocol: bool
) -> None:
    assert not ReconnectPolicy.resets(
        delivered=delivered, close_code=close_code, broke_protocol=broke_protocol
    )


def test_after_a_drop_the_waits_follow_the_dropped_listener_schedule_then_double_to_the_cap() -> (
    None
):
    waits = list(itertools.islice(policy(cap=40.0).delays(dropped=True), 7))
    assert waits == [2.0, 5.0, 10.0, 20.0, 40.0, 40.0, 40.0]


def test_before_any_connection_delivered_the_waits_are_the_retry_backoff() -> None:
    waits = list(itertools.islice(policy().delays(dropped=False), 4))
    assert waits == [1.0, 2.0, 3.0, 4.0]


def test_a_streak_of_short_connections_that_delivered_never_waits_past_the_first_step() -> None:
    # A lossy link: every connection delivers a few frames and is cut. The socket starts a fresh
    # sequence after each one, so every wait is the schedule's first step however long the
    # streak; counted as failures, the waits climbed the retry backoff towards its cap.
    rules = policy(backoff=lambda failures: 2.0 ** (failures - 1))
    delays = rules.delays(dropped=False)
    waits: list[float] = []
    for _ in range(50):
        if rules.resets(delivered=True, close_code=1006, broke_protocol=False):
            delays = rules.delays(dropped=True)
        waits.append(next(delays))
    assert waits == [AFTER_DROP_SECONDS[0]] * 50


def test_a_drop_followed_by_refused_connects_walks_the_schedule() -> None:
    delays = policy().delays(dropped=True)
    assert [next(delays) for _ in range(3)] == [2.0, 5.0, 10.0]


def test_the_jitter_is_full_between_zero_and_the_step() -> None:
    draws: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        draws.append((low, high))
        return (low + high) / 2

    waits = list(itertools.islice(policy(uniform=uniform).delays(dropped=True), 2))
    assert draws == [(0.0, 2.0), (0.0, 5.0)]
    assert waits == [1.0, 2.5]


def test_the_default_jitter_stays_within_each_step() -> None:
    rules = ReconnectPolicy(backoff=lambda failures: 0.0)
    for _ in range(200):
        first, second = itertools.islice(rules.delays(dropped=True), 2)
        assert 0.0 <= first <= 2.0
        assert 0.0 <= second <= 5.0


def test_the_client_builds_its_policy_from_its_config() -> None:
    config = ClientConfig(retry_cap_seconds=7.0, reconnect_after_drop_seconds=(0.5, 3.0))
    rules = reconnect_policy_for(config)
    assert rules.after_drop == (0.5, 3.0)
    assert rules.cap == 7.0
    injected = policy()
    assert reconnect_policy_for(ClientConfig(reconnect_policy=injected)) is injected


@pytest.mark.parametrize("after_drop", [(), (-1.0,)])
def test_a_schedule_without_steps_or_with_a_negative_one_is_refused(
    after_drop: tuple[float, ...],
) -> None:
    with pytest.raises(ValueError, match="after_drop"):
        policy(after_drop=after_drop)
    with pytest.raises(ValueError, match="reconnect_after_drop_seconds"):
        ClientConfig(reconnect_after_drop_seconds=after_drop)
