"""The idempotency-key contract on PostgreSQL (each test in a fresh schema), plus what only a
shared database shows: instances on separate pools settle a key through the database alone, and
an owner is alive exactly as long as the database session holding its advisory lock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg import create_pool
from cv_server.pg.idempotency import PostgresIdempotencyStore, advisory_lock_key
from cv_server.queue import (
    IdempotencyStore,
    InProgress,
    Mismatch,
    Owned,
    StoredAnswer,
    StoredResponse,
)
from tests.contract.idempotency_contract import (
    FP,
    KEY,
    OTHER_FP,
    RETENTION,
    WS,
    IdempotencyContract,
    KillOwner,
    NewStore,
)
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres

_LOCK_HOLDERS = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid = $1 AND objid = $2
"""


async def lock_holders(pool: asyncpg.Pool, schema: str, workspace_id: str, key: str) -> list[int]:
    """The backends holding a key's advisory lock (a bigint lock shows as two 32-bit halves)."""
    lock = advisory_lock_key(schema, workspace_id, key) & 0xFFFF_FFFF_FFFF_FFFF
    async with pool.acquire() as conn:
        rows = await conn.fetch(_LOCK_HOLDERS, lock >> 32, lock & 0xFFFF_FFFF)
    return [row["pid"] for row in rows]


async def terminate_owner(pool: asyncpg.Pool, schema: str, workspace_id: str, key: str) -> None:
    """Kill the owner's backend from another connection, as PostgreSQL does to a session whose
    client vanished, and wait (up to 5 s) until it is gone and its locks with it."""
    (pid,) = await lock_holders(pool, schema, workspace_id, key)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)


class TestPostgresIdempotencyStore(IdempotencyContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[IdempotencyStore]:
        store = PostgresIdempotencyStore(pool, retention=RETENTION)
        yield store
        await store.close()

    @pytest.fixture
    def kill_owner(self, pool: asyncpg.Pool, schema: str) -> KillOwner:
        async def kill(workspace_id: str, key: str) -> None:
            await terminate_owner(pool, schema, workspace_id, key)

        return kill

    @pytest.fixture
    async def new_store(self, pool: asyncpg.Pool) -> AsyncIterator[NewStore]:
        opened: list[PostgresIdempotencyStore] = []

        def new_store(**kwargs: Any) -> IdempotencyStore:
            opened.append(PostgresIdempotencyStore(pool, **kwargs))
            return opened[-1]

        yield new_store
        for store in opened:
            await store.close()


async def test_first_requests_on_separate_pools_own_the_key_exactly_once(
    postgres_url: str, schema: str, pool: asyncpg.Pool
) -> None:
    other = await create_pool(postgres_url, settings_for(schema))
    try:
        stores = [
            PostgresIdempotencyStore(pool, retention=RETENTION),
            PostgresIdempotencyStore(other, retention=RETENTION),
        ]
        outcomes = await asyncio.gather(*(stores[i % 2].begin(WS, KEY, FP, 1.0) for i in range(40)))
        assert outcomes.count(Owned()) == 1
        assert outcomes.count(InProgress()) == 39
        # The owner may be either store: finish on both (the one that does not own the key
        # completes it on a fresh connection; the owner's lock is released by its close below).
        await stores[0].finish(WS, KEY, FP, StoredResponse(202, {"id": "r_1"}), 2.0)
        assert await stores[1].begin(WS, KEY, FP, 3.0) == StoredAnswer(202, {"id": "r_1"})
    finally:
        for store in stores:  # an owner holds a connection: the pool closes only once it is back
            await store.close()
        await other.close()


async def test_an_owner_on_a_dead_instance_is_taken_over_by_one_retry_on_another(
    postgres_url: str, schema: str, pool: asyncpg.Pool
) -> None:
    """The crash the bug was about: the owner's whole pool (its instance) goes away."""
    dead = await create_pool(postgres_url, settings_for(schema))
    try:
        owner = PostgresIdempotencyStore(dead, retention=RETENTION)
        assert await owner.begin(WS, KEY, FP, 1.0) == Owned()
        assert len(await lock_holders(pool, schema, WS, KEY)) == 1
    finally:
        dead.terminate()  # no release, no close: the connections just vanish
    survivors = [PostgresIdempotencyStore(pool, retention=RETENTION) for _ in range(2)]
    # The backend ends when it sees its client gone; a retry before that is told to wait.
    # Polled: nothing announces it. The bound only catches a backend that never ends.
    async with asyncio.timeout(30):
        while await lock_holders(pool, schema, WS, KEY):  # noqa: ASYNC110  (a state)
            await asyncio.sleep(0.05)
    outcomes = await asyncio.gather(*(survivors[i % 2].begin(WS, KEY, FP, 2.0) for i in range(20)))
    assert outcomes.count(Owned()) == 1
    assert outcomes.count(InProgress()) == 19
    for store in survivors:
        await store.close()


async def test_a_death_frees_only_the_dead_owner_s_key_and_keeps_its_fingerprint(
    schema: str, pool: asyncpg.Pool
) -> None:
    store = PostgresIdempotencyStore(pool, retention=RETENTION)
    try:
        await store.begin(WS, KEY, FP, 1.0)
        await store.begin(WS, "other-key", FP, 1.0)
        await terminate_owner(pool, schema, WS, "other-key")
        assert await store.begin(WS, KEY, FP, 2.0) == InProgress()
        # Taken over in place: the key still belongs to the request that first used it.
        assert await store.begin(WS, "other-key", OTHER_FP, 2.0) == Mismatch()
        assert await store.begin(WS, "other-key", FP, 2.0) == Owned()
    finally:
        await store.close()


async def test_finish_abandon_and_release_let_go_of_the_lock(
    schema: str, pool: asyncpg.Pool
) -> None:
    store = PostgresIdempotencyStore(pool, retention=RETENTION)
    try:
        for key in ("finished", "abandoned", "released"):
            assert await store.begin(WS, key, FP, 1.0) == Owned()
            assert len(await lock_holders(pool, schema, WS, key)) == 1
        await store.finish(WS, "finished", FP, StoredResponse(202, {"ok": 1}), 2.0)
        assert await store.abandon(WS, "abandoned", 2.0)
        released = await store.begin(WS, "released", FP, 2.0)
        assert released == InProgress()  # still held by its owner
        for key in ("finished", "abandoned"):
            assert await lock_holders(pool, schema, WS, key) == []
        # A free lock on a completed key takes nothing over: the answer is replayed.
        assert await store.begin(WS, "finished", FP, 3.0) == StoredAnswer(202, {"ok": 1})
    finally:
        await store.close()
    # `close` released the owner still running: its key is free to a retry.
    assert await lock_holders(pool, schema, WS, "released") == []
    other = PostgresIdempotencyStore(pool, retention=RETENTION)
    assert await other.begin(WS, "released", FP, 4.0) == Owned()
    await other.close()
    assert await lock_holders(pool, schema, WS, "released") == []


def test_a_pool_too_small_to_hold_a_key_and_run_its_effect_is_refused() -> None:
    class OneConnection:
        def get_max_size(self) -> int:
            return 1

    with pytest.raises(ValueError, match="at least 2"):
        PostgresIdempotencyStore(OneConnection(), retention=RETENTION)
