"""The websocket's reconnect policy as pure rules (`cv_workspace_client._core.reconnect`): which
refused upgrades are final, when the waits start over, and how long each wait may be. The same rules
through a real socket and `FaultProxy` are in `tests/client/io/test_socket_reconnects.py`."""

from __future__ import annotations

import pytest

from cv_workspace_client import ClientConfig, ReconnectPolicy
from cv_workspace_client._core.reconnect import AFTER_DROP_SECONDS, Streak
from cv_workspace_client._io.retry import reconnect_policy_for


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


def dropped(rules: ReconnectPolicy) -> Streak:
    """The streak right after a connection that delivered data was cut."""
    return rules.ended(Streak(), delivered=True, close_code=1006, broke_protocol=False)


def silent_cut(rules: ReconnectPolicy, streak: Streak) -> Streak:
    """A connection that was upgraded and cut before its first frame."""
    return rules.ended(streak, delivered=False, close_code=1006, broke_protocol=False)


def test_after_a_drop_the_first_wait_is_the_first_step_of_the_schedule() -> None:
    rules = policy()
    streak = dropped(rules)
    assert streak == Streak(dropped=True, failures=1, setbacks=0)
    assert rules.delay(streak) == 2.0


def test_while_the_server_keeps_accepting_upgrades_the_waits_stay_at_the_last_step() -> None:
    # A lossy link that cuts connections before their first frame: the server is up.
    rules = policy()
    streak = dropped(rules)
    waits = []
    for _ in range(10):
        streak = silent_cut(rules, streak)
        waits.append(rules.delay(streak))
    assert waits == [5.0] * 10


def test_setbacks_past_the_schedule_double_the_wait_up_to_the_cap() -> None:
    # The server is down after a drop: connects refused, one after the other.
    rules = policy(cap=40.0)
    streak = dropped(rules)
    waits = [rules.delay(streak)]
    for _ in range(6):
        streak = rules.refused(streak)
        waits.append(rules.delay(streak))
    assert waits == [2.0, 5.0, 5.0, 10.0, 20.0, 40.0, 40.0]


@pytest.mark.parametrize(
    ("close_code", "broke_protocol"), [(1011, False), (1013, False), (1014, False), (1006, True)]
)
def test_a_server_error_close_or_a_breach_is_a_setback(
    close_code: int, broke_protocol: bool
) -> None:
    rules = policy()
    streak = dropped(rules)
    for _ in range(4):
        streak = rules.ended(
            streak, delivered=True, close_code=close_code, broke_protocol=broke_protocol
        )
    assert streak == Streak(dropped=True, failures=5, setbacks=4)
    assert rules.delay(streak) == 20.0


def test_an_upgrade_between_setbacks_brings_the_wait_back_to_the_schedule() -> None:
    rules = policy()
    streak = dropped(rules)
    for _ in range(5):
        streak = rules.refused(streak)
    assert rules.delay(streak) == 40.0
    assert rules.delay(silent_cut(rules, streak)) == 5.0


def test_the_wait_never_overflows_however_long_the_outage() -> None:
    rules = policy(cap=300.0)
    streak = Streak(dropped=True, failures=5000, setbacks=5000)
    assert rules.delay(streak) == 300.0


def test_before_any_connection_delivered_the_waits_are_the_retry_backoff() -> None:
    rules = policy()
    streak = Streak()
    waits = []
    for _ in range(2):
        streak = rules.refused(streak)
        waits.append(rules.delay(streak))
    for _ in range(2):
        streak = silent_cut(rules, streak)
        waits.append(rules.delay(streak))
    assert waits == [1.0, 2.0, 3.0, 4.0]
    assert rules.delay(Streak()) == 0.0


def test_a_streak_of_short_connections_that_delivered_never_waits_past_the_first_step() -> None:
    # A lossy link: every connection delivers a few frames and is cut. Each one starts the
    # waits over, so every wait is the schedule's first step however long the streak; counted
    # as failures, the waits climbed the retry backoff towards its cap.
    rules = policy(backoff=lambda failures: 2.0 ** (failures - 1))
    streak = Streak()
    waits = []
    for _ in range(50):
        streak = rules.ended(streak, delivered=True, close_code=None, broke_protocol=False)
        waits.append(rules.delay(streak))
    assert waits == [AFTER_DROP_SECONDS[0]] * 50


def test_the_jitter_is_full_between_zero_and_the_step() -> None:
    draws: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        draws.append((low, high))
        return (low + high) / 2

    rules = policy(uniform=uniform)
    streak = dropped(rules)
    waits = [rules.delay(streak), rules.delay(rules.refused(streak))]
    assert draws == [(0.0, 2.0), (0.0, 5.0)]
    assert waits == [1.0, 2.5]


def test_the_default_jitter_stays_within_each_step() -> None:
    rules = ReconnectPolicy(backoff=lambda failures: 0.0)
    streak = dropped(rules)
    for _ in range(200):
        assert 0.0 <= rules.delay(streak) <= 2.0
        assert 0.0 <= rules.delay(rules.refused(streak)) <= 5.0


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
