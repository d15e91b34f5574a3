"""Whatever workers do — claim, die, heartbeat, fail, complete — and whatever operators replay,
a request's row keeps the queue's invariants (Hypothesis drives the pure state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cv_server.queue import model
from cv_server.queue.errors import InvalidTransition, LeaseLost
from cv_server.queue.model import NewRequest, ProcessRequest

LEASE = 10.0
MAX_DEQUEUES = 3


class RequestLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.row: ProcessRequest = model.new_row(
            NewRequest("ws", "stage", "d_x", max_dequeues=MAX_DEQUEUES), 0.0
        )
        self.tokens: list[str] = []
        self.claims = 0

    @rule(seconds=st.sampled_from([0.0, 1.0, LEASE / 2, LEASE + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def a_worker_claims(self) -> None:
        if model.is_claimable(self.row, self.now) and model.is_exhausted(self.row):
            self.row = model.poison_exhausted(self.row, self.now)
            return
        if not model.is_claimable(self.row, self.now):
            return
        token = f"t{len(self.tokens)}"
        self.row = model.claim(
            self.row, claim_token=token, worker_id="w", lease=LEASE, now=self.now
        )
        self.tokens.append(token)
        self.claims += 1

    @precondition(lambda self: bool(self.tokens))
    @rule(which=st.integers(min_value=0), verb=st.sampled_from(["beat", "complete", "fail"]))
    def a_holder_or_a_stale_holder_acts(self, which: int, verb: str) -> None:
        token = self.tokens[which % len(self.tokens)]
        before = self.row
        current = self.row.status == "in_progress" and self.row.claim_token == token
        try:
            if verb == "beat":
                self.row = model.heartbeat(self.row, token, LEASE, self.now)
            elif verb == "complete":
                self.row = model.complete(self.row, token, {"ok": True}, self.now).row
            else:
                self.row = model.fail(self.row, token, {"code": "x"}, 1.0, self.now).row
        except LeaseLost:
            assert not current
            assert self.row == before
        else:
            # A stale token may only "succeed" as a retry that changes nothing.
            assert current or self.row == before

    @rule()
    def an_operator_replays_poison(self) -> None:
        try:
            self.row = model.replay_poison(self.row, self.now)
        except InvalidTransition:
            assert self.row.status != "poison"

    @invariant()
    def the_row_is_consistent(self) -> None:
        row = self.row
        assert 0 <= row.dequeue_count <= row.max_dequeues
        if row.status == "pending":
            assert not model.is_exhausted(row)
        if row.status == "in_progress":
            assert row.claim_token is not None
            assert row.lease_expires_at is not None
        assert (row.finished_at is not None) == row.is_finished
        if row.status == "done":
            assert row.result == {"ok": True}


TestRequestLifecycle = RequestLifecycle.TestCase
TestRequestLifecycle.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
