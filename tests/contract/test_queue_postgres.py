"""The work-queue contract on PostgreSQL (each test in a fresh schema). `peer_store` is a second
instance: its own pool and its own instance id, on the same database, both listening on a
channel of the test's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.config import ServerConfig
from cv_server.pg import Notifier, create_pool
from cv_server.pg.blobs import PostgresBlobStore
from cv_server.pg.idempotency import PostgresIdempotencyStore
from cv_server.pg.queue import PostgresQueueStore
from cv_server.queue import BlobStore, EnqueueAsk, IdempotencyStore, QueueStore, RequestEvent
from tests.contract.claimable_contract import ClaimableContract
from tests.contract.concurrency_keys_contract import ConcurrencyKeysContract
from tests.contract.enqueue_many_contract import EnqueueManyContract
from tests.contract.queue_contract import QueueContract, request
from tests.contract.queue_lifecycle_contract import QueueLifecycleContract
from tests.contract.then_claim_contract import ThenClaimContract
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres

CONFIG = ServerConfig()


@pytest.fixture
async def notifier(postgres_url: str) -> AsyncIterator[Notifier]:
    notifier = Notifier(postgres_url)
    await notifier.start()
    yield notifier
    await notifier.close()


class TestPostgresQueueStore(
    QueueContract,
    ThenClaimContract,
    EnqueueManyContract,
    ClaimableContract,
    QueueLifecycleContract,
    ConcurrencyKeysContract,
):
    @pytest.fixture
    async def store(
        self, pool: asyncpg.Pool, schema: str, notifier: Notifier
    ) -> AsyncIterator[QueueStore]:
        store = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        await store.listen(notifier)
        yield store
        await store.close()

    @pytest.fixture
    async def peer_store(
        self, store: QueueStore, postgres_url: str, schema: str, notifier: Notifier
    ) -> AsyncIterator[QueueStore]:
        pool = await create_pool(postgres_url, settings_for(schema))
        peer = PostgresQueueStore(pool, channel=f"cv_queue_{schema}")
        await peer.listen(notifier)
        yield peer
        await peer.close()
        await pool.close()

    @pytest.fixture
    async def idempotency_store(
        self, store: QueueStore, pool: asyncpg.Pool
    ) -> AsyncIterator[IdempotencyStore]:
        keys = PostgresIdempotencyStore(pool, retention=CONFIG.idempotency_retention_seconds)
        yield keys
        await keys.close()

    @pytest.fixture
    async def blob_store(self, store: QueueStore, pool: asyncpg.Pool) -> BlobStore:
        return PostgresBlobStore(pool, retention=CONFIG.blob_retention_seconds)

    @pytest.fixture
    async def unbindable_store(
        self, store: QueueStore, pool: asyncpg.Pool, schema: str
    ) -> AsyncIterator[QueueStore]:
        # asyncpg cannot encode an arbitrary object as text: the claim statement raises after
        # the report's UPDATE ran in the same transaction.
        tokens = PostgresQueueStore(
            pool, channel=f"cv_queue_{schema}", new_token=lambda: cast(str, object())
        )
        yield tokens
        await tokens.close()

    async def test_a_cancel_is_heard_by_waiters_on_another_instance(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        row, _ = await store.enqueue(request(), 1.0)
        heard = asyncio.Event()
        peer_store.add_listener(
            lambda e: (
                heard.set() if (e.request_id, e.status) == (row.request_id, "cancelled") else None
            )
        )
        await store.cancel(row.request_id, 2.0)
        await asyncio.wait_for(heard.wait(), timeout=10)

    async def test_each_row_of_a_batch_is_heard_by_workers_on_another_instance(
        self, store: QueueStore, peer_store: QueueStore
    ) -> None:
        batch = [EnqueueAsk(request(job)) for job in ("a", "b", "a", "c")]
        heard: list[tuple[str, str]] = []
        all_heard = asyncio.Event()

        def listener(event: RequestEvent) -> None:
            heard.append((event.request_id, event.status))
            if len(heard) == 3:
                all_heard.set()

        peer_store.add_listener(listener)
        answers = await store.enqueue_many(batch, 1.0)
        await asyncio.wait_for(all_heard.wait(), timeout=10)
        new = [a.row.request_id for a in answers if not a.coalesced]
        assert heard == [(request_id, "pending") for request_id in new]
