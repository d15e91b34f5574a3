"""The operators' listings (what the dashboard reads), written once and run against every backend:
a workspace's written sub-docs at their heads (`OpLogStore.list_sub_docs`) and its live compute
locks (`ComputeLockStore.list_live`).

A backend's test classes subclass `SubDocListingContract` (overriding `oplog`) and
`LockListingContract` (overriding `locks`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from cv_server.locks import Acquired, ComputeLockStore
from cv_server.oplog import OpLogStore, Rejected, SubDocHead
from tests.contract.oplog_contract import append_one, increment, insert

WS = "ws-1"
OTHER_WS = "ws-2"
TTL = 60.0


class SubDocListingContract:
    """`list_sub_docs`: every written sub-doc of the workspace once, by name, at its head."""

    @pytest.fixture
    async def oplog(self) -> AsyncIterator[OpLogStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_a_workspace_never_written_lists_nothing(self, oplog: OpLogStore) -> None:
        assert await oplog.list_sub_docs(WS, limit=100) == []

    async def test_each_written_sub_doc_is_listed_once_by_name_at_its_head(
        self, oplog: OpLogStore
    ) -> None:
        before = time.time()
        for name, count in (("tree", 3), ("alpha", 1), ("m.2", 2)):
            for _ in range(count):
                await append_one(oplog, increment(), ws=WS, doc=name)
        await append_one(oplog, increment(), ws=OTHER_WS, doc="zeta")  # another workspace
        listed = await oplog.list_sub_docs(WS, limit=100)
        assert [(d.sub_doc, d.clock) for d in listed] == [("alpha", 1), ("m.2", 2), ("tree", 3)]
        for doc in listed:
            assert doc.clock == await oplog.head(WS, doc.sub_doc)
            # The time of the head's commit, on the server's wall clock (SQLite keeps ms).
            assert before - 1 <= doc.committed_at <= time.time() + 1
        assert [d.sub_doc for d in await oplog.list_sub_docs(OTHER_WS, limit=100)] == ["zeta"]

    async def test_a_sub_doc_that_only_rejected_ops_is_not_listed(self, oplog: OpLogStore) -> None:
        rejected = await append_one(oplog, insert("n", parent="missing"), ws=WS, doc="empty")
        assert isinstance(rejected, Rejected)
        await append_one(oplog, increment(), ws=WS, doc="written")
        assert [d.sub_doc for d in await oplog.list_sub_docs(WS, limit=100)] == ["written"]

    async def test_pages_after_the_last_name_cover_every_sub_doc_exactly_once(
        self, oplog: OpLogStore
    ) -> None:
        names = [f"doc-{i:02d}" for i in range(7)]
        for name in reversed(names):
            await append_one(oplog, increment(), ws=WS, doc=name)
        seen: list[str] = []
        after: str | None = None
        while True:
            page = await oplog.list_sub_docs(WS, after=after, limit=3)
            seen += [d.sub_doc for d in page]
            if len(page) < 3:
                break
            after = page[-1].sub_doc
        assert seen == names
        # `after` need not be a listed name: the page starts at the next one.
        assert [d.sub_doc for d in await oplog.list_sub_docs(WS, after="doc-03a", limit=2)] == [
            "doc-04",
            "doc-05",
        ]

    async def test_the_listing_follows_new_commits(self, oplog: OpLogStore) -> None:
        await append_one(oplog, increment(), ws=WS, doc="tree")
        first = await oplog.list_sub_docs(WS, limit=10)
        await append_one(oplog, increment(), ws=WS, doc="tree")
        (now,) = await oplog.list_sub_docs(WS, limit=10)
        assert now == SubDocHead("tree", 2, now.committed_at, 1)
        assert now.committed_at >= first[0].committed_at

    async def test_a_zero_limit_lists_nothing_and_a_negative_one_is_refused(
        self, oplog: OpLogStore
    ) -> None:
        await append_one(oplog, increment(), ws=WS, doc="tree")
        assert await oplog.list_sub_docs(WS, limit=0) == []
        with pytest.raises(ValueError, match="limit"):
            await oplog.list_sub_docs(WS, limit=-1)


class LockListingContract:
    """`list_live`: the workspace's live locks, by key, never a dead one."""

    @pytest.fixture
    async def locks(self) -> AsyncIterator[ComputeLockStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    async def test_live_locks_are_listed_by_key_with_holder_and_expiry(
        self, locks: ComputeLockStore
    ) -> None:
        held: dict[tuple[str, str], Acquired] = {}
        for job, task, holder in (("j2", "a", "w1"), ("j1", "b", "w2"), ("j1", "a", "w3")):
            outcome = await locks.acquire(WS, job, task, holder, TTL, 100.0)
            assert isinstance(outcome, Acquired)
            held[job, task] = outcome
        await locks.acquire(OTHER_WS, "j1", "a", "elsewhere", TTL, 100.0)
        listed = await locks.list_live(WS, 110.0, limit=100)
        assert [(lock.job_id, lock.task, lock.holder) for lock in listed] == [
            ("j1", "a", "w3"),
            ("j1", "b", "w2"),
            ("j2", "a", "w1"),
        ]
        for lock in listed:
            assert lock.workspace_id == WS
            assert lock.acquired_at == 100.0
            assert lock.expires_at == 100.0 + TTL
            assert lock.token == held[lock.job_id, lock.task].token

    async def test_a_dead_or_released_lock_is_not_listed(self, locks: ComputeLockStore) -> None:
        short = await locks.acquire(WS, "job", "short", "w", 5.0, 100.0)
        released = await locks.acquire(WS, "job", "released", "w", TTL, 100.0)
        await locks.acquire(WS, "job", "long", "w", TTL, 100.0)
        assert isinstance(short, Acquired)
        assert isinstance(released, Acquired)
        assert await locks.release(WS, "job", "released", released.token, 101.0)
        assert [lock.task for lock in await locks.list_live(WS, 104.9, limit=10)] == [
            "long",
            "short",
        ]
        # Dead at its expiry time, as `get` judges it, though no sweep deleted it yet.
        assert [lock.task for lock in await locks.list_live(WS, 105.0, limit=10)] == ["long"]

    async def test_pages_after_the_last_key_cover_every_lock_exactly_once(
        self, locks: ComputeLockStore
    ) -> None:
        keys = [(f"job-{j}", f"task-{t}") for j in range(3) for t in range(3)]
        for job, task in reversed(keys):
            await locks.acquire(WS, job, task, "w", TTL, 100.0)
        seen: list[tuple[str, str]] = []
        after: tuple[str, str] | None = None
        while True:
            page = await locks.list_live(WS, 100.0, after=after, limit=4)
            seen += [(lock.job_id, lock.task) for lock in page]
            if len(page) < 4:
                break
            after = (page[-1].job_id, page[-1].task)
        assert seen == keys

    async def test_a_zero_limit_lists_nothing_and_a_negative_one_is_refused(
        self, locks: ComputeLockStore
    ) -> None:
        await locks.acquire(WS, "job", "task", "w", TTL, 100.0)
        assert await locks.list_live(WS, 100.0, limit=0) == []
        with pytest.raises(ValueError, match="limit"):
            await locks.list_live(WS, 100.0, limit=-1)
