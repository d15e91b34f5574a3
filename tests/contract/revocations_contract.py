"""The token-revocation contract (cv_server/revocations.py), written once and run against every
backend: a backend's test class overrides the `store` fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cv_server.revocations import RevocationStore

A = "1000-" + "a" * 24
B = "2000-" + "b" * 24
NEVER = "never-" + "c" * 24


class RevocationsContract:
    """Every `RevocationStore` keeps these rules."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[RevocationStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_a_revocation_reads_back_after_the_last_seq_seen(
        self, store: RevocationStore
    ) -> None:
        assert await store.revoked_since(0) == []
        assert await store.revoke(A, 1000) is True
        first = await store.revoked_since(0)
        assert [(e.token_id, e.expires_at) for e in first] == [(A, 1000)]
        assert await store.revoke(NEVER, None) is True
        later = await store.revoked_since(first[-1].seq)
        assert [(e.token_id, e.expires_at) for e in later] == [(NEVER, None)]
        assert later[0].seq > first[0].seq
        assert await store.revoked_since(later[-1].seq) == []

    async def test_revoking_twice_keeps_one_entry_and_says_so(self, store: RevocationStore) -> None:
        assert await store.revoke(A, 1000) is True
        assert await store.revoke(A, 1000) is False
        assert [e.token_id for e in await store.revoked_since(0)] == [A]

    async def test_a_sweep_deletes_only_entries_whose_token_expired_within_its_limit(
        self, store: RevocationStore
    ) -> None:
        for token_id, expires_at in ((A, 1000), (B, 2000), (NEVER, None)):
            await store.revoke(token_id, expires_at)
        assert await store.sweep(999.0, limit=10) == 0
        assert await store.sweep(1500.0, limit=10) == 1
        assert [e.token_id for e in await store.revoked_since(0)] == [B, NEVER]
        assert await store.sweep(10**12, limit=0) == 0
        assert await store.sweep(10**12, limit=10) == 1  # a token that never expires stays
        assert [e.token_id for e in await store.revoked_since(0)] == [NEVER]

    async def test_a_sequence_number_is_never_reused_after_a_sweep(
        self, store: RevocationStore
    ) -> None:
        """A server that read past an entry must see one revoked after it was swept."""
        await store.revoke(A, 1000)
        seen = (await store.revoked_since(0))[-1].seq
        assert await store.sweep(1500.0, limit=10) == 1
        await store.revoke(B, 2000)
        assert [e.token_id for e in await store.revoked_since(seen)] == [B]
