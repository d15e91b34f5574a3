"""`OptimisticDoc` (the pure core of `LiveDoc`): the view is always the confirmed state with the
pending ops applied in order, whatever the server commits, rejects or interleaves from others —
checked against a from-scratch fold at every step, by Hypothesis, with the real reducers."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cv_mutations import (
    ROOT,
    NodeDelete,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    Op,
    OpRejected,
    SubDocState,
    apply_op,
)
from cv_workspace_client._core.optimistic import Diverged, OptimisticDoc

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit

NODES = ("a", "b", "c")


def _fold(ops: list[Op], pending: list[Op] = ()) -> SubDocState:  # type: ignore[assignment]
    """What the view must be: the committed ops folded from scratch, then the pending ones
    that fit, in order."""
    state = SubDocState.empty()
    for op in ops:
        apply_op(state, op)
    for op in pending:
        with contextlib.suppress(OpRejected):
            apply_op(state, op)
    return state


ops = st.one_of(
    st.builds(
        NodeInsert, node_id=st.sampled_from(NODES), parent_id=st.sampled_from((ROOT, *NODES))
    ),
    st.builds(NodeIncrement, node_id=st.sampled_from(NODES), field=st.just("c")),
    st.builds(NodeDelete, node_id=st.sampled_from(NODES)),
    st.builds(
        NodeUpdate,
        node_id=st.sampled_from(NODES),
        set=st.dictionaries(st.sampled_from(("x", "y")), st.integers(0, 3), max_size=2),
    ),
    st.builds(
        NodeMove,
        node_id=st.sampled_from(NODES),
        parent_id=st.sampled_from((ROOT, *NODES)),
        index=st.integers(0, 2),
    ),
)


class ClientServerAndOthers(RuleBasedStateMachine):
    """One client (the core under test), a server folding the real reducers, other writers."""

    def __init__(self) -> None:
        super().__init__()
        self.server = SubDocState.empty()
        self.log: list[tuple[str, Op]] = []  # (op_id, op) at clock i + 1
        self.doc = OptimisticDoc(0, SubDocState.empty())
        self.opened_at = 0  # the clock of the state the view opened with
        self.outbox: list[tuple[str, Op]] = []  # ours, not yet taken by the server
        self.answers: list[str] = []  # ours the server rejected, answer not yet delivered
        self.ours: dict[str, Op] = {}  # every op the client submitted, still pending to it
        self.decided: dict[str, bool] = {}  # op_id -> committed? (the server's dedupe record)
        self.next_id = 0

    def _id(self, who: str) -> str:
        self.next_id += 1
        return f"{who}{self.next_id}"

    @rule(op=ops)
    def client_submits(self, op: Op) -> None:
        op_id = self._id("mine")
        self.doc.local(op_id, op)
        self.outbox.append((op_id, op))
        self.ours[op_id] = op

    def _commit(self, op_id: str, op: Op) -> bool:
        try:
            apply_op(self.server, op)
        except OpRejected:
            return False
        self.log.append((op_id, op))
        return True

    @precondition(lambda self: self.ours)
    @rule(i=st.integers(0, 100))
    def client_sends_a_pending_op_again(self, i: int) -> None:
        """The SDK's advice after a cancel: the same op, under its op_id, submitted again."""
        op_id = list(self.ours)[i % len(self.ours)]
        self.doc.local(op_id, self.ours[op_id])
        self.outbox.append((op_id, self.ours[op_id]))

    @precondition(lambda self: self.outbox)
    @rule()
    def server_takes_the_clients_next_op(self) -> None:
        op_id, op = self.outbox.pop(0)  # one sub-doc: the client's ops leave in order
        if op_id in self.decided:  # deduped: the first answer stands, nothing applied again
            if not self.decided[op_id]:
                self.answers.append(op_id)
            elif op_id not in self.doc.orphans():
                # `LiveDoc.apply_op` hands the duplicate's clock to the view (`confirmed`).
                clock = next(i for i, (logged, _) in enumerate(self.log, 1) if logged == op_id)
                if self.doc.confirmed(op_id, clock):
                    self.ours.pop(op_id, None)
            return
        self.decided[op_id] = self._commit(op_id, op)
        if not self.decided[op_id]:
            self.answers.append(op_id)

    @rule(op=ops)
    def another_writer_commits(self, op: Op) -> None:
        self._commit(self._id("theirs"), op)

    @precondition(lambda self: self.doc.clock < len(self.log))
    @rule()
    def feed_delivers(self) -> None:
        clock = self.doc.clock + 1
        op_id, op = self.log[clock - 1]
        self.doc.committed(clock, op_id, op)
        self.ours.pop(op_id, None)

    @precondition(lambda self: self.doc.clock > self.opened_at)
    @rule(back=st.integers(0, 3))
    def feed_repeats_an_old_op(self, back: int) -> None:
        # A clock the feed delivered (after the state the view opened with: none before).
        clock = max(self.opened_at + 1, self.doc.clock - back)
        op_id, op = self.log[clock - 1]
        before = self.doc.state.to_json()
        self.doc.committed(clock, op_id, op)
        assert self.doc.state.to_json() == before

    @precondition(lambda self: self.answers)
    @rule(i=st.integers(0, 100))
    def a_rejection_reaches_the_client(self, i: int) -> None:
        op_id = self.answers.pop(i % len(self.answers))
        self.doc.answered(op_id)
        self.ours.pop(op_id, None)

    @rule(at_head=st.booleans())
    def the_app_restarts(self, at_head: bool) -> None:
        """A new view on the client's outbox (`LiveDoc` after a restart): the confirmed state
        read (where the feed was, or the server's head: then our ops committed but not yet
        confirmed are in it and on top of it), and every op of ours found waiting."""
        clock = len(self.log) if at_head else self.doc.clock
        self.doc = OptimisticDoc(clock, _fold([op for _, op in self.log[:clock]]))
        self.opened_at = clock
        for op_id, op in self.ours.items():
            self.doc.waiting(op_id, op)

    @precondition(
        lambda self: not self.outbox and not self.answers and self.doc.clock == len(self.log)
    )
    @rule()
    def the_view_settles_its_orphans(self) -> None:
        """`LiveDoc._settle_orphans`: nothing pending in the client, the feed at the head: an
        orphan still pending was not committed after the view's state was read."""
        for op_id in self.doc.orphans():
            self.doc.answered(op_id)
            self.ours.pop(op_id, None)

    @invariant()
    def the_view_is_the_confirmed_state_with_the_pending_ops_on_top(self) -> None:
        confirmed = [op for _, op in self.log[: self.doc.clock]]
        pending = list(self.ours.values())
        assert self.doc.pending == tuple(pending)
        assert self.doc.state.to_json() == _fold(confirmed, pending).to_json()

    @invariant()
    def a_snapshot_is_the_confirmed_state_alone_and_leaves_the_view_as_it_was(self) -> None:
        view = self.doc.state.to_json()
        clock, snapshot = self.doc.snapshot()
        assert clock == self.doc.clock
        assert snapshot.to_json() == _fold([op for _, op in self.log[:clock]]).to_json()
        assert snapshot is not self.doc.state
        assert self.doc.state.to_json() == view

    def teardown(self) -> None:
        while self.outbox:
            self.server_takes_the_clients_next_op()
        while self.doc.clock < len(self.log):
            self.feed_delivers()
        while self.answers:
            self.a_rejection_reaches_the_client(0)
        self.the_view_settles_its_orphans()
        assert self.doc.pending == ()
        assert self.doc.state.to_json() == self.server.to_json()


@pytest.mark.property
def test_the_view_follows_the_server_whatever_commits_interleave() -> None:
    run_state_machine_as_test(
        ClientServerAndOthers,
        settings=settings(
            max_examples=300,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_our_own_op_confirmed_in_turn_costs_no_rebase() -> None:
    doc = OptimisticDoc(0, SubDocState.empty())
    insert = NodeInsert(node_id="a", parent_id=ROOT)
    doc.local("op1", insert)
    view = doc.state
    calls: list[str] = []
    doc._rebase = lambda *args: calls.append("rebase")  # type: ignore[method-assign]
    doc.committed(1, "op1", insert)
    assert calls == []
    assert doc.state is view
    assert doc.pending == ()
    assert doc.clock == 1


def test_an_op_the_view_cannot_take_waits_unapplied_until_a_rebase_makes_room() -> None:
    doc = OptimisticDoc(0, SubDocState.empty())
    increment = NodeIncrement(node_id="a", field="c")
    assert doc.local("op1", increment) is False  # no node "a" yet
    assert "a" not in doc.state.nodes
    doc.committed(1, "theirs", NodeInsert(node_id="a", parent_id=ROOT))  # someone inserts it
    assert doc.state.nodes["a"].fields == {"c": 1}
    assert doc.pending == (increment,)


def test_a_committed_op_the_confirmed_state_cannot_take_is_divergence() -> None:
    doc = OptimisticDoc(0, SubDocState.empty())
    doc.local("op1", NodeInsert(node_id="a", parent_id=ROOT))
    with pytest.raises(Diverged):
        doc.committed(1, "theirs", NodeIncrement(node_id="zz", field="c"))
    fresh = SubDocState.empty()
    apply_op(fresh, NodeInsert(node_id="b", parent_id=ROOT))
    doc.resync(1, fresh)
    assert set(doc.state.nodes) >= {"a", "b"}
    assert doc.clock == 1


def test_a_diverged_view_keeps_showing_its_pending_ops_until_the_reread() -> None:
    state = SubDocState.empty()
    apply_op(state, NodeInsert(node_id="a", parent_id=ROOT))
    doc = OptimisticDoc(1, state)
    doc.local("op1", NodeIncrement(node_id="a", field="c"))
    doc.local("op2", NodeInsert(node_id="b", parent_id="a"))
    with pytest.raises(Diverged):
        doc.committed(2, "op2", NodeIncrement(node_id="zz", field="c"))  # ours, out of turn
    assert doc.state.nodes["a"].fields == {"c": 1}
    assert "b" in doc.state.nodes
    assert len(doc.pending) == 2
    assert doc.clock == 1


def test_a_resync_past_a_pending_op_s_answered_clock_drops_it_and_reapplies_the_others() -> None:
    # A `Snapshot` in place of compacted ops: the server answered op1 as committed at clock 2
    # before the feed got there, and the snapshot at clock 3 holds it; op2 is still on its way.
    doc = OptimisticDoc(0, SubDocState.empty())
    doc.local("op1", NodeInsert(node_id="a", parent_id=ROOT))
    doc.local("op2", NodeInsert(node_id="b", parent_id=ROOT))
    assert not doc.confirmed("op1", 2)  # not in the confirmed state yet: still pending
    snapshot = SubDocState.empty()
    for op in (NodeInsert(node_id="x", parent_id=ROOT), NodeInsert(node_id="a", parent_id=ROOT)):
        apply_op(snapshot, op)
    doc.resync(3, snapshot)
    assert doc.clock == 3
    assert [op.node_id for op in doc.pending] == ["b"]
    assert set(doc.state.nodes) == {ROOT, "x", "a", "b"}
