"""The commit pipeline of one sub-doc, without I/O (docs/concepts.md; STYLE: sans-I/O core).

A backend calls `plan_commit` inside its write transaction with:

- the cached state and head clock of the sub-doc (the state is mutated in place),
- the incoming ops of one `append`,
- what the log already holds for their op_ids (`recorded`, looked up with `op_ids_to_look_up`),

and gets back a `CommitPlan`: one outcome per op, the log rows and rejections to write, the new
head clock, and the undo functions that take the state back to where it was. The backend writes
the rows in the same transaction and calls `plan.revert()` if that transaction does not reach
disk, so its cache never runs ahead of the log.

Rules (docs/concepts.md):

- an op whose op_id has an outcome (recorded, or decided earlier in the same batch) is a
  duplicate: same fingerprint → that outcome again with `duplicate=True`; different fingerprint →
  `op_id_reuse`, nothing applied, nothing recorded;
- otherwise the reducer runs: rejected → the rejection is recorded under the op_id (consuming no
  clock); applied → clock + 1 and a new log row;
- an op without op_id is never deduped (applied once per send) and its rejection is not recorded;
- `atomic=True`: the first op whose outcome is a rejection of any kind (reducer, recorded, reuse)
  fails the batch. Nothing the batch applied stays: every applied op is undone (LIFO) and answered
  `atomic_aborted`, as is every op after the failure that was not already decided by the log.
  Only a fresh reducer rejection of the failing op is recorded. Ops that were decided before this
  batch keep their stored outcomes (a committed op is committed; saying otherwise would make a
  client believe an applied op was not).

Lanes and marks (docs/ops.md#exactly-once): an op with `client_id` and `seq` belongs to the lane
`(workspace, sub_doc, client_id)`, whose mark (`marks`) is the highest seq decided in it:

- an op whose op_id has an outcome is answered from it, as above;
- else `seq <= mark`: minted before the window (`expired_before`) → `Forgotten` (decided
  before, its record compacted): never applied again; minted inside it (or no window) →
  `seq_gap` with `expected_seq = mark + 1` (its seq went to another op: renumber it), and every
  later op of the batch is refused `seq_gap` too; no `minted_at` (or one from the future) under
  a window → `op_expired` (`_at_or_below_mark`);
- else `seq > mark + 1` → `seq_gap` (carrying the expected seq), not recorded, and every later op
  of the batch is refused `seq_gap` too: seq n+1 is never decided before n;
- else (`seq == mark + 1`) the op is decided as above and the mark moves to `seq`, whether the
  reducer applied or rejected it (both are decisions). An atomic batch failed by a decision
  (a rejection of any kind but `seq_gap`) records its `atomic_aborted` lane ops and moves the
  mark past them, so the lane has no hole its client cannot fill; one failed by `seq_gap`
  records nothing and keeps every mark (the client resends the batch).

An op without a lane but with `minted_at` older than `expired_before` (milliseconds) and no op_id
record is refused `op_expired`, not recorded: its record may have been compacted, so it may have
been applied already (`test_an_op_minted_before_the_window_without_record_is_expired`).

Compare-and-set (docs/ops.md#conflicts): an append with `if_clock` decides its ops only if the
sub-doc's head is exactly `if_clock` when the batch is decided. Otherwise every op that would
reach the reducer is refused `version_conflict` (carrying the head clock), recorded like a
reducer rejection (so a retry gets it again and its lane moves on), and nothing is applied. Ops
decided before (on record, or below their lane's mark) keep their stored answers: dedupe is
decided before the clock check, so a retry of a batch that did commit is answered
`duplicate: true`, never a conflict
(`test_a_retry_of_a_conditional_batch_that_committed_is_a_duplicate_not_a_conflict`).

Why a recorded rejection fails an atomic batch too: a retry of an atomic batch whose op 2 was
rejected must not now commit ops 1 and 3 on their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from cv_mutations import Node, OpRejected, SubDocState, Undo, apply_op
from cv_mutations.ops import parse_op
from cv_mutations.state import copy_json
from cv_server.oplog.values import (
    Committed,
    Forgotten,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    Outcome,
    Rejected,
)

__all__ = [
    "ATOMIC_ABORTED",
    "OP_EXPIRED",
    "OP_ID_REUSE",
    "SEQ_GAP",
    "VERSION_CONFLICT",
    "CommitPlan",
    "NewRejection",
    "Recorded",
    "RecordedCommit",
    "RecordedRejection",
    "copy_state",
    "op_ids_to_look_up",
    "plan_commit",
    "rebuild_from_log",
    "snapshot_due",
]

#: Answer codes the pipeline itself produces (never recorded).
OP_ID_REUSE: Final = "op_id_reuse"
ATOMIC_ABORTED: Final = "atomic_aborted"
SEQ_GAP: Final = "seq_gap"
OP_EXPIRED: Final = "op_expired"
#: An `if_clock` append whose sub-doc moved on (recorded, as a reducer rejection is).
VERSION_CONFLICT: Final = "version_conflict"


@dataclass(frozen=True, slots=True)
class RecordedCommit:
    """The log holds this op_id at `clock`."""

    clock: int
    fingerprint: str


@dataclass(frozen=True, slots=True)
class RecordedRejection:
    """The log holds a rejection for this op_id."""

    code: str
    message: str
    fingerprint: str


Recorded = RecordedCommit | RecordedRejection


@dataclass(frozen=True, slots=True)
class NewRejection:
    """A reducer rejection to record, so a retry of the op gets it again."""

    op_id: str
    fingerprint: str
    code: str
    message: str


@dataclass(slots=True)
class CommitPlan:
    """What one `append` decided. Write `entries` (with `fingerprints`) and `rejections` in one
    transaction, then answer `outcomes`; if that transaction fails, call `revert()`."""

    outcomes: list[Outcome]
    #: The log rows to insert, in clock order: also what to broadcast once durable.
    entries: list[LogEntry]
    #: `fingerprints[i]` is the fingerprint of `entries[i]`.
    fingerprints: list[str]
    rejections: list[NewRejection]
    #: Undo functions of the ops still applied to the state, in apply order.
    undos: list[Undo]
    #: The head clock after the batch (the head before it if nothing was applied).
    clock: int
    #: The head clock before the batch.
    base_clock: int
    #: The lanes' new marks (client_id → seq) to write with the batch.
    marks: dict[str, int] = field(default_factory=dict)

    def revert(self) -> None:
        """Take the state back to where it was before `plan_commit` (LIFO)."""
        while self.undos:
            self.undos.pop()()


def op_ids_to_look_up(ops: Iterable[IncomingOp]) -> list[str]:
    """The distinct op_ids of `ops`, in first-seen order: what the backend must look up."""
    distinct: dict[str, None] = {}
    for incoming in ops:
        op_id = incoming.op.op_id
        if op_id is not None:
            distinct[op_id] = None
    return list(distinct)


def _as_duplicate(outcome: Outcome) -> Outcome:
    if type(outcome) is Committed:
        return Committed(outcome.op_id, outcome.clock, True)
    if isinstance(outcome, Forgotten):
        return outcome
    assert isinstance(outcome, Rejected)
    return Rejected(outcome.op_id, outcome.code, outcome.message, True)


def _gap(op_id: str | None, expected: int | None) -> Rejected:
    message = (
        f"seq {expected} of this lane has not been decided yet: send it first"
        if expected is not None
        else "an earlier op of this batch is out of sequence: send it again after it"
    )
    return Rejected(op_id, SEQ_GAP, message, expected_seq=expected)


def _at_or_below_mark(
    op_id: str | None, minted_at: int | None, mark: int, clock: int, expired_before: int | None
) -> Forgotten | Rejected:
    """The answer to a lane op at or below its mark whose op_id is not on record.

    Invariant: such an op is answered as a duplicate only if its record could have been
    compacted, i.e. it was minted before `expired_before` (the window less the skew). Minted
    after it, a decision under its op_id would still be on record, so its seq was decided for
    another op (a stale copy of an op the SDK renumbered over) and this op was never applied:
    it is refused `seq_gap` with `expected_seq = mark + 1`, so its client renumbers and sends it
    again. With no window (`expired_before` None) records are kept forever: the same refusal.
    An op that cannot prove its age (no `minted_at`, or one later than now plus the skew) under
    a window is `op_expired`: neither applied on a guess nor claimed as applied. Pinned by
    `test_a_recent_op_below_its_mark_without_record_is_refused_so_it_is_renumbered` (both
    backends), `test_a_renumbered_op_is_applied_after_a_stale_copy_took_its_seq` and
    `test_a_lane_op_without_minted_at_below_its_mark_is_expired`,
    `test_a_lane_op_dated_in_the_future_below_its_mark_is_expired`
    (tests/server/test_oplog_pipeline.py); docs/ops.md#exactly-once.
    """
    if expired_before is None or (minted_at is not None and minted_at >= expired_before):
        return Rejected(
            op_id,
            SEQ_GAP,
            f"seq {mark} of this lane was decided for another op and this op_id is not on"
            f" record: send it again as seq {mark + 1}",
            expected_seq=mark + 1,
        )
    if minted_at is None:
        return Rejected(
            op_id,
            OP_EXPIRED,
            "at or below its lane's mark, not on record and without minted_at: it may have"
            " been applied already, so it is not applied now",
            clock=clock,
        )
    return Forgotten(op_id)


def _conflict(op_id: str | None, clock: int) -> Rejected:
    return Rejected(
        op_id,
        VERSION_CONFLICT,
        f"the sub-doc is at clock {clock}, not the expected one: read it again and retry",
        clock=clock,
    )


def with_head(outcomes: list[Outcome], clock: int) -> list[Outcome]:
    """`outcomes` with every `version_conflict` carrying `clock` (a recorded conflict answered
    again is stored without the clock it met: it gets the head it meets now)."""
    return [
        replace(o, clock=clock)
        if type(o) is Rejected and o.code == VERSION_CONFLICT and o.clock is None
        else o
        for o in outcomes
    ]


def _reuse(op_id: str) -> Rejected:
    return Rejected(op_id, OP_ID_REUSE, f"op_id {op_id!r} was already used for a different op")


_ABORTED_MESSAGE: Final = "not applied: another op of the atomic batch was rejected"


def plan_commit(
    state: SubDocState,
    clock: int,
    ops: Sequence[IncomingOp],
    recorded: Mapping[str, Recorded],
    *,
    atomic: bool = False,
    marks: Mapping[str, int] | None = None,
    expired_before: int | None = None,
    latest_minted_at: int | None = None,
    if_clock: int | None = None,
) -> CommitPlan:
    """Decide every op of one `append` against `state` (at head `clock`), mutating `state`.

    `recorded` maps op_id → what the log already holds for it (only the op_ids of `ops` matter);
    `marks` maps client_id → its lane's mark (absent: 0); `expired_before` is the oldest
    `minted_at` (ms) still inside the dedupe window (None: no window, records are kept forever);
    `latest_minted_at` the latest an op can honestly carry (now plus the skew; None: any).
    `if_clock`: decide nothing new unless the head is exactly this clock (compare-and-set).
    Returns the plan; the state now reflects exactly the plan's `entries`, and `plan.marks` holds
    the lanes' new marks.
    """
    conflict = if_clock is not None and if_clock != clock
    # op_id → (fingerprint, outcome, decided by this batch's reducer run). Seeded from the log;
    # every op_id decided below joins it, so a repeat inside the batch is a duplicate too.
    known: dict[str, tuple[str, Outcome, bool]] = {}
    for recorded_id, record in recorded.items():
        stored: Outcome
        if isinstance(record, RecordedCommit):
            stored = Committed(recorded_id, record.clock)
        else:
            stored = Rejected(recorded_id, record.code, record.message)
        known[recorded_id] = (record.fingerprint, stored, False)
    base_clock = clock
    outcomes: list[Outcome] = []
    entries: list[LogEntry] = []
    fingerprints: list[str] = []
    rejections: list[NewRejection] = []
    undos: list[Undo] = []
    # Indexes of outcomes reporting an op this batch applied: what an atomic abort rewrites.
    applied_here: list[int] = []
    failed = False
    gapped = False
    original_marks = dict(marks or {})
    lanes = dict(original_marks)
    moved: dict[str, int] = {}
    # Lane ops this batch answered `atomic_aborted` (recorded if the batch failed by a decision).
    aborted: list[tuple[IncomingOp, Rejected]] = []
    for index, incoming in enumerate(ops):
        op = incoming.op
        op_id = op.op_id
        fingerprint = incoming.fingerprint
        client_id, seq = op.client_id, op.seq
        mark = 0 if client_id is None else lanes.get(client_id, 0)
        outcome: Outcome
        seen = None if op_id is None else known.get(op_id)
        if seen is not None:
            assert op_id is not None
            if seen[0] != fingerprint:
                outcome = _reuse(op_id)
            else:
                outcome = _as_duplicate(seen[1])
                if seen[2] and type(outcome) is Committed:
                    applied_here.append(index)
            if client_id is not None and seq == mark + 1:
                # Answered from the record (a reuse is final too): decided, the lane moves on.
                lanes[client_id] = moved[client_id] = mark + 1
        elif gapped:
            outcome = _gap(op_id, None)
        elif seq is not None and seq <= mark:
            minted_at = op.minted_at
            if latest_minted_at is not None and minted_at is not None:
                # A date from the future proves no age: judged as no date at all.
                minted_at = None if minted_at > latest_minted_at else minted_at
            outcome = _at_or_below_mark(op_id, minted_at, mark, clock, expired_before)
            if type(outcome) is Rejected and outcome.code == SEQ_GAP:
                gapped = True
        elif seq is not None and seq > mark + 1:
            outcome = _gap(op_id, mark + 1)
            gapped = True
        elif (
            seq is None
            and expired_before is not None
            and op.minted_at is not None
            and op.minted_at < expired_before
        ):
            outcome = Rejected(
                op_id,
                OP_EXPIRED,
                "minted before the dedupe window and not on record: it may have been applied"
                " already, so it is not applied now",
                clock=clock,
            )
        elif conflict:
            outcome = _conflict(op_id, clock)
            if op_id is not None:
                rejections.append(NewRejection(op_id, fingerprint, outcome.code, outcome.message))
                known[op_id] = (fingerprint, outcome, True)
            if client_id is not None and seq is not None:
                lanes[client_id] = moved[client_id] = seq
        elif failed:
            # All-or-nothing: after the failure of an atomic batch nothing more is applied.
            outcome = Rejected(op_id, ATOMIC_ABORTED, _ABORTED_MESSAGE)
            if client_id is not None and seq is not None:
                lanes[client_id] = seq
                aborted.append((incoming, outcome))
        else:
            try:
                undo = apply_op(state, op)
            except OpRejected as exc:
                outcome = Rejected(op_id, exc.code, exc.message)
                if op_id is not None:
                    rejections.append(NewRejection(op_id, fingerprint, exc.code, exc.message))
                    known[op_id] = (fingerprint, outcome, True)
            except BaseException:
                # Anything but a rejection (a reducer bug, MemoryError) leaves the caller without
                # a plan to revert, while the state already holds this batch's earlier ops: the
                # SQLite store registers its undo only once a plan is returned, so its cache
                # would run ahead of the log. Take them back out before the error propagates.
                while undos:
                    undos.pop()()
                raise
            else:
                undos.append(undo)
                clock += 1
                entries.append(LogEntry(clock, op_id, incoming.raw))
                fingerprints.append(fingerprint)
                outcome = Committed(op_id, clock)
                if op_id is not None:
                    known[op_id] = (fingerprint, outcome, True)
                applied_here.append(index)
            if client_id is not None and seq is not None:
                lanes[client_id] = moved[client_id] = seq
        outcomes.append(outcome)
        if atomic and not failed and type(outcome) is Rejected:
            failed = True
    if failed:
        while undos:
            undos.pop()()
        entries.clear()
        fingerprints.clear()
        clock = base_clock
        for index in applied_here:
            outcome = Rejected(outcomes[index].op_id, ATOMIC_ABORTED, _ABORTED_MESSAGE)
            outcomes[index] = outcome
            if ops[index].op.seq is not None:
                aborted.append((ops[index], outcome))
        if gapped:
            # Failed by a gap: nothing of the batch was decided, its client resends it whole.
            moved.clear()
            rejections = [r for r in rejections if not _in_lane(r, ops)]
        else:
            for incoming, outcome in aborted:
                op = incoming.op
                assert op.op_id is not None
                assert op.client_id is not None
                assert op.seq is not None
                rejections.append(
                    NewRejection(op.op_id, incoming.fingerprint, outcome.code, outcome.message)
                )
                known_mark = moved.get(op.client_id, original_marks.get(op.client_id, 0))
                moved[op.client_id] = max(known_mark, op.seq)
    if if_clock is not None or recorded:
        outcomes = with_head(outcomes, clock)
    plan = CommitPlan(outcomes, entries, fingerprints, rejections, undos, clock, base_clock)
    plan.marks = moved
    return plan


def _in_lane(rejection: NewRejection, ops: Sequence[IncomingOp]) -> bool:
    """Whether the op `rejection` records carries a seq (a lane op)."""
    return any(
        incoming.op.op_id == rejection.op_id and incoming.op.seq is not None for incoming in ops
    )


def copy_state(state: SubDocState) -> SubDocState:
    """A deep copy sharing nothing mutable with `state` (cheaper than a JSON round trip)."""
    return SubDocState(
        {
            node_id: Node(
                parent=node.parent, children=list(node.children), fields=copy_json(node.fields)
            )
            for node_id, node in state.nodes.items()
        }
    )


def rebuild_from_log(
    state: SubDocState, clock: int, entries: Iterable[tuple[int, str]], key: tuple[str, str]
) -> int:
    """Apply the logged ops `entries` (clock, op as JSON text), in order, to `state`, which holds
    the sub-doc `key` at `clock`; return the clock reached. The log must continue `clock` with
    no gap and each op must apply to the state its predecessors left, else `OpLogCorrupted`
    (pinned by `test_a_gap_in_the_log_is_reported_as_corruption_not_replayed`, on both
    backends)."""
    for entry_clock, text in entries:
        if entry_clock != clock + 1:
            raise OpLogCorrupted(f"{key}: log jumps from clock {clock} to {entry_clock}")
        try:
            apply_op(state, parse_op(json.loads(text)))
        except OpRejected as exc:
            raise OpLogCorrupted(
                f"{key}: logged op at clock {entry_clock} is refused on rebuild: {exc}"
            ) from exc
        clock = entry_clock
    return clock


def snapshot_due(head: int, clock: int, every: int) -> bool:
    """Whether a commit that moves a sub-doc's head from `head` to `clock` writes a snapshot of
    the state at `clock`: when it reaches or passes a multiple of `every`. The rule reads only
    the two clocks, so every instance sharing a database takes the same snapshots, and a restart
    never rebuilds more than `every - 1` ops plus one commit's. Pinned by
    `test_a_snapshot_is_written_by_the_commit_that_crosses_a_multiple`, on both backends."""
    return clock // every > head // every
