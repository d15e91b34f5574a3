"""Retry policy wiring: tenacity's full-jitter wait for both the op machine's delay generator and
the retried reads, and the one "is this retryable?" rule (docs/client.md).

Only errors that may succeed later are retried: connection errors, timeouts, 5xx and 429 (a
Retry-After that came with a 429 or a 5xx wins over the jitter). A 4xx is an answer, never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)

from cv_workspace_client._core.reconnect import ReconnectPolicy
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import WorkspaceError

__all__ = ["backoff_for", "is_retryable", "log_retry", "reconnect_policy_for", "retrying"]

#: Every retry is said here at WARNING: a call that waits out a server that is down is never
#: silent (`cv-workspace` prints these lines on stderr).
retry_log = logging.getLogger("cv_workspace_client.retry")


def log_retry(exc: BaseException, failures: int, attempts: int | None, delay: float) -> None:
    """Say that a call failed for the `failures`-th time with a retryable `exc` and is tried
    again in `delay` seconds (`attempts` in all; None: until it succeeds)."""
    of = f" of {attempts}" if attempts is not None else ""
    retry_log.warning("%s; try %d%s in %.1f s", " ".join(str(exc).split()), failures + 1, of, delay)


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, WorkspaceError) and exc.retryable


def backoff_for(config: ClientConfig) -> Callable[[int], float]:
    """The delay before attempt `n + 1` after `n` failures: `config.backoff` if set, otherwise
    tenacity's full jitter `random(0, min(cap, base * 2 ** (n - 1)))`."""
    if config.backoff is not None:
        return config.backoff
    wait = wait_random_exponential(
        multiplier=config.retry_base_seconds, max=config.retry_cap_seconds
    )
    state = RetryCallState(retry_object=AsyncRetrying(), fn=None, args=(), kwargs={})

    def backoff(failures: int) -> float:
        state.attempt_number = max(1, failures)
        return float(wait(state))

    return backoff


def reconnect_policy_for(config: ClientConfig) -> ReconnectPolicy:
    """The websocket's reconnect policy: `config.reconnect_policy` if set, otherwise the retry
    backoff until a connection delivers data, and the dropped-listener schedule after one."""
    if config.reconnect_policy is not None:
        return config.reconnect_policy
    return ReconnectPolicy(
        backoff_for(config),
        after_drop=config.reconnect_after_drop_seconds,
        cap=config.retry_cap_seconds,
    )


def retrying(config: ClientConfig, *, forever: bool = False) -> AsyncRetrying:
    """A tenacity loop for one idempotent request (reads): retryable errors only, full jitter
    (or the server's Retry-After), `retry_attempts` tries, then the last error is re-raised.
    `forever` (subscription catch-up) keeps trying with the capped delay instead."""
    backoff = backoff_for(config)

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, WorkspaceError) and exc.retry_after is not None:
            delay = min(max(exc.retry_after, 0.0), config.retry_cap_seconds)
        else:
            delay = backoff(state.attempt_number)
        if exc is not None:
            log_retry(exc, state.attempt_number, None if forever else config.retry_attempts, delay)
        return delay

    return AsyncRetrying(
        stop=stop_never if forever else stop_after_attempt(config.retry_attempts),
        wait=wait,
        retry=retry_if_exception(is_retryable),
        sleep=config.sleep,
        reraise=True,
    )
