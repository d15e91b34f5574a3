"""The token-revocation contract on PostgreSQL (each test in a fresh schema)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.pg.revocations import PostgresRevocationStore
from cv_server.revocations import RevocationStore
from tests.contract.revocations_contract import RevocationsContract

pytestmark = pytest.mark.postgres


class TestPostgresRevocationStore(RevocationsContract):
    @pytest.fixture
    async def store(self, pool: asyncpg.Pool) -> AsyncIterator[RevocationStore]:
        store = PostgresRevocationStore(pool, channel="cv_token_revoked_contract")
        yield store
        await store.close()
