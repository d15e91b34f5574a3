"""The provider's retry policy: pure functions, no I/O, no clock."""

from __future__ import annotations

import email.utils

import aiohttp
import pytest

from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.providers import (
    ProviderError,
    ProviderRejected,
    ProviderResponseInvalid,
    ProviderRetry,
    ProviderUnavailable,
    RetryableStatus,
    is_retryable,
    parse_retry_after,
    retry_delay,
)


def test_the_default_policy_is_design_section_10_client_retry() -> None:
    policy = ProviderRetry()
    assert (policy.base_seconds, policy.cap_seconds, policy.attempts) == (1.0, 300.0, 5)
    assert policy == ProviderRetry.from_client_config(ClientConfig())


def test_the_policy_follows_a_tuned_client_config() -> None:
    config = ClientConfig(retry_base_seconds=0.5, retry_cap_seconds=9.0, retry_attempts=2)
    assert ProviderRetry.from_client_config(config) == ProviderRetry(0.5, 9.0, 2)


@pytest.mark.parametrize(
    "error",
    [
        ProviderError("x"),
        ProviderRejected("x", status=400),
        ProviderUnavailable("x", status=503, attempts=5),
        ProviderResponseInvalid("x", status=200),
    ],
)
def test_provider_errors_belong_to_the_sdk_hierarchy_and_are_not_retried_again(
    error: ProviderError,
) -> None:
    # The provider spent its own retry budget; the SDK must not multiply it.
    assert isinstance(error, WorkspaceError)
    assert error.retryable is False
    assert error.code == type(error).code
    assert error.code.startswith("provider_")


def test_full_jitter_ceilings_double_per_failure_up_to_the_cap() -> None:
    policy = ProviderRetry(base_seconds=1.0, cap_seconds=20.0)
    ceilings = [retry_delay(policy, n, uniform=1.0) for n in range(1, 8)]
    assert ceilings == [1.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0]


@pytest.mark.parametrize("uniform", [0.0, 0.25, 0.999])
def test_full_jitter_scales_the_ceiling_by_the_uniform_draw(uniform: float) -> None:
    policy = ProviderRetry(base_seconds=2.0)
    assert retry_delay(policy, 3, uniform) == pytest.approx(uniform * 8.0)


def test_retry_after_is_a_floor_clamped_to_the_cap() -> None:
    policy = ProviderRetry(base_seconds=1.0, cap_seconds=30.0)
    assert retry_delay(policy, 1, 0.0, retry_after=7.0) == 7.0
    assert retry_delay(policy, 5, 1.0, retry_after=2.0) == 16.0
    assert retry_delay(policy, 1, 0.0, retry_after=3600.0) == 30.0


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("12", now) == 12.0
    assert parse_retry_after(" 1.5 ", now) == 1.5
    assert parse_retry_after(email.utils.formatdate(now + 40, usegmt=True), now) == 40.0
    assert parse_retry_after(email.utils.formatdate(now - 40, usegmt=True), now) == 0.0
    assert parse_retry_after("-3", now) == 0.0
    for unreadable in (None, "soon", "", "nan", "inf"):
        assert parse_retry_after(unreadable, now) is None


def test_only_transient_failures_are_retryable() -> None:
    assert is_retryable(RetryableStatus(503, None, ""))
    assert is_retryable(RetryableStatus(429, 1.0, ""))
    assert is_retryable(aiohttp.ServerDisconnectedError())
    assert is_retryable(aiohttp.ClientPayloadError("cut short"))
    assert is_retryable(TimeoutError())
    assert not is_retryable(ProviderRejected("no", status=400))
    assert not is_retryable(ProviderResponseInvalid("garbage", status=200))
    assert not is_retryable(aiohttp.InvalidURL("x"))
    assert not is_retryable(ValueError("bug"))


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_seconds": -1.0}, {"cap_seconds": -1.0}])
def test_a_nonsensical_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ProviderRetry(**kwargs)  # type: ignore[arg-type]
