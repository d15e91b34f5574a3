"""The op-log contract (docs/concepts.md; layer 3), written once, run against every backend.

A backend's test class subclasses `OpLogContract` and overrides two fixtures:

- `store`: a fresh, empty store whose snapshots are taken every `SNAPSHOT_EVERY` ops;
- `reopen`: an async callable that closes a store and opens a new one on the same data (what a
  server restart does), closing whatever it opened at teardown;
- `open_store`: an async callable that opens another store on the same data with constructor
  keywords (`snapshot_every=`), as a restarted server or a second instance would, closed at
  teardown;
- `log_rows`: a `LogRows` that reads and edits the stored log behind every store's back (the
  snapshot's clock, deleting op rows), to show what a store does with what it finds on disk.

`node.increment` is deliberately not idempotent: a field's value counts how many times an op was
applied, which is how these tests see a double apply.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, Final, Protocol

import pytest

from cv_mutations import fingerprint, new_op_id, parse_op
from cv_server.oplog import (
    Committed,
    Forgotten,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStore,
    Rejected,
)

WS = "ws-1"
DOC = "tree"

Reopen = Callable[[OpLogStore], Awaitable[OpLogStore]]
#: `await open_store(**constructor_keywords)`: another store on the test's data.
OpenStore = Callable[..., Awaitable[OpLogStore]]


class LogRows(Protocol):
    """The stored log of `WS`/`DOC`, read and edited directly in the backend's database."""

    async def snapshot_clock(self) -> int | None:
        """The clock of the stored snapshot, None when there is none."""
        ...

    async def delete_ops(self, where: str) -> None:
        """Delete the op rows matching the SQL condition `where` (on the `clock` column)."""
        ...

    def cached_sub_docs(self, store: OpLogStore) -> int:
        """How many sub-doc states `store` holds in its cache."""
        ...

    async def drop_op_id_records(self) -> None:
        """Forget every op_id's outcome (commits and rejections), keeping the log rows' ops:
        what compaction leaves of old ops' dedupe records."""
        ...


_node_ids = itertools.count()


def incoming(raw: dict[str, Any]) -> IncomingOp:
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


def increment(
    op_id: str | None = None, *, node: str = "root", field: str = "n", by: int = 1
) -> IncomingOp:
    raw: dict[str, Any] = {"type": "node.increment", "node_id": node, "field": field, "by": by}
    if op_id is not None:
        raw["op_id"] = op_id
    return incoming(raw)


def insert(node: str, parent: str = "root", op_id: str | None = None) -> IncomingOp:
    raw: dict[str, Any] = {"type": "node.insert", "node_id": node, "parent_id": parent}
    if op_id is not None:
        raw["op_id"] = op_id
    return incoming(raw)


def fresh_node() -> str:
    return f"n{next(_node_ids)}"


async def field_value(
    store: OpLogStore, node: str = "root", field: str = "n", ws: str = WS, doc: str = DOC
) -> Any:
    _, state = await store.get_state(ws, doc)
    return state.nodes[node].fields.get(field)


async def all_entries(store: OpLogStore, ws: str = WS, doc: str = DOC) -> list[LogEntry]:
    _, entries = await store.read_since(ws, doc, 0, 1_000_000)
    return entries


def in_lane(
    op: IncomingOp, client_id: str, seq: int, *, minted_at: int | None = None
) -> IncomingOp:
    """`op` stamped as op `seq` of `client_id`'s lane (with an op_id if it had none)."""
    raw = {**op.raw, "client_id": client_id, "seq": seq}
    raw.setdefault("op_id", new_op_id())
    if minted_at is not None:
        raw["minted_at"] = minted_at
    return incoming(raw)


#: A store's clock for the tests of the dedupe window: `NOW` (seconds), then past the window.
NOW: Final = 1_800_000_000.0
NOW_MS: Final = int(NOW * 1000)
WINDOW_SECONDS: Final = 3600.0
SKEW_SECONDS: Final = 60.0
PAST_THE_WINDOW: Final = NOW + WINDOW_SECONDS


async def open_windowed(open_store: OpenStore, clock: list[float]) -> OpLogStore:
    """A store with a one-hour dedupe window whose clock reads `clock[0]`."""
    return await open_store(
        snapshot_every=4,
        retention_seconds=WINDOW_SECONDS,
        skew_seconds=SKEW_SECONDS,
        now=lambda: clock[0],
    )


def minted(op: IncomingOp, minted_at: int) -> IncomingOp:
    """`op` dated `minted_at` (unix ms), with an op_id if it had none."""
    raw = {**op.raw, "minted_at": minted_at}
    raw.setdefault("op_id", new_op_id())
    return incoming(raw)


async def append_one(
    store: OpLogStore, op: IncomingOp, ws: str = WS, doc: str = DOC
) -> Committed | Rejected | Forgotten:
    outcomes, _ = await store.append(ws, doc, [op])
    assert len(outcomes) == 1
    return outcomes[0]


class LaneMarkContract:
    """Every `OpLogStore` keeps a mark per client lane (docs/ops.md#exactly-once): the highest
    seq decided, moved in the append's own transaction; ops at or below it are never applied
    again, a gap is refused, and an op without a lane dated before the window and without
    record is expired. Mixed into `OpLogContract` so every backend runs it."""

    async def test_a_lane_mark_is_the_highest_seq_decided_applied_or_rejected(
        self, store: OpLogStore
    ) -> None:
        assert await store.client_mark(WS, DOC, "client-a1") == 0
        outcomes, _ = await store.append(
            WS,
            DOC,
            [
                in_lane(increment(), "client-a1", 1),
                in_lane(insert("root", parent="nowhere"), "client-a1", 2),
            ],
        )
        assert isinstance(outcomes[0], Committed)
        assert isinstance(outcomes[1], Rejected)
        assert await store.client_mark(WS, DOC, "client-a1") == 2
        assert await store.client_mark(WS, DOC, "client-b1") == 0
        assert await store.client_mark(WS, "other", "client-a1") == 0

    async def test_an_op_at_or_below_its_mark_without_record_is_never_applied_again(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        clock = [NOW]
        store = await open_windowed(open_store, clock)
        ops = [in_lane(increment(), "client-a1", seq, minted_at=NOW_MS) for seq in (1, 2, 3)]
        await store.append(WS, DOC, ops)
        await store.close()
        clock[0] = PAST_THE_WINDOW  # compaction's age: the records are gone
        await log_rows.drop_op_id_records()
        store = await open_windowed(open_store, clock)
        outcomes, entries = await store.append(WS, DOC, ops)
        assert outcomes == [Forgotten(op.op_id) for op in ops]
        assert outcomes[0].to_json() == {
            "op_id": ops[0].op_id,
            "clock": None,
            "duplicate": True,
        }
        assert entries == []
        assert await field_value(store) == 3
        assert await store.head(WS, DOC) == 3

    async def test_a_recent_op_below_its_mark_without_record_is_refused_so_it_is_renumbered(
        self, open_store: OpenStore
    ) -> None:
        """D (seq 5) was given up while a copy of it was in flight; the SDK renumbered E to seq
        5; the stale copy of D is decided at 5. E at seq 5, minted inside the window, was never
        applied (its record would be there): refused `seq_gap` expecting 6, never answered as a
        duplicate, and applied once it comes as seq 6."""
        store = await open_windowed(open_store, [NOW])
        lane = "client-a1"
        await store.append(
            WS, DOC, [in_lane(increment(), lane, seq, minted_at=NOW_MS) for seq in (1, 2, 3, 4)]
        )
        stale_d = in_lane(increment(), lane, 5, minted_at=NOW_MS)
        e_op_id = new_op_id()
        e_at_5 = in_lane(increment(e_op_id), lane, 5, minted_at=NOW_MS)
        assert isinstance(await append_one(store, stale_d), Committed)
        refused = await append_one(store, e_at_5)
        assert isinstance(refused, Rejected)
        assert (refused.code, refused.expected_seq) == ("seq_gap", 6)
        assert await store.head(WS, DOC) == 5
        assert await store.client_mark(WS, DOC, lane) == 5
        e_at_6 = in_lane(increment(e_op_id), lane, 6, minted_at=NOW_MS)
        assert await append_one(store, e_at_6) == Committed(e_op_id, 6)
        assert await field_value(store) == 6
        # Its resend is answered from its record, at either seq.
        assert await append_one(store, e_at_5) == Committed(e_op_id, 6, duplicate=True)

    async def test_a_seq_past_the_mark_plus_one_is_a_gap_and_nothing_after_it_applies(
        self, store: OpLogStore
    ) -> None:
        await store.append(WS, DOC, [in_lane(increment(), "client-a1", 1)])
        outcomes, _ = await store.append(
            WS,
            DOC,
            [
                in_lane(increment(), "client-a1", 3),
                in_lane(increment(), "client-a1", 4),
                increment(new_op_id()),
            ],
        )
        assert [getattr(o, "code", None) for o in outcomes] == ["seq_gap"] * 3
        assert isinstance(outcomes[0], Rejected)
        assert outcomes[0].expected_seq == 2
        assert outcomes[0].to_json()["error"]["expected_seq"] == 2
        assert await field_value(store) == 1
        assert await store.client_mark(WS, DOC, "client-a1") == 1
        # Sent in order, the same ops are decided.
        outcomes, _ = await store.append(
            WS,
            DOC,
            [in_lane(increment(), "client-a1", seq) for seq in (2, 3, 4)],
        )
        assert [type(o) for o in outcomes] == [Committed] * 3
        assert await store.client_mark(WS, DOC, "client-a1") == 4

    async def test_marks_are_exact_across_appends_of_one_group_commit(
        self, store: OpLogStore
    ) -> None:
        # Concurrent appends share transactions on both backends; each sees the last's mark.
        ops = [in_lane(increment(), "client-a1", seq) for seq in range(1, 41)]
        results = await asyncio.gather(*(store.append(WS, DOC, [op]) for op in ops))
        assert all(type(outcomes[0]) is Committed for outcomes, _ in results)
        assert await store.client_mark(WS, DOC, "client-a1") == 40
        assert await field_value(store) == 40

    async def test_an_atomic_batch_failed_by_a_decision_moves_the_mark_past_all_its_ops(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        clock = [NOW]
        store = await open_windowed(open_store, clock)
        ops = [
            in_lane(increment(), "client-a1", 1, minted_at=NOW_MS),
            in_lane(insert("root", parent="nowhere"), "client-a1", 2, minted_at=NOW_MS),
            in_lane(increment(), "client-a1", 3, minted_at=NOW_MS),
        ]
        outcomes, _ = await store.append(WS, DOC, ops, atomic=True)
        codes = [getattr(o, "code", None) for o in outcomes]
        assert codes[0] == codes[2] == "atomic_aborted"
        assert codes[1] not in (None, "atomic_aborted", "seq_gap")
        assert await store.client_mark(WS, DOC, "client-a1") == 3
        # A resend gets the same answers from the records; once they are gone, forgotten.
        again, _ = await store.append(WS, DOC, ops, atomic=True)
        assert [getattr(o, "code", None) for o in again] == codes
        clock[0] = PAST_THE_WINDOW
        await log_rows.drop_op_id_records()
        again, _ = await store.append(WS, DOC, ops, atomic=True)
        assert again == [Forgotten(op.op_id) for op in ops]
        assert await store.head(WS, DOC) == 0

    async def test_an_atomic_batch_failed_by_a_gap_decides_nothing(self, store: OpLogStore) -> None:
        ops = [in_lane(increment(), "client-a1", 1), in_lane(increment(), "client-a1", 3)]
        outcomes, _ = await store.append(WS, DOC, ops, atomic=True)
        assert [getattr(o, "code", None) for o in outcomes] == ["atomic_aborted", "seq_gap"]
        assert await store.client_mark(WS, DOC, "client-a1") == 0
        outcomes, _ = await store.append(
            WS, DOC, [ops[0], in_lane(increment(), "client-a1", 2)], atomic=True
        )
        assert [type(o) for o in outcomes] == [Committed, Committed]

    async def test_an_op_minted_before_the_window_without_record_is_expired(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        now = 1_800_000_000.0
        clock = [now]
        store = await open_store(
            snapshot_every=4, retention_seconds=3600.0, skew_seconds=60.0, now=lambda: clock[0]
        )
        op = minted(increment(), int(now * 1000))
        assert isinstance(await append_one(store, op), Committed)
        clock[0] = now + 3600.0 - 120.0  # inside the window less the skew: the record answers
        assert await append_one(store, op) == Committed(op.op_id, 1, duplicate=True)
        clock[0] = now + 3600.0 - 30.0  # past the window less the skew; the record is gone
        await log_rows.drop_op_id_records()
        expired = await append_one(store, op)
        assert isinstance(expired, Rejected)
        assert expired.code == "op_expired"
        assert expired.clock == 1
        assert await store.head(WS, DOC) == 1
        assert await field_value(store) == 1
        # Dated inside the window, an op without record is decided as usual.
        fresh = minted(increment(), int(clock[0] * 1000))
        assert isinstance(await append_one(store, fresh), Committed)

    async def test_ops_without_the_new_fields_keep_working_with_a_window(
        self, open_store: OpenStore
    ) -> None:
        store = await open_store(snapshot_every=4, retention_seconds=3600.0, skew_seconds=60.0)
        op = increment(new_op_id())
        assert isinstance(await append_one(store, op), Committed)
        assert await append_one(store, op) == Committed(op.op_id, 1, duplicate=True)


class OpLogContract(LaneMarkContract):
    """Every `OpLogStore` keeps these rules."""

    #: Small, so a handful of ops crosses several snapshots.
    SNAPSHOT_EVERY: ClassVar[int] = 4

    @pytest.fixture
    async def store(self) -> AsyncIterator[OpLogStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022  # pragma: no cover - an async generator, like the overrides

    @pytest.fixture
    async def reopen(self) -> AsyncIterator[Reopen]:
        raise NotImplementedError("a backend's test class provides reopen")
        yield  # noqa: PT022  # pragma: no cover

    @pytest.fixture
    async def open_store(self) -> AsyncIterator[OpenStore]:
        raise NotImplementedError("a backend's test class provides open_store")
        yield  # noqa: PT022  # pragma: no cover

    @pytest.fixture
    def log_rows(self) -> LogRows:
        raise NotImplementedError("a backend's test class provides log_rows")

    # -- dedupe ----------------------------------------------------------------------------------

    async def test_the_same_op_appended_twice_is_applied_once(self, store: OpLogStore) -> None:
        op_id = new_op_id()
        first, first_entries = await store.append(WS, DOC, [increment(op_id)])
        second, second_entries = await store.append(WS, DOC, [increment(op_id)])
        assert first == [Committed(op_id=op_id, clock=1, duplicate=False)]
        assert second == [Committed(op_id=op_id, clock=1, duplicate=True)]
        assert [e.clock for e in first_entries] == [1]
        assert second_entries == []
        assert await store.head(WS, DOC) == 1
        assert await field_value(store) == 1

    async def test_many_concurrent_appends_of_one_op_id_apply_it_once(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        results = await asyncio.gather(
            *(store.append(WS, DOC, [increment(op_id)]) for _ in range(50))
        )
        outcomes = [outcomes[0] for outcomes, _ in results]
        assert all(isinstance(o, Committed) and o.clock == 1 for o in outcomes)
        assert sum(1 for o in outcomes if not o.duplicate) == 1
        assert sum(len(entries) for _, entries in results) == 1
        assert await store.head(WS, DOC) == 1
        assert await field_value(store) == 1

    async def test_a_changed_op_under_a_used_op_id_is_refused_as_reuse_and_not_applied(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        await append_one(store, increment(op_id, by=1))
        reused, entries = await store.append(WS, DOC, [increment(op_id, by=5)])
        assert len(reused) == 1
        assert isinstance(reused[0], Rejected)
        assert reused[0].code == "op_id_reuse"
        assert reused[0].op_id == op_id
        assert entries == []
        assert await store.head(WS, DOC) == 1
        assert await field_value(store) == 1
        # The original op still answers with its own outcome.
        assert await append_one(store, increment(op_id, by=1)) == Committed(op_id, 1, True)

    async def test_a_changed_op_under_a_rejected_op_id_is_refused_as_reuse(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        rejected = await append_one(store, insert("a", parent="missing", op_id=op_id))
        assert isinstance(rejected, Rejected)
        assert rejected.code == "parent_not_found"
        reused = await append_one(store, insert("a", parent="root", op_id=op_id))
        assert isinstance(reused, Rejected)
        assert reused.code == "op_id_reuse"
        assert await store.head(WS, DOC) == 0
        _, state = await store.get_state(WS, DOC)
        assert "a" not in state.nodes

    async def test_a_retried_rejected_op_gets_the_same_rejection_even_if_it_would_now_succeed(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        first = await append_one(store, insert("child", parent="parent", op_id=op_id))
        assert isinstance(first, Rejected)
        assert first.code == "parent_not_found"
        assert not first.duplicate
        assert isinstance(await append_one(store, insert("parent")), Committed)
        retried = await append_one(store, insert("child", parent="parent", op_id=op_id))
        assert retried == Rejected(op_id, first.code, first.message, duplicate=True)
        _, state = await store.get_state(WS, DOC)
        assert "child" not in state.nodes
        assert await store.head(WS, DOC) == 1

    async def test_the_same_op_id_twice_in_one_batch_is_applied_once(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        outcomes, entries = await store.append(WS, DOC, [increment(op_id), increment(op_id)])
        assert outcomes == [Committed(op_id, 1, False), Committed(op_id, 1, True)]
        assert [e.clock for e in entries] == [1]
        assert await field_value(store) == 1

    async def test_a_changed_op_under_an_op_id_used_earlier_in_the_batch_is_refused(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        outcomes, _ = await store.append(WS, DOC, [increment(op_id, by=1), increment(op_id, by=2)])
        assert outcomes[0] == Committed(op_id, 1, False)
        assert isinstance(outcomes[1], Rejected)
        assert outcomes[1].code == "op_id_reuse"
        assert await field_value(store) == 1

    async def test_ops_without_op_id_are_applied_on_every_send(self, store: OpLogStore) -> None:
        first = await append_one(store, increment())
        second = await append_one(store, increment())
        assert first == Committed(None, 1, False)
        assert second == Committed(None, 2, False)
        assert await field_value(store) == 2

    # -- batches ---------------------------------------------------------------------------------

    async def test_the_ops_of_a_batch_commit_in_order_with_gap_free_clocks(
        self, store: OpLogStore
    ) -> None:
        await append_one(store, increment())
        ops = [insert(f"node-{i}", op_id=new_op_id()) for i in range(10)]
        outcomes, entries = await store.append(WS, DOC, ops)
        assert outcomes == [Committed(op.op_id, 2 + i) for i, op in enumerate(ops)]
        assert [(e.clock, e.op_id, e.op) for e in entries] == [
            (2 + i, op.op_id, op.raw) for i, op in enumerate(ops)
        ]
        _, state = await store.get_state(WS, DOC)
        assert state.nodes["root"].children == [f"node-{i}" for i in range(10)]

    async def test_a_rejected_op_consumes_no_clock_and_does_not_stop_the_others(
        self, store: OpLogStore
    ) -> None:
        ops = [insert("a", op_id=new_op_id()), insert("a", op_id=new_op_id()), insert("b")]
        outcomes, entries = await store.append(WS, DOC, ops)
        assert outcomes[0] == Committed(ops[0].op_id, 1)
        assert isinstance(outcomes[1], Rejected)
        assert outcomes[1].code == "node_exists"
        assert outcomes[2] == Committed(None, 2)
        assert [e.clock for e in entries] == [1, 2]
        assert await store.head(WS, DOC) == 2

    async def test_an_empty_batch_commits_nothing(self, store: OpLogStore) -> None:
        assert await store.append(WS, DOC, []) == ([], [])
        assert await store.head(WS, DOC) == 0

    async def test_an_atomic_batch_that_fits_commits_every_op(self, store: OpLogStore) -> None:
        ops = [insert("a", op_id=new_op_id()), insert("b", parent="a"), increment(node="b")]
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True)
        assert outcomes == [Committed(op.op_id, i + 1) for i, op in enumerate(ops)]
        assert len(entries) == 3
        assert await field_value(store, node="b") == 1

    async def test_an_atomic_batch_with_a_rejected_op_applies_nothing(
        self, store: OpLogStore
    ) -> None:
        await append_one(store, insert("keep"))
        _, before = await store.get_state(WS, DOC)
        first, failing, last = new_op_id(), new_op_id(), new_op_id()
        ops = [
            insert("a", op_id=first),
            increment(node="a"),
            insert("x", parent="missing", op_id=failing),
            insert("z", op_id=last),
        ]
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True)
        assert entries == []
        assert [o.code if isinstance(o, Rejected) else o for o in outcomes] == [
            "atomic_aborted",
            "atomic_aborted",
            "parent_not_found",
            "atomic_aborted",
        ]
        assert [o.op_id for o in outcomes] == [first, None, failing, last]
        assert await store.head(WS, DOC) == 1
        assert (await store.get_state(WS, DOC)) == (1, before)
        assert [e.clock for e in await all_entries(store)] == [1]
        # The failing op's rejection was recorded; the aborted ops' outcomes were not.
        retried = await append_one(store, insert("x", parent="missing", op_id=failing))
        assert isinstance(retried, Rejected)
        assert (retried.code, retried.duplicate) == ("parent_not_found", True)
        assert await append_one(store, insert("a", op_id=first)) == Committed(first, 2)

    async def test_a_retried_atomic_batch_fails_the_same_way_after_the_state_changed(
        self, store: OpLogStore
    ) -> None:
        ops = [insert("a", op_id=new_op_id()), insert("c", parent="b", op_id=new_op_id())]
        await store.append(WS, DOC, ops, atomic=True)
        await append_one(store, insert("b"))  # the failing op would now fit
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True)
        assert entries == []
        assert isinstance(outcomes[0], Rejected)
        assert outcomes[0].code == "atomic_aborted"
        assert isinstance(outcomes[1], Rejected)
        assert (outcomes[1].op_id, outcomes[1].code, outcomes[1].duplicate) == (
            ops[1].op_id,
            "parent_not_found",
            True,
        )
        assert await store.head(WS, DOC) == 1

    async def test_a_repeat_inside_a_failed_atomic_batch_is_aborted_with_its_first(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        ops = [increment(op_id), increment(op_id), insert("x", parent="missing")]
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True)
        assert [o.code for o in outcomes if isinstance(o, Rejected)] == [
            "atomic_aborted",
            "atomic_aborted",
            "parent_not_found",
        ]
        assert entries == []
        assert await store.head(WS, DOC) == 0
        # Not recorded: sent again on its own, the op applies.
        assert await append_one(store, increment(op_id)) == Committed(op_id, 1)

    async def test_ops_committed_before_keep_their_outcome_inside_a_failed_atomic_batch(
        self, store: OpLogStore
    ) -> None:
        done = new_op_id()
        await append_one(store, increment(done))
        ops = [increment(done), insert("x", parent="missing"), increment(new_op_id())]
        outcomes, entries = await store.append(WS, DOC, ops, atomic=True)
        assert outcomes[0] == Committed(done, 1, duplicate=True)
        assert [o.code for o in outcomes[1:] if isinstance(o, Rejected)] == [
            "parent_not_found",
            "atomic_aborted",
        ]
        assert entries == []
        assert await field_value(store) == 1

    async def test_a_reused_op_id_fails_an_atomic_batch(self, store: OpLogStore) -> None:
        op_id = new_op_id()
        await append_one(store, increment(op_id, by=1))
        outcomes, entries = await store.append(
            WS, DOC, [increment(by=10), increment(op_id, by=2)], atomic=True
        )
        assert [o.code for o in outcomes if isinstance(o, Rejected)] == [
            "atomic_aborted",
            "op_id_reuse",
        ]
        assert entries == []
        assert await field_value(store) == 1

    # -- reading ---------------------------------------------------------------------------------

    async def test_read_since_pages_through_exactly_the_entries_after_since(
        self, store: OpLogStore
    ) -> None:
        ops = [increment(new_op_id() if i % 2 else None, by=i) for i in range(25)]
        for start in range(0, 25, 6):
            await store.append(WS, DOC, ops[start : start + 6])
        expected = [(i + 1, op.op_id, op.raw) for i, op in enumerate(ops)]
        for since in (0, 1, 7, 24, 25, 30):
            for limit in (1, 7, 100):
                head, entries = await store.read_since(WS, DOC, since, limit)
                assert head == 25
                assert [(e.clock, e.op_id, e.op) for e in entries] == expected[
                    since : since + limit
                ]
        paged: list[LogEntry] = []
        since = 0
        while True:
            _, page = await store.read_since(WS, DOC, since, 4)
            if not page:
                break
            paged.extend(page)
            since = page[-1].clock
        assert [(e.clock, e.op_id, e.op) for e in paged] == expected

    async def test_an_entry_carries_its_commit_time_alike_from_append_and_read_since(
        self, store: OpLogStore, reopen: Reopen
    ) -> None:
        before = time.time()
        _, first = await store.append(WS, DOC, [increment(new_op_id()), increment()])
        _, second = await store.append(WS, DOC, [increment(new_op_id())])
        after = time.time()
        appended = first + second
        stamps = [e.committed_at for e in appended]
        assert all(at is not None and before - 1 <= at <= after + 1 for at in stamps), stamps
        # One commit, one time: the ops of one append share it; a later append is not earlier.
        assert first[0].committed_at == first[1].committed_at
        assert second[0].committed_at >= first[0].committed_at  # type: ignore[operator]
        # The log read (catch-up, and the HTTP log route) shows the very value the live
        # broadcast did, and so does the listing for the head; a restart changes none of them.
        assert [e.committed_at for e in await all_entries(store)] == stamps
        (head,) = await store.list_sub_docs(WS, limit=10)
        assert head.committed_at == second[0].committed_at
        store = await reopen(store)
        assert [e.committed_at for e in await all_entries(store)] == stamps
        assert [e.to_json()["committed_at"] for e in appended] == stamps

    async def test_a_sub_doc_never_written_has_clock_zero_and_an_empty_state(
        self, store: OpLogStore
    ) -> None:
        assert await store.head(WS, "never") == 0
        assert await store.read_since(WS, "never", 0, 10) == (0, [])
        clock, state = await store.get_state(WS, "never")
        assert clock == 0
        assert state.to_json() == {
            "nodes": {"root": {"parent": None, "children": [], "fields": {}}}
        }

    async def test_get_state_returns_a_private_copy(self, store: OpLogStore) -> None:
        await store.append(
            WS,
            DOC,
            [
                incoming(
                    {
                        "type": "node.insert",
                        "node_id": "a",
                        "parent_id": "root",
                        "fields": {"tags": ["x"], "deep": {"k": 1}},
                    }
                )
            ],
        )
        clock, state = await store.get_state(WS, DOC)
        expected = state.to_json()
        tags, deep = state.nodes["a"].fields["tags"], state.nodes["a"].fields["deep"]
        assert isinstance(tags, list)
        assert isinstance(deep, dict)
        tags.append("mutated")
        deep["k"] = 2
        state.nodes["a"].children.append("ghost")
        state.nodes["root"].children.clear()
        del state.nodes["a"]
        again_clock, again = await store.get_state(WS, DOC)
        assert (again_clock, again.to_json()) == (clock, expected)
        # The store's own state was not touched either: ops still apply to the original tree.
        assert isinstance(await append_one(store, increment(node="a")), Committed)

    # -- scoping ---------------------------------------------------------------------------------

    async def test_clocks_and_op_ids_are_scoped_per_workspace_and_sub_doc(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        scopes = [("ws-1", "tree"), ("ws-1", "jobs"), ("ws-2", "tree")]
        for by, (ws, doc) in enumerate(scopes, start=1):
            # A different op under the same op_id elsewhere is not a reuse: it is another op.
            outcome = await append_one(store, increment(op_id, by=by), ws=ws, doc=doc)
            assert outcome == Committed(op_id, 1, duplicate=False)
        await append_one(store, increment(), ws="ws-1", doc="jobs")
        assert [await store.head(ws, doc) for ws, doc in scopes] == [1, 2, 1]
        assert [await field_value(store, ws=ws, doc=doc) for ws, doc in scopes] == [1, 3, 3]

    async def test_a_rejection_recorded_in_one_workspace_does_not_answer_another(
        self, store: OpLogStore
    ) -> None:
        op_id = new_op_id()
        rejected = await append_one(store, insert("b", parent="a", op_id=op_id), ws="ws-1")
        assert isinstance(rejected, Rejected)
        await append_one(store, insert("a"), ws="ws-2")
        applied = await append_one(store, insert("b", parent="a", op_id=op_id), ws="ws-2")
        assert applied == Committed(op_id, 2)

    # -- durability ------------------------------------------------------------------------------

    async def answers_of(
        self, store: OpLogStore, docs: list[str]
    ) -> list[tuple[int, dict[str, Any], list[LogEntry]]]:
        answers = []
        for doc in docs:
            clock, state = await store.get_state(WS, doc)
            assert await store.head(WS, doc) == clock
            answers.append((clock, state.to_json(), await all_entries(store, doc=doc)))
        return answers

    @pytest.mark.parametrize(
        "history",
        ["empty", "before_any_snapshot", "at_a_snapshot", "snapshots_then_more_log"],
    )
    async def test_a_reopened_store_answers_head_state_and_dedupe_identically(
        self, store: OpLogStore, reopen: Reopen, history: str
    ) -> None:
        every = self.SNAPSHOT_EVERY
        op_count = {
            "empty": 0,
            "before_any_snapshot": every - 1,
            "at_a_snapshot": every,
            "snapshots_then_more_log": 3 * every + 1,
        }[history]
        applied = [increment(new_op_id(), by=i + 1) for i in range(op_count)]
        for op in applied:
            await append_one(store, op)
        await append_one(store, insert(fresh_node(), op_id=new_op_id()), doc="other")
        rejected_op = insert("z", parent="missing", op_id=new_op_id())
        rejection = await append_one(store, rejected_op)
        before = await self.answers_of(store, [DOC, "other"])

        store = await reopen(store)
        assert await self.answers_of(store, [DOC, "other"]) == before
        for i, op in enumerate(applied):
            assert await append_one(store, op) == Committed(op.op_id, i + 1, duplicate=True)
        assert isinstance(rejection, Rejected)
        assert await append_one(store, rejected_op) == Rejected(
            rejected_op.op_id, rejection.code, rejection.message, duplicate=True
        )
        assert await append_one(store, increment()) == Committed(None, op_count + 1)
        assert await field_value(store) == sum(range(1, op_count + 1)) + 1

    async def test_a_store_reopened_twice_keeps_counting_from_its_head(
        self, store: OpLogStore, reopen: Reopen
    ) -> None:
        for round_ in range(3):
            outcomes, _ = await store.append(WS, DOC, [increment() for _ in range(3)])
            assert [o.clock for o in outcomes if isinstance(o, Committed)] == [
                3 * round_ + 1,
                3 * round_ + 2,
                3 * round_ + 3,
            ]
            store = await reopen(store)
        assert await field_value(store) == 9
        assert [e.clock for e in await all_entries(store)] == list(range(1, 10))

    # -- load ------------------------------------------------------------------------------------

    async def test_many_concurrent_appenders_on_several_sub_docs_commit_every_op_once(
        self, store: OpLogStore
    ) -> None:
        tasks, ops_per_task, docs = 20, 100, ["d0", "d1", "d2", "d3"]

        async def appender(task: int) -> list[tuple[str, str, Committed]]:
            """Sends its ops one by one; returns (sub_doc, op_id, outcome) per op."""
            sent: list[tuple[str, str, Committed]] = []
            for i in range(ops_per_task):
                doc, op_id = docs[(task + i) % len(docs)], new_op_id()
                op = increment(op_id, field=f"t{task}")
                outcome = await append_one(store, op, doc=doc)
                assert isinstance(outcome, Committed)
                sent.append((doc, op_id, outcome))
                if i % 10 == 0:  # a retry: answered from the log, never applied again
                    again = await append_one(store, op, doc=doc)
                    assert again == Committed(op_id, outcome.clock, duplicate=True)
            return sent

        results = await asyncio.wait_for(
            asyncio.gather(*(appender(t) for t in range(tasks))), timeout=120
        )
        for doc in docs:
            clock_of = {
                op_id: outcome.clock
                for result in results
                for d, op_id, outcome in result
                if d == doc
            }
            entries = await all_entries(store, doc=doc)
            assert [e.clock for e in entries] == list(range(1, len(clock_of) + 1))
            assert {str(e.op_id): e.clock for e in entries} == clock_of
            assert await store.head(WS, doc) == len(clock_of)
            _, state = await store.get_state(WS, doc)
            for task, result in enumerate(results):
                sent_here = sum(1 for d, _, _ in result if d == doc)
                assert state.nodes["root"].fields.get(f"t{task}", 0) == sent_here
            # Each task's ops to this sub-doc were committed in the order it sent them.
            for result in results:
                clocks = [outcome.clock for d, _, outcome in result if d == doc]
                assert clocks == sorted(clocks)

    async def test_a_closed_store_refuses_new_calls(self, store: OpLogStore) -> None:
        await store.close()
        with pytest.raises(RuntimeError, match="closed"):
            await store.append(WS, DOC, [increment()])

    # -- snapshots and what a store finds in the log ---------------------------------------------

    async def test_a_snapshot_is_written_by_the_commit_that_crosses_a_multiple(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        # A commit whose clocks pass a multiple of snapshot_every writes one, however far the
        # previous snapshot lies behind.
        store = await open_store(snapshot_every=5)
        seen = []
        for size in (1, 3, 2, 1, 3, 1):  # clocks 1, 4, 6, 7, 10, 11
            await store.append(WS, DOC, [increment() for _ in range(size)])
            seen.append(await log_rows.snapshot_clock())
        assert seen == [None, None, 6, 6, 10, 10]

    async def test_a_store_opened_later_replays_only_the_log_after_the_snapshot(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        writer = await open_store(snapshot_every=5)
        await writer.append(WS, DOC, [increment() for _ in range(7)])
        # Rows the snapshot covers are gone: a store that still needed them would fail.
        await log_rows.delete_ops("clock <= 5")
        fresh = await open_store(snapshot_every=5)
        assert (await fresh.get_state(WS, DOC))[0] == 7
        assert await field_value(fresh) == 7
        assert await append_one(fresh, increment()) == Committed(None, 8)

    async def test_a_gap_in_the_log_is_reported_as_corruption_not_replayed(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        writer = await open_store(snapshot_every=100)
        await writer.append(WS, DOC, [increment() for _ in range(3)])
        await log_rows.delete_ops("clock = 2")
        fresh = await open_store(snapshot_every=100)
        with pytest.raises(OpLogCorrupted, match="clock 1 to 3"):
            await fresh.append(WS, DOC, [increment()])
        with pytest.raises(OpLogCorrupted, match="clock 1 to 3"):
            await fresh.get_state(WS, DOC)

    async def test_the_state_cache_is_bounded_and_evicted_sub_docs_come_back_intact(
        self, open_store: OpenStore, log_rows: LogRows
    ) -> None:
        store = await open_store(snapshot_every=3, cache_limit=2)
        for round_ in range(4):  # each round touches 5 sub-docs through a cache of 2
            for n in range(5):
                outcome = await append_one(store, increment(new_op_id(), by=n + 1), doc=f"doc{n}")
                assert outcome == Committed(outcome.op_id, round_ + 1)
        assert log_rows.cached_sub_docs(store) <= 2
        for n in range(5):
            clock, state = await store.get_state(WS, f"doc{n}")
            assert (clock, state.nodes["root"].fields["n"]) == (4, 4 * (n + 1))

    # -- compaction (docs/operating.md, "Storage over time") -----------------------------------

    @staticmethod
    async def compact_all(store: OpLogStore, older_than: float, limit: int = 100) -> list[int]:
        """One compaction pass: the rows each batch deleted."""
        batches: list[int] = []
        start: tuple[str, str] | None = None
        while True:
            batch = await store.compact(older_than, limit=limit, start=start)
            assert batch.deleted <= limit
            batches.append(batch.deleted)
            if batch.resume is None:
                return batches
            start = batch.resume

    async def test_the_horizon_of_an_uncompacted_sub_doc_is_one(self, store: OpLogStore) -> None:
        assert await store.horizon(WS, DOC) == 1
        await store.append(WS, DOC, [increment() for _ in range(3)])
        assert await store.horizon(WS, DOC) == 1

    async def test_compaction_deletes_old_ops_below_the_latest_snapshot_only(
        self, store: OpLogStore, log_rows: LogRows
    ) -> None:
        for _ in range(10):  # one op per append: snapshots at 4, then 8
            await append_one(store, increment(new_op_id()))
        assert await log_rows.snapshot_clock() == 8
        assert await self.compact_all(store, time.time() + 60) == [7]
        assert await store.horizon(WS, DOC) == 8
        head, entries = await store.read_since(WS, DOC, 7, 100)
        assert (head, [e.clock for e in entries]) == (10, [8, 9, 10])
        assert await field_value(store) == 10
        # Nothing more to do: a second pass deletes nothing.
        assert await self.compact_all(store, time.time() + 60) == [0]

    async def test_compaction_keeps_ops_committed_after_older_than(self, store: OpLogStore) -> None:
        before = time.time() - 60
        for _ in range(10):
            await append_one(store, increment())
        assert await self.compact_all(store, before) == [0]
        assert await store.horizon(WS, DOC) == 1
        assert len(await all_entries(store)) == 10

    async def test_compaction_deletes_at_most_limit_rows_per_batch_and_resumes_where_it_stopped(
        self, store: OpLogStore
    ) -> None:
        docs = [f"doc{n}" for n in range(3)]
        for doc in docs:
            for _ in range(9):  # snapshot at 8: clocks 1..7 may go
                await append_one(store, increment(new_op_id()), doc=doc)
        batches = await self.compact_all(store, time.time() + 60, limit=3)
        assert sum(batches) == 21
        assert all(batch <= 3 for batch in batches)
        for doc in docs:
            assert await store.horizon(WS, doc) == 8
            assert await field_value(store, doc=doc) == 9

    async def test_a_sub_doc_compacted_up_to_its_head_rebuilds_after_a_restart(
        self, store: OpLogStore, reopen: Reopen
    ) -> None:
        for _ in range(8):  # the snapshot is at the head: every op below it may go
            await append_one(store, increment(new_op_id()))
        assert await self.compact_all(store, time.time() + 60) == [7]
        store = await reopen(store)
        assert await store.head(WS, DOC) == 8
        assert await store.horizon(WS, DOC) == 8
        assert (await store.get_state(WS, DOC))[0] == 8
        assert await field_value(store) == 8
        assert await append_one(store, increment()) == Committed(None, 9)
        assert [e.clock for e in await all_entries(store)] == [8, 9]
        listed = await store.list_sub_docs(WS, limit=10)
        assert [(d.sub_doc, d.clock) for d in listed] == [(DOC, 9)]

    async def test_compaction_forgets_the_op_ids_of_the_ops_it_deletes(
        self, store: OpLogStore
    ) -> None:
        # The op_id record of a compacted op goes with it (bounded storage): a resend after the
        # retention is decided afresh, which is why the retention outlives the SDK's outbox
        # (docs/configuration.md, `oplog_retention_seconds`).
        first = new_op_id()
        await append_one(store, increment(first))
        for _ in range(7):
            await append_one(store, increment(new_op_id()))
        await self.compact_all(store, time.time() + 60)
        assert await append_one(store, increment(first)) == Committed(first, 9)

    async def test_expire_rejections_deletes_old_rejection_records_in_bounded_batches(
        self, store: OpLogStore
    ) -> None:
        op_ids = [new_op_id() for _ in range(3)]
        for op_id in op_ids:
            outcome = await append_one(store, insert(fresh_node(), parent="nowhere", op_id=op_id))
            assert isinstance(outcome, Rejected)
        assert await store.expire_rejections(time.time() - 60, limit=10) == 0
        assert await store.expire_rejections(time.time() + 60, limit=2) == 2
        assert await store.expire_rejections(time.time() + 60, limit=2) == 1
        assert await store.expire_rejections(time.time() + 60, limit=2) == 0
        # A retry is decided afresh: rejected again, not as a duplicate.
        again = await append_one(store, insert(fresh_node(), parent="nowhere", op_id=op_ids[0]))
        assert isinstance(again, Rejected)
        assert not again.duplicate

    async def test_compaction_verbs_refuse_a_limit_below_one(self, store: OpLogStore) -> None:
        with pytest.raises(ValueError, match="limit"):
            await store.compact(time.time(), limit=0)
        with pytest.raises(ValueError, match="limit"):
            await store.expire_rejections(time.time(), limit=0)

    async def test_stats_show_the_oldest_op_still_in_the_log(self, store: OpLogStore) -> None:
        assert (await store.stats()).oldest_committed_at is None
        began = time.time()
        for _ in range(9):
            await append_one(store, increment(new_op_id()))
        stats = await store.stats()
        assert stats.oldest_committed_at is not None
        assert began - 5 <= stats.oldest_committed_at <= time.time() + 5
        if not stats.estimated:
            assert stats.op_rows == 9
        await self.compact_all(store, time.time() + 60)
        after = await store.stats()
        assert after.oldest_committed_at is not None
        assert after.oldest_committed_at >= stats.oldest_committed_at
        if not after.estimated:
            assert after.op_rows == 2
