"""The outbox/retry/replay state machine, driven event by event: no socket, no clock, no sleep."""

from __future__ import annotations

import json

import pytest

from cv_workspace_client._core.machine import (
    CountAttempt,
    Forget,
    OutboxRow,
    Persist,
    Resolve,
    Send,
    Wait,
)
from cv_workspace_client.errors import (
    AuthError,
    ConnectionFailedError,
    ForbiddenError,
    InvalidRequestError,
    OpRejectedError,
    OutboxError,
    RateLimitedError,
    ServerError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit

from ..machine_helpers import commit_results, inc, make_machine, of_type, persist_all

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit


def test_an_op_is_persisted_before_it_is_sent() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    decisions = machine.decisions()
    assert [type(d) for d in decisions] == [Persist]
    assert machine.decisions() == []  # nothing is sent until the outbox confirms the write
    machine.persisted([decisions[0].rows[0].seq])  # type: ignore[union-attr]
    assert [type(d) for d in machine.decisions()] == [Send]


def test_a_missing_op_id_is_minted_once_and_written_into_the_stored_op() -> None:
    machine = make_machine()
    (row,) = machine.submit("ws", "tree", [inc()])
    assert row.op_id == "op00000001"
    assert json.loads(row.op_json)["op_id"] == row.op_id
    (given,) = machine.submit("ws", "tree", [{**inc(), "op_id": "mine_0001"}])
    assert given.op_id == "mine_0001"


def test_ops_of_one_sub_doc_leave_in_order_one_batch_at_a_time() -> None:
    machine = make_machine()
    first = machine.submit("ws", "tree", [inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    assert [r.seq for r in send.rows] == [r.seq for r in first]
    later = machine.submit("ws", "tree", [inc(), inc()])
    assert of_type(persist_all(machine), Send) == []  # the first batch is still in flight
    machine.batch_answered(send.batch_id, commit_results(send, 1))
    (second,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in second.rows] == [r.seq for r in later]


def test_sub_docs_have_their_own_lanes_and_pipeline_side_by_side() -> None:
    machine = make_machine()
    machine.submit("ws", "a", [inc()])
    machine.submit("ws", "b", [inc()])
    machine.submit("other", "a", [inc()])
    sends = of_type(persist_all(machine), Send)
    assert {(s.workspace_id, s.sub_doc) for s in sends} == {
        ("ws", "a"),
        ("ws", "b"),
        ("other", "a"),
    }
    assert machine.in_flight_count == 3


def test_batches_respect_the_op_count_and_byte_caps() -> None:
    machine = make_machine(max_batch_ops=2)
    machine.submit("ws", "tree", [inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    assert len(send.rows) == 2
    size = len(machine.submit("ws", "t2", [inc()])[0].op_json.encode())
    persist_all(machine)
    small = make_machine(max_batch_bytes=size * 2)
    small.submit("ws", "tree", [inc(), inc(), inc()])
    (send,) = of_type(persist_all(small), Send)
    assert len(send.rows) == 2


def test_an_answered_batch_resolves_its_ops_and_forgets_them() -> None:
    machine = make_machine()
    rows = machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    results = commit_results(send, 7)
    results[1] = {"op_id": rows[1].op_id, "error": {"code": "node_not_found", "message": "x"}}
    machine.batch_answered(send.batch_id, results)
    decisions = machine.decisions()
    (forget,) = of_type(decisions, Forget)
    assert forget.seqs == (rows[0].seq, rows[1].seq)
    (resolve,) = of_type(decisions, Resolve)
    outcomes = dict(resolve.outcomes)
    assert outcomes[rows[0].seq] == Commit(clock=7, op_id=rows[0].op_id)
    rejection = outcomes[rows[1].seq]
    assert isinstance(rejection, OpRejectedError)
    assert (rejection.code, rejection.op_id) == ("node_not_found", rows[1].op_id)
    assert machine.pending_count == 0
    assert machine.acknowledged_clock("ws", "tree") == 7


def test_a_duplicate_answer_is_a_commit_marked_duplicate() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_answered(send.batch_id, commit_results(send, 3, duplicate=True))
    (resolve,) = of_type(machine.decisions(), Resolve)
    commit = resolve.outcomes[0][1]
    assert isinstance(commit, Commit)
    assert commit.duplicate
    assert commit.clock == 3


def test_retryable_failures_wait_the_injected_backoff_and_resend_the_same_bytes() -> None:
    machine = make_machine(backoff=lambda failures: 0.5 * failures)
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    delays = []
    for _ in range(3):
        machine.batch_failed(send.batch_id, ConnectionFailedError("connection_lost"))
        decisions = machine.decisions()
        assert of_type(decisions, Resolve) == []
        assert of_type(decisions, Forget) == []
        assert len(of_type(decisions, CountAttempt)) == 1
        (wait,) = of_type(decisions, Wait)
        delays.append(wait.delay)
        assert of_type(decisions, Send) == []  # nothing leaves before the timer fires
        machine.timer_fired(wait.workspace_id, wait.sub_doc, wait.token)
        (resend,) = of_type(machine.decisions(), Send)
        assert resend.body() == send.body()
        send = resend
    assert delays == [0.5, 1.0, 1.5]


def test_a_stale_timer_does_not_send() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, ServerError("internal", status=500))
    (wait,) = of_type(machine.decisions(), Wait)
    machine.timer_fired("ws", "tree", wait.token + 100)
    assert of_type(machine.decisions(), Send) == []


def test_rate_limited_answers_wait_the_servers_retry_after() -> None:
    machine = make_machine(backoff=lambda failures: 99.0)
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, RateLimitedError("rate_limited", retry_after=7.0))
    (wait,) = of_type(machine.decisions(), Wait)
    assert wait.delay == 7.0


def test_after_the_last_attempt_the_op_stays_pending_and_the_error_carries_its_op_id() -> None:
    machine = make_machine(max_attempts=3)
    (row,) = machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    waits = 0
    for attempt in range(3):
        machine.batch_failed(send.batch_id, ConnectionFailedError("timeout"))
        decisions = machine.decisions()
        if attempt < 2:
            (wait,) = of_type(decisions, Wait)
            waits += 1
            machine.timer_fired("ws", "tree", wait.token)
            (send,) = of_type(machine.decisions(), Send)
    assert waits == 2
    assert of_type(decisions, Forget) == []  # still in the outbox
    (resolve,) = of_type(decisions, Resolve)
    ((seq, error),) = resolve.outcomes
    assert seq == row.seq
    assert isinstance(error, StillPendingError)
    assert error.op_id == row.op_id
    assert "stays in the outbox" in str(error)
    assert "resent" in str(error)
    assert machine.pending_count == 1
    assert machine.is_parked("ws", "tree")


def test_a_parked_lane_replays_in_order_on_the_next_connect() -> None:
    machine = make_machine(max_attempts=1)
    rows = machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, ConnectionFailedError("connection_lost"))
    machine.decisions()
    machine.connection_opened("other-workspace")
    assert of_type(machine.decisions(), Send) == []
    machine.connection_opened("ws")
    (replay,) = of_type(machine.decisions(), Send)
    assert [r.op_id for r in replay.rows] == [r.op_id for r in rows]
    machine.batch_answered(replay.batch_id, commit_results(replay, 1))
    decisions = machine.decisions()
    assert of_type(decisions, Resolve) == []  # their awaiters were already told
    assert of_type(decisions, Forget)[0].seqs == tuple(r.seq for r in rows)


def test_a_submit_to_a_parked_lane_sends_the_older_ops_first() -> None:
    machine = make_machine(max_attempts=1)
    old = machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, ServerError("unavailable", status=503))
    machine.decisions()
    new = machine.submit("ws", "tree", [inc()])
    (resend,) = of_type(persist_all(machine), Send)
    assert [r.seq for r in resend.rows] == [old[0].seq]  # the new op waits behind it
    machine.batch_answered(resend.batch_id, commit_results(resend, 1))
    (then,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in then.rows] == [new[0].seq]


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("malformed_json", status=400),
        InvalidRequestError("unknown_op_type", status=422),
    ],
)
def test_a_final_4xx_is_never_retried_and_answers_the_whole_batch(error: Exception) -> None:
    machine = make_machine()
    rows = machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, error)  # type: ignore[arg-type]
    decisions = machine.decisions()
    assert of_type(decisions, Wait) == []
    assert of_type(decisions, CountAttempt) == []
    assert of_type(decisions, Send) == []
    assert of_type(decisions, Forget)[0].seqs == tuple(r.seq for r in rows)
    (resolve,) = of_type(decisions, Resolve)
    assert all(outcome is error for _, outcome in resolve.outcomes)
    assert machine.pending_count == 0


def test_a_problem_naming_one_op_fails_only_that_op_and_resends_the_others() -> None:
    machine = make_machine()
    rows = machine.submit("ws", "tree", [inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, InvalidRequestError("invalid_field", op_index=1))
    decisions = machine.decisions()
    (resolve,) = of_type(decisions, Resolve)
    assert [seq for seq, _ in resolve.outcomes] == [rows[1].seq]
    (resend,) = of_type(decisions, Send)
    assert [r.seq for r in resend.rows] == [rows[0].seq, rows[2].seq]


def test_a_batch_the_server_finds_too_big_is_split_instead_of_failed() -> None:
    machine = make_machine()
    rows = machine.submit("ws", "tree", [inc() for _ in range(4)])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, InvalidRequestError("too_many_ops", status=422))
    decisions = machine.decisions()
    assert of_type(decisions, Resolve) == []
    (half,) = of_type(decisions, Send)
    assert [r.seq for r in half.rows] == [r.seq for r in rows[:2]]


def test_an_answer_that_does_not_fit_the_batch_is_retried_not_trusted() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_answered(send.batch_id, commit_results(send, 1)[:1])
    decisions = machine.decisions()
    assert of_type(decisions, Resolve) == []
    assert len(of_type(decisions, Wait)) == 1
    assert machine.pending_count == 2


def test_results_that_do_not_name_their_op_are_retried_not_matched_by_position() -> None:
    # A proxy that rewrote the answer, dropping op_ids (and maybe reordering): matched by
    # position, each op could be resolved with another op's clock.
    machine = make_machine()
    machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    anonymous = [{"clock": 2, "duplicate": False}, {"clock": 1, "duplicate": False}]
    machine.batch_answered(send.batch_id, anonymous)
    decisions = machine.decisions()
    assert of_type(decisions, Resolve) == []
    assert len(of_type(decisions, Wait)) == 1
    assert machine.pending_count == 2


def test_an_answer_for_a_batch_no_longer_in_flight_is_ignored() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, ConnectionFailedError("timeout"))
    (wait,) = of_type(machine.decisions(), Wait)
    machine.batch_answered(send.batch_id, commit_results(send, 1))  # the late, stale answer
    assert machine.decisions() == []
    assert machine.pending_count == 1
    machine.timer_fired("ws", "tree", wait.token)
    (resend,) = of_type(machine.decisions(), Send)
    machine.batch_answered(resend.batch_id, commit_results(resend, 1, duplicate=True))
    assert machine.pending_count == 0


def test_a_new_machine_replays_the_outbox_first_in_original_order() -> None:
    stored = [
        OutboxRow(5, "ws", "tree", "old_0005", json.dumps({**inc(), "op_id": "old_0005"}), 1.0),
        OutboxRow(3, "ws", "tree", "old_0003", json.dumps({**inc(), "op_id": "old_0003"}), 1.0),
        OutboxRow(4, "ws", "other", "old_0004", json.dumps({**inc(), "op_id": "old_0004"}), 1.0),
    ]
    machine = make_machine()
    machine.restore(stored)
    assert machine.pending_count == 3
    sends = {s.sub_doc: s for s in of_type(machine.decisions(), Send)}
    assert [r.op_id for r in sends["tree"].rows] == ["old_0003", "old_0005"]
    assert [r.op_id for r in sends["other"].rows] == ["old_0004"]
    (new,) = machine.submit("ws", "tree", [inc()])
    assert new.seq == 6  # seqs keep growing past what the outbox holds
    assert of_type(persist_all(machine), Send) == []  # behind the replayed batch
    machine.batch_answered(sends["tree"].batch_id, commit_results(sends["tree"], 1))
    decisions = machine.decisions()
    assert of_type(decisions, Resolve) == []  # nobody awaits replayed ops in this process
    (after,) = of_type(decisions, Send)
    assert [r.seq for r in after.rows] == [6]


def test_restore_after_submit_is_refused() -> None:
    machine = make_machine()
    machine.submit("ws", "tree", [inc()])
    with pytest.raises(RuntimeError):
        machine.restore([])


def test_an_atomic_call_travels_alone_and_whole() -> None:
    machine = make_machine(max_batch_ops=2)
    before = machine.submit("ws", "tree", [inc()])
    group = machine.submit("ws", "tree", [inc(), inc(), inc()], atomic=True)
    after = machine.submit("ws", "tree", [inc()])
    (first,) = of_type(persist_all(machine), Send)
    assert [r.seq for r in first.rows] == [before[0].seq]
    assert not first.atomic
    machine.batch_answered(first.batch_id, commit_results(first, 1))
    (second,) = of_type(machine.decisions(), Send)
    assert second.atomic
    assert [r.seq for r in second.rows] == [r.seq for r in group]
    assert '"atomic":true' in second.body()
    machine.batch_answered(second.batch_id, commit_results(second, 2))
    (third,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in third.rows] == [after[0].seq]


def test_a_failed_outbox_write_fails_the_op_and_it_is_never_sent() -> None:
    machine = make_machine()
    (row,) = machine.submit("ws", "tree", [inc()])
    machine.decisions()
    machine.persist_failed([row.seq], OSError("disk full"))
    decisions = machine.decisions()
    assert of_type(decisions, Send) == []
    (resolve,) = of_type(decisions, Resolve)
    assert isinstance(resolve.outcomes[0][1], OutboxError)
    assert machine.pending_count == 0


@pytest.mark.parametrize(
    "error",
    [AuthError("unauthorized"), ForbiddenError("forbidden_workspace")],
)
def test_a_refused_token_parks_the_lane_and_keeps_its_ops(error: WorkspaceError) -> None:
    """No answer about the ops (the server never looked at them): nothing is forgotten, the
    awaiters hear `StillPendingError` carrying the refusal, and a retry sends them again."""
    machine = make_machine()
    rows = machine.submit("ws", "tree", [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_failed(send.batch_id, error)
    decisions = machine.decisions()
    assert of_type(decisions, Forget) == []
    assert of_type(decisions, Send) == []
    assert of_type(decisions, Wait) == []
    (resolve,) = of_type(decisions, Resolve)
    outcomes = [outcome for _, outcome in resolve.outcomes]
    assert all(isinstance(o, StillPendingError) and o.last_error is error for o in outcomes)
    assert machine.pending_count == 2
    assert machine.is_parked("ws", "tree")
    machine.retry_parked()  # a new token
    (again,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in again.rows] == [r.seq for r in rows]
