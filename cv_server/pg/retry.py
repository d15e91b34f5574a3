"""The serialization-failure retry policy (docs/configuration.md, docs/postgres.md).

PostgreSQL answers `40001` (serialization_failure) and `40P01` (deadlock_detected) when running
the transaction again may succeed; nothing else is worth retrying here. The retry wraps the
*whole* transaction from outside: once a statement failed, the transaction is aborted and every
later statement in it would only return `25P02`. So the retried function must be safe to run
again end to end: database work and pure computation only, no network I/O, no publishing.

Seed 004 reads "Max 3 attempts. Backoff: 25ms, 50ms, 100ms, each x random(0.5, 1.5)": three
backoffs, one before each of the three retry attempts (as its client table gives one delay per
attempt), so the function runs at most four times. The decision (`retry_delays`, `is_retryable`)
is pure; `run_with_retry` is the thin asyncio shell, with `sleep` and `uniform` injectable.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

__all__ = [
    "RETRYABLE_SQLSTATES",
    "SerializationRetryPolicy",
    "in_transaction",
    "is_retryable",
    "retry_delays",
    "run_with_retry",
]

T = TypeVar("T")

#: serialization_failure, deadlock_detected: the only codes a re-run can cure.
RETRYABLE_SQLSTATES: Final = frozenset({"40001", "40P01"})

Isolation = Literal["read_committed", "repeatable_read", "serializable"]


@dataclass(frozen=True, slots=True)
class SerializationRetryPolicy:
    """Seed 004's constants; tests may shrink the backoffs."""

    #: One backoff per retry attempt, in seconds.
    backoffs: tuple[float, ...] = (0.025, 0.050, 0.100)
    #: Each backoff is multiplied by a factor drawn uniformly from this range.
    jitter: tuple[float, float] = (0.5, 1.5)

    @property
    def max_runs(self) -> int:
        return len(self.backoffs) + 1


def is_retryable(exc: BaseException) -> bool:
    """True when `exc` is a PostgreSQL error whose SQLSTATE says "run the transaction again"."""
    return isinstance(exc, asyncpg.PostgresError) and exc.sqlstate in RETRYABLE_SQLSTATES


def retry_delays(
    policy: SerializationRetryPolicy,
    uniform: Callable[[float, float], float] = random.uniform,
) -> Iterator[float]:
    """The sleep before each retry attempt, in order; exhausted means "give up"."""
    low, high = policy.jitter
    for backoff in policy.backoffs:
        yield backoff * uniform(low, high)


async def run_with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: SerializationRetryPolicy | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    uniform: Callable[[float, float], float] = random.uniform,
) -> T:
    """Await `fn()`; on a retryable error, back off and await it again, up to the policy's limit.

    Any other exception, or a retryable one after the last attempt, propagates unchanged.
    """
    delays = retry_delays(policy or SerializationRetryPolicy(), uniform)
    while True:
        try:
            return await fn()
        except asyncpg.PostgresError as exc:
            if not is_retryable(exc):
                raise
            delay = next(delays, None)
            if delay is None:
                raise
        await sleep(delay)


async def in_transaction(
    pool: asyncpg.Pool,
    fn: Callable[[asyncpg.Connection], Awaitable[T]],
    *,
    isolation: Isolation = "read_committed",
    policy: SerializationRetryPolicy | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    uniform: Callable[[float, float], float] = random.uniform,
) -> T:
    """Run `fn(conn)` inside a fresh transaction on a pooled connection, retried as a whole.

    The connection goes back to the pool between attempts, so a retry never waits on a
    connection that still holds the failed attempt's locks.
    """

    async def attempt() -> T:
        async with pool.acquire() as conn, conn.transaction(isolation=isolation):
            return await fn(conn)

    return await run_with_retry(attempt, policy=policy, sleep=sleep, uniform=uniform)
