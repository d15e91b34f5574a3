"""Serialization failures (40001) and deadlocks (40P01) are retried; nothing else is."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import SerializationRetryPolicy, in_transaction, is_retryable, run_with_retry
from cv_server.pg.retry import retry_delays

pytestmark = pytest.mark.postgres


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def test_retry_delays_follow_the_seed_backoffs_scaled_by_the_jitter_factor() -> None:
    policy = SerializationRetryPolicy()
    assert list(retry_delays(policy, lambda low, high: low)) == pytest.approx([0.0125, 0.025, 0.05])
    assert list(retry_delays(policy, lambda low, high: high)) == pytest.approx(
        [0.0375, 0.075, 0.15]
    )
    for delay, backoff in zip(retry_delays(policy), policy.backoffs, strict=True):
        assert 0.5 * backoff <= delay <= 1.5 * backoff


def test_only_serialization_failures_and_deadlocks_are_retryable() -> None:
    assert is_retryable(asyncpg.SerializationError("x"))
    assert is_retryable(asyncpg.DeadlockDetectedError("x"))
    assert not is_retryable(asyncpg.UniqueViolationError("x"))
    assert not is_retryable(asyncpg.QueryCanceledError("x"))
    assert not is_retryable(ValueError("x"))


async def test_a_real_serialization_failure_reruns_the_whole_transaction(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE counters (id int PRIMARY KEY, v int NOT NULL)")
        await conn.execute("INSERT INTO counters VALUES (1, 0)")
    runs = 0

    async def bump(conn: asyncpg.Connection) -> int:
        nonlocal runs
        runs += 1
        value: int = await conn.fetchval("SELECT v FROM counters WHERE id = 1")
        if runs == 1:
            # A concurrent writer commits after our snapshot was taken.
            async with pool.acquire() as other:
                await other.execute("UPDATE counters SET v = v + 10 WHERE id = 1")
        await conn.execute("UPDATE counters SET v = $1 WHERE id = 1", value + 1)
        return value + 1

    sleep = RecordingSleep()
    result = await in_transaction(
        pool, bump, isolation="serializable", sleep=sleep, uniform=lambda low, high: 1.0
    )
    assert runs == 2
    assert result == 11
    assert sleep.delays == [0.025]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT v FROM counters WHERE id = 1") == 11


async def test_a_real_deadlock_victim_is_retried_and_both_transactions_commit(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE rows (id int PRIMARY KEY, v int NOT NULL)")
        await conn.execute("INSERT INTO rows VALUES (1, 0), (2, 0)")
    holding = {1: asyncio.Event(), 2: asyncio.Event()}
    committed = {1: asyncio.Event(), 2: asyncio.Event()}
    runs = {1: 0, 2: 0}

    def lock_in_order(first: int, second: int) -> Callable[[asyncpg.Connection], Awaitable[None]]:
        async def fn(conn: asyncpg.Connection) -> None:
            runs[first] += 1
            if runs[first] > 1:
                # The victim's retry starts once the survivor committed: it must not meet the
                # survivor's locks again (with no real backoff it could, and deadlock anew).
                await asyncio.wait_for(committed[second].wait(), timeout=5)
            await conn.execute("SET LOCAL deadlock_timeout = '50ms'")
            await conn.execute("UPDATE rows SET v = v + 1 WHERE id = $1", first)
            holding[first].set()
            await asyncio.wait_for(holding[second].wait(), timeout=5)
            await conn.execute("UPDATE rows SET v = v + 1 WHERE id = $1", second)

        return fn

    sleep = RecordingSleep()

    async def transfer(first: int, second: int) -> None:
        await in_transaction(pool, lock_in_order(first, second), sleep=sleep)
        committed[first].set()

    await asyncio.gather(transfer(1, 2), transfer(2, 1))
    assert sorted(runs.values()) == [1, 2]
    assert len(sleep.delays) == 1
    async with pool.acquire() as conn:
        assert await conn.fetch("SELECT v FROM rows ORDER BY id") == [(2,), (2,)]


async def test_any_other_database_error_is_raised_at_once(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE uniq (id int PRIMARY KEY)")
        await conn.execute("INSERT INTO uniq VALUES (1)")
    runs = 0

    async def duplicate(conn: asyncpg.Connection) -> None:
        nonlocal runs
        runs += 1
        await conn.execute("INSERT INTO uniq VALUES (1)")

    sleep = RecordingSleep()
    with pytest.raises(asyncpg.UniqueViolationError):
        await in_transaction(pool, duplicate, sleep=sleep)
    assert runs == 1
    assert sleep.delays == []


async def test_a_failure_that_persists_gives_up_after_three_retries() -> None:
    runs = 0

    async def always_conflicts() -> None:
        nonlocal runs
        runs += 1
        raise asyncpg.SerializationError("could not serialize access")

    sleep = RecordingSleep()
    with pytest.raises(asyncpg.SerializationError):
        await run_with_retry(always_conflicts, sleep=sleep, uniform=lambda low, high: 1.0)
    assert runs == 4
    assert sleep.delays == [0.025, 0.05, 0.1]


async def test_a_non_database_exception_is_never_retried() -> None:
    runs = 0

    async def broken() -> None:
        nonlocal runs
        runs += 1
        raise ValueError("bug")

    sleep = RecordingSleep()
    with pytest.raises(ValueError, match="bug"):
        await run_with_retry(broken, sleep=sleep)
    assert runs == 1
    assert sleep.delays == []
