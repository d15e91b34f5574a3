"""The machine's lane stamps (docs/client.md#exactly-once): every op carries the client id, its
lane seq and `minted_at`, the same on every resend; `seq_gap` resends in order; a hole the client
left (a dropped or discarded op, a failed outbox write) is closed by renumbering."""

from __future__ import annotations

import json
from typing import Any

from cv_workspace_client._core.effects import Restamp, Wait
from cv_workspace_client._core.machine import OutboxMachine, Persist, Resolve, Send
from cv_workspace_client.errors import ConnectionFailedError, InvalidRequestError, OpRejectedError

from ..machine_helpers import commit_results, inc, make_machine, of_type, persist_all

WS, DOC = "ws1", "doc"
CLIENT = "client-0000000000001"


def stamped_machine(lane_seqs: dict[tuple[str, str], int] | None = None) -> OutboxMachine:
    machine = make_machine()
    machine.use_lanes(CLIENT, lane_seqs or {})
    return machine


def stamps(rows: Any) -> list[tuple[str, int, int]]:
    bodies = [json.loads(row.op_json) for row in rows]
    return [(body["client_id"], body["seq"], body["minted_at"]) for body in bodies]


def seqs_of(rows: Any) -> list[int]:
    return [seq for _, seq, _ in stamps(rows)]


def gap(send: Send, index: int, expected: int) -> list[dict[str, Any]]:
    """Results: ops before `index` committed, the rest `seq_gap` (the first says `expected`)."""
    results: list[dict[str, Any]] = []
    for i, row in enumerate(send.rows):
        if i < index:
            results.append({"op_id": row.op_id, "clock": i + 1, "duplicate": False})
        else:
            error: dict[str, Any] = {"code": "seq_gap", "message": "gap"}
            if i == index:
                error["expected_seq"] = expected
            results.append({"op_id": row.op_id, "error": error, "duplicate": False})
    return results


def lost_answer() -> ConnectionFailedError:
    return ConnectionFailedError("connection_failed", "no answer")


def test_every_op_is_stamped_once_and_resent_with_the_same_stamp() -> None:
    machine = stamped_machine({(WS, DOC): 6})
    machine.submit(WS, DOC, [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    assert stamps(send.rows) == [(CLIENT, 7, 1_700_000_000_000), (CLIENT, 8, 1_700_000_000_000)]
    machine.batch_failed(send.batch_id, lost_answer())
    (wait,) = of_type(machine.decisions(), Wait)
    machine.timer_fired(WS, DOC, wait.token)
    (again,) = of_type(machine.decisions(), Send)
    assert again.body() == send.body()  # byte for byte: the same seq and minted_at


def test_a_restarted_machine_resends_the_stored_stamp_and_goes_on_from_the_kept_seq() -> None:
    first = stamped_machine()
    first.submit(WS, DOC, [inc()])
    (persist,) = of_type(first.decisions(), Persist)
    # What the outbox file keeps: the row, and the lane's last minted seq.
    restored = make_machine()
    restored.use_lanes(CLIENT, {(WS, DOC): 1})
    restored.restore(persist.rows)
    (resend,) = of_type(restored.decisions(), Send)
    assert resend.rows[0].op_json == persist.rows[0].op_json
    restored.submit(WS, DOC, [inc()])
    (new,) = of_type(restored.decisions(), Persist)
    assert seqs_of(new.rows) == [2]


def test_seq_gap_below_nothing_missing_resends_the_lane_in_order_after_a_backoff() -> None:
    machine = stamped_machine()
    machine.submit(WS, DOC, [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    # The server expects seq 1, which is this batch's first: a copy is still on its way.
    machine.batch_answered(send.batch_id, gap(send, 0, expected=1))
    decisions = machine.decisions()
    assert not of_type(decisions, Resolve)
    assert not of_type(decisions, Restamp)
    (wait,) = of_type(decisions, Wait)
    machine.timer_fired(WS, DOC, wait.token)
    (again,) = of_type(machine.decisions(), Send)
    assert again.body() == send.body()


def test_ops_before_a_gap_are_answered_and_the_rest_resent_in_order() -> None:
    machine = stamped_machine()
    machine.submit(WS, DOC, [inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_answered(send.batch_id, gap(send, 1, expected=2))
    decisions = machine.decisions()
    (resolve,) = of_type(decisions, Resolve)
    assert [seq for seq, _ in resolve.outcomes] == [send.rows[0].seq]
    (wait,) = of_type(decisions, Wait)
    machine.timer_fired(WS, DOC, wait.token)
    (again,) = of_type(machine.decisions(), Send)
    assert [row.op_id for row in again.rows] == [row.op_id for row in send.rows[1:]]


def test_a_hole_the_client_left_is_closed_by_renumbering_the_lane_before_resending() -> None:
    machine = stamped_machine()
    machine.submit(WS, DOC, [inc(), inc(), inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    # The whole request is refused for its op 1 (nothing applied): that op is dropped ...
    machine.batch_failed(
        send.batch_id, InvalidRequestError("invalid_field", "field missing", op_index=1)
    )
    (resend,) = of_type(machine.decisions(), Send)
    assert seqs_of(resend.rows) == [1, 3, 4]
    # ... so the server decides 1 and waits for 2, which will never come.
    machine.batch_answered(resend.batch_id, gap(resend, 1, expected=2))
    decisions = machine.decisions()
    (restamp,) = of_type(decisions, Restamp)
    assert not of_type(decisions, Send)  # nothing leaves before the outbox holds the new stamps
    assert [row.seq for row in restamp.rows] == [row.seq for row in resend.rows[1:]]
    assert seqs_of(restamp.rows) == [2, 3]
    assert restamp.lane_seqs == ((WS, DOC, 3),)
    for old, new in zip(resend.rows[1:], restamp.rows, strict=True):
        # Only the seq changed: the app's bytes, the op_id and minted_at are as they were.
        old_seq, new_seq = json.loads(old.op_json)["seq"], json.loads(new.op_json)["seq"]
        assert new.op_json == old.op_json.replace(f'"seq":{old_seq},', f'"seq":{new_seq},')
    machine.restamped([row.seq for row in restamp.rows], None)
    (final,) = of_type(machine.decisions(), Send)
    assert final.rows == restamp.rows
    machine.batch_answered(final.batch_id, commit_results(final, 2))
    machine.decisions()
    machine.submit(WS, DOC, [inc()])
    (persist,) = of_type(machine.decisions(), Persist)
    assert seqs_of(persist.rows) == [4]  # the lane goes on with no gap


def test_an_expected_seq_above_the_ops_own_renumbers_it_upward() -> None:
    """A stale copy of an op this client gave up took seq 5 after the lane was renumbered over
    it: the server refuses E (seq 5) with `expected_seq` 6. E and the op behind it are
    renumbered 6, 7 (never dropped, never answered as duplicates) and the lane goes on at 8."""
    machine = stamped_machine({(WS, DOC): 4})
    machine.submit(WS, DOC, [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    assert seqs_of(send.rows) == [5, 6]
    machine.batch_answered(send.batch_id, gap(send, 0, expected=6))
    decisions = machine.decisions()
    assert not of_type(decisions, Resolve)
    (restamp,) = of_type(decisions, Restamp)
    assert seqs_of(restamp.rows) == [6, 7]
    assert [row.op_id for row in restamp.rows] == [row.op_id for row in send.rows]
    assert restamp.lane_seqs == ((WS, DOC, 7),)
    machine.restamped([row.seq for row in restamp.rows], None)
    (again,) = of_type(machine.decisions(), Send)
    assert again.rows == restamp.rows
    machine.batch_answered(again.batch_id, commit_results(again, 6))
    machine.decisions()
    assert machine.pending_count == 0
    machine.submit(WS, DOC, [inc()])
    (persist,) = of_type(machine.decisions(), Persist)
    assert seqs_of(persist.rows) == [8]


def test_a_failed_restamp_write_keeps_the_old_stamps_and_retries() -> None:
    machine = stamped_machine({(WS, DOC): 1})
    machine.submit(WS, DOC, [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    machine.batch_answered(send.batch_id, gap(send, 0, expected=1))
    (restamp,) = of_type(machine.decisions(), Restamp)
    machine.restamped([row.seq for row in restamp.rows], OSError("disk full"))
    (wait,) = of_type(machine.decisions(), Wait)
    machine.timer_fired(WS, DOC, wait.token)
    (again,) = of_type(machine.decisions(), Send)
    assert again.body() == send.body()
    machine.submit(WS, DOC, [inc()])
    (persist,) = of_type(machine.decisions(), Persist)
    assert seqs_of(persist.rows) == [4]  # the counter was not lowered


def test_a_failed_outbox_write_mints_the_lost_seqs_again() -> None:
    machine = stamped_machine()
    machine.submit(WS, DOC, [inc()])
    persist_all(machine)
    machine.submit(WS, DOC, [inc(), inc()])
    (lost,) = of_type(machine.decisions(), Persist)
    assert seqs_of(lost.rows) == [2, 3]
    machine.persist_failed([row.seq for row in lost.rows], OSError("disk full"))
    machine.decisions()
    machine.submit(WS, DOC, [inc()])
    (persist,) = of_type(machine.decisions(), Persist)
    assert seqs_of(persist.rows) == [2]


def test_op_expired_is_a_final_rejection_and_the_lane_goes_on() -> None:
    machine = stamped_machine()
    machine.submit(WS, DOC, [inc(), inc()])
    (send,) = of_type(persist_all(machine), Send)
    results = commit_results(send, 5)
    results[0] = {
        "op_id": send.rows[0].op_id,
        "error": {"code": "op_expired", "message": "too old", "clock": 4},
        "duplicate": False,
    }
    machine.batch_answered(send.batch_id, results)
    (resolve,) = of_type(machine.decisions(), Resolve)
    outcomes = dict(resolve.outcomes)
    expired = outcomes[send.rows[0].seq]
    assert isinstance(expired, OpRejectedError)
    assert expired.code == "op_expired"
    assert not expired.retryable
    assert outcomes[send.rows[1].seq].clock == 6  # type: ignore[union-attr]
    assert machine.pending_count == 0
