"""Groups of several sub-docs committed in one PostgreSQL transaction (`PostgresOpLogStore`'s
batches): one transaction for the lanes ready together, each sub-doc's clocks and dedupe kept, a
failing sub-doc failing alone, and two instances locking overlapping sets of heads."""

from __future__ import annotations

import asyncio

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_mutations import new_op_id
from cv_server.oplog import Committed, Rejected
from cv_server.pg.oplog import OpLogCorrupted
from cv_server.pg.oplog_sql import OPS_TABLE
from tests.contract.oplog_contract import WS, all_entries, append_one, field_value, increment
from tests.pg.conftest import Opener

pytestmark = pytest.mark.postgres

TIMEOUT = 60.0


async def test_appends_to_many_sub_docs_in_one_tick_share_one_transaction(
    open_store: Opener,
) -> None:
    store = await open_store()
    docs = [f"doc-{i}" for i in range(32)]
    ops = {doc: increment(new_op_id()) for doc in docs}
    results = await asyncio.wait_for(
        asyncio.gather(*(store.append(WS, doc, [ops[doc]]) for doc in docs)), TIMEOUT
    )
    assert [outcomes for outcomes, _ in results] == [
        [Committed(ops[doc].op_id, 1, duplicate=False)] for doc in docs
    ]
    assert store.groups_committed == 32
    assert store.transactions_committed == 1
    for doc in docs:
        assert [e.clock for e in await all_entries(store, doc=doc)] == [1]
        assert await field_value(store, doc=doc) == 1


async def test_a_batch_dedupes_each_sub_doc_on_its_own_op_ids(open_store: Opener) -> None:
    store = await open_store()
    docs = [f"doc-{i}" for i in range(8)]
    first = {doc: increment(new_op_id()) for doc in docs}
    await asyncio.gather(*(store.append(WS, doc, [first[doc]]) for doc in docs))
    # The same op_ids again, each with a new op after it, and one op_id reused on another
    # sub-doc: a duplicate only where it was committed.
    again = await asyncio.gather(
        *(store.append(WS, doc, [first[doc], increment(new_op_id())]) for doc in docs),
        append_one(store, increment(str(first["doc-0"].op_id)), doc="elsewhere"),
    )
    for doc, (outcomes, _) in zip(docs, again[:-1], strict=False):
        assert isinstance(outcomes[0], Committed)
        assert isinstance(outcomes[1], Committed)
        assert (outcomes[0].clock, outcomes[0].duplicate) == (1, True)
        assert (outcomes[1].clock, outcomes[1].duplicate) == (2, False)
        assert await field_value(store, doc=doc) == 2
    assert again[-1] == Committed(first["doc-0"].op_id, 1, duplicate=False)
    assert store.transactions_committed == 2


async def test_a_rejection_in_one_sub_doc_of_a_batch_leaves_the_others_committed(
    open_store: Opener,
) -> None:
    store = await open_store()
    bad = increment(new_op_id(), node="missing")
    good = {doc: increment(new_op_id()) for doc in ("a", "b", "c")}
    results = await asyncio.gather(
        append_one(store, good["a"], doc="a"),
        append_one(store, bad, doc="rejecting"),
        append_one(store, good["b"], doc="b"),
        append_one(store, good["c"], doc="c"),
    )
    assert isinstance(results[1], Rejected)
    assert [results[0], results[2], results[3]] == [
        Committed(good[doc].op_id, 1, duplicate=False) for doc in ("a", "b", "c")
    ]
    assert store.transactions_committed == 1
    # The rejection is recorded: its retry gets the same answer, as a duplicate.
    retried = await append_one(store, bad, doc="rejecting")
    assert isinstance(retried, Rejected)
    assert (retried.code, retried.duplicate) == (results[1].code, True)


async def test_a_corrupt_sub_doc_fails_alone_and_the_rest_of_its_batch_commits(
    open_store: Opener, pool: asyncpg.Pool
) -> None:
    writer = await open_store(snapshot_every=100)
    await writer.append(WS, "broken", [increment() for _ in range(3)])
    async with pool.acquire() as conn:
        await conn.execute(f"DELETE FROM {OPS_TABLE} WHERE sub_doc = 'broken' AND clock = 2")
    fresh = await open_store(snapshot_every=100)
    docs = [f"doc-{i}" for i in range(6)]
    ops = {doc: increment(new_op_id()) for doc in docs}
    results = await asyncio.wait_for(
        asyncio.gather(
            *(append_one(fresh, ops[doc], doc=doc) for doc in docs[:3]),
            fresh.append(WS, "broken", [increment()]),
            *(append_one(fresh, ops[doc], doc=doc) for doc in docs[3:]),
            return_exceptions=True,
        ),
        TIMEOUT,
    )
    assert isinstance(results[3], OpLogCorrupted)
    assert [r for i, r in enumerate(results) if i != 3] == [
        Committed(ops[doc].op_id, 1, duplicate=False) for doc in docs
    ]
    for doc in docs:
        assert await field_value(fresh, doc=doc) == 1


async def test_two_instances_batching_overlapping_sub_docs_apply_every_op_once_in_order(
    open_store: Opener,
) -> None:
    first, second = await open_store(), await open_store()
    docs = [f"doc-{i}" for i in range(12)]
    rounds = 25

    async def burst(store_index: int, round_index: int) -> list[tuple[str, str, int]]:
        store = (first, second)[store_index]
        # Each instance's burst covers an overlapping, differently ordered set of sub-docs.
        mine = docs[store_index * 4 :] + docs[: store_index * 4]
        chosen = mine[round_index % 3 :: 1 + round_index % 2]
        ops = {doc: increment(new_op_id(), field=f"s{store_index}") for doc in chosen}
        outcomes = await asyncio.gather(*(append_one(store, ops[d], doc=d) for d in chosen))
        sent = []
        for doc, outcome in zip(chosen, outcomes, strict=True):
            assert isinstance(outcome, Committed)
            assert not outcome.duplicate
            sent.append((doc, str(ops[doc].op_id), outcome.clock))
        return sent

    async def instance(index: int) -> list[tuple[str, str, int]]:
        sent: list[tuple[str, str, int]] = []
        for r in range(rounds):
            sent += await burst(index, r)
        return sent

    results = await asyncio.wait_for(asyncio.gather(instance(0), instance(1)), TIMEOUT)
    committed = [item for sent in results for item in sent]
    for doc in docs:
        entries = await all_entries(first, doc=doc)
        mine = {op_id: clock for d, op_id, clock in committed if d == doc}
        assert [e.clock for e in entries] == list(range(1, len(mine) + 1))
        assert {str(e.op_id): e.clock for e in entries} == mine
        _, state = await second.get_state(WS, doc)
        counts = state.nodes["root"].fields if len(entries) else {}
        for index in (0, 1):
            expected = sum(1 for d, _, _ in results[index] if d == doc)
            assert counts.get(f"s{index}", 0) == expected
    assert first.transactions_committed < first.groups_committed
    assert second.transactions_committed < second.groups_committed
