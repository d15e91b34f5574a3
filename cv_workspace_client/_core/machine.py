"""The outbox / retry / resend state machine: the SDK's promise, without any I/O.

Sans-I/O (STYLE habit 1): no sockets, clock, storage, asyncio or randomness in here. `now`, the
op_id minter and the backoff delay generator are injected. The shell feeds events in and carries
out the decisions it drains with `decisions()`:

events (methods)                       decisions (what the shell must do next)
-------------------------------------  ----------------------------------------------------------
`submit` (ops from the app)            `Persist` rows durably, then call `persisted(seqs)`
`persisted` / `persist_failed`         `Send` a batch (HTTP or websocket), then report its fate
`batch_answered` (results arrived)     `Resolve` the app's awaiters; `Forget` answered rows
`batch_failed` (retryable or final)    `Wait` `delay` seconds, then call `timer_fired(token)`
`timer_fired` / `connection_opened`    `CountAttempt` for rows whose send failed (outbox column)
`restore` (rows found in the outbox)   `Load` the next page of a lane's backlog, then `loaded`
`loaded` / `load_failed`
`discard` (the app gives ops up)       `Discard` rows durably, then resolve what `discard` returned

The rules it keeps, each of which a test pins:

- An op is sent only after the shell confirmed it is in the outbox (`persisted`), and leaves the
  outbox (`Forget`) only once the server answered it: commit, rejection, or a final 4xx.
- Per `(workspace, sub_doc)` lane, ops leave in submission order, in batches, with **at most one
  batch in flight**: every batch is a prefix of the lane's unanswered ops, so even a stale copy of
  an old request that the network delivers late can never commit a later op before an earlier one.
- Retryable failures (connection, timeout, 5xx, 429) wait `backoff(n)` (or the server's
  Retry-After) and resend the same rows with the same op_ids; after `max_attempts` sends the lane
  gives up: awaiters get `StillPendingError(op_id)` while the rows stay in the outbox, and the lane
  is parked until the next connect, the next submit to it, or a new client on the outbox.
- A refused token (401 / 403: `AuthError`, `ForbiddenError`) is no answer about the ops: the
  lane is parked as after the last attempt, its ops stay, awaiters get `StillPendingError`.
- A final 4xx is never retried. A whole-request problem naming one op (`op_index`) fails that op
  alone and resends the others (nothing of the request was applied); `too_many_ops` and
  `body_too_large` on a multi-op batch halve the lane's batch size instead of failing anything.
- Every op is stamped when minted with the client's id, its lane seq (1, 2, 3, ... per
  `(workspace, sub_doc)`, kept by the outbox across restarts) and `minted_at` (unix ms), all
  stored in its op text, so every resend carries the same (docs/client.md#exactly-once). A
  `seq_gap` answer is retried like a lost answer: the lane's unanswered ops go again, in order.
- A large backlog is restored a page per lane at a time (`restore` with the lanes' summaries,
  then `Load` / `loaded`): memory is bounded by lanes x pages, not by the backlog. Restored rows
  still on disk are a barrier: no batch reaches past them into the lane's new ops, so every
  restored op leaves before any new op of its sub-doc, in seq order (docs/client.md), as when all
  the rows were loaded at once.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The vocabulary (values in, decisions out) has its own module; re-exported here (`__all__`).
from cv_workspace_client._core.effects import (
    BacklogRange,
    CountAttempt,
    Decision,
    Discard,
    Forget,
    LaneBacklog,
    LanePending,
    Load,
    OutboxRow,
    Persist,
    Resolve,
    Restamp,
    Send,
    Wait,
)
from cv_workspace_client._core.stamp import restamp, stamped_seq
from cv_workspace_client._core.wire import dumps_body, parse_results, row_size
from cv_workspace_client.errors import (
    AuthError,
    ForbiddenError,
    InvalidRequestError,
    OpDiscardedError,
    OpRejectedError,
    OutboxError,
    ProtocolError,
    StillPendingError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit

__all__ = [
    "BacklogRange",
    "CountAttempt",
    "Decision",
    "Discard",
    "Forget",
    "LaneBacklog",
    "LanePending",
    "Load",
    "OutboxMachine",
    "OutboxRow",
    "Persist",
    "Resolve",
    "Restamp",
    "Send",
    "Wait",
]

Key = tuple[str, str]


def _is_gap(outcome: Commit | WorkspaceError) -> bool:
    return isinstance(outcome, OpRejectedError) and outcome.code == "seq_gap"


def _expected_seq(results: Any, index: int) -> int | None:
    """The `error.expected_seq` of a `seq_gap` result (None if absent or not a seq)."""
    error = results[index].get("error")
    expected = error.get("expected_seq") if isinstance(error, Mapping) else None
    return expected if type(expected) is int and expected >= 1 else None


#: Server-side request limits that mean "send fewer ops at once", not "this op is bad".
_BATCH_TOO_BIG = frozenset({"too_many_ops", "body_too_large"})


# -- state ----------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Entry:
    row: OutboxRow
    persisted: bool
    #: The app awaits this op's answer (False for resent rows, and after a give-up).
    awaited: bool
    size: int
    #: A send of it may have been applied though its answer never came (a retryable failure).
    #: Said when it is discarded (restored ops have no awaiter to tell).
    maybe_applied: bool = False


@dataclass(slots=True, eq=False)
class _Lane:
    key: Key
    batch_cap: int
    #: Every unanswered op of the lane, in order: a persisted prefix, then ops being persisted.
    queue: deque[_Entry] = field(default_factory=deque)
    in_flight: int | None = None
    waiting_token: int | None = None
    parked: bool = False
    failures: int = 0
    last_error: WorkspaceError | None = None
    #: The highest clock the server reported for this sub-doc to this client.
    clock: int = 0
    #: Restored entries in `queue` (always its head: new ops queue behind them).
    restored: int = 0
    #: Restored rows still on disk only, all after `loaded_up_to` (the barrier for new ops).
    on_disk: int = 0
    loaded_up_to: int = 0
    #: A `Load` is out (one at a time per lane).
    loading: bool = False


@dataclass(slots=True, eq=False)
class _Batch:
    lane: _Lane
    entries: list[_Entry]
    atomic: bool


class OutboxMachine:
    """Everything the client decides about ops, as a pure state machine.

    Args:
        now: wall-clock seconds, recorded as `created_at` (never used for timing).
        new_op_id: the minter for ops submitted without an op_id (`cv_mutations.new_op_id`).
        backoff: delay in seconds before resend number `n + 1`, given `n` failed sends so far
            (full jitter in production: `random(0, min(cap, base * 2 ** (n - 1)))`).
        max_attempts: sends per lane before giving up (5).
        max_batch_ops / max_batch_bytes: stay under the server's request limits.
        retry_after_cap: the most a server's Retry-After may make a lane wait.
        restore_page: restored rows read per `Load`; default two batches (`2 * max_batch_ops`),
            so the next batch is being read while one is in flight. Not a tunable of its own.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float],
        new_op_id: Callable[[], str],
        backoff: Callable[[int], float],
        max_attempts: int = 5,
        max_batch_ops: int = 1000,
        max_batch_bytes: int = 1_000_000,
        retry_after_cap: float = 300.0,
        restore_page: int | None = None,
    ) -> None:
        if max_attempts < 1 or max_batch_ops < 1 or max_batch_bytes < 1:
            raise ValueError("max_attempts, max_batch_ops and max_batch_bytes must be >= 1")
        if restore_page is not None and restore_page < 1:
            raise ValueError("restore_page must be >= 1")
        self._now = now
        self.new_op_id = new_op_id
        self._backoff = backoff
        self.max_attempts = max_attempts
        self.max_batch_ops = max_batch_ops
        self.max_batch_bytes = max_batch_bytes
        self.retry_after_cap = retry_after_cap
        self.restore_page = restore_page or 2 * max_batch_ops
        self._lanes: dict[Key, _Lane] = {}
        #: Lanes parked because the server refused the token (until a retry unparks them).
        self._refused: set[Key] = set()
        self._batches: dict[int, _Batch] = {}
        self._unpersisted: dict[int, _Entry] = {}
        self._out: list[Decision] = []
        self._next_seq = 1
        self._next_batch = 1
        self._next_token = 1
        self._pending = 0
        self._restored = False
        #: Seqs up to this one were restored; new ops get higher ones.
        self._restored_seq = 0
        #: The id ops are stamped with (None: no lane fields) and each lane's last minted seq.
        self.client_id: str | None = None
        self._lane_seqs: dict[Key, int] = {}
        #: Outbox seq -> (entry, its row before a `Restamp` under way, the lane's counter before).
        self._restamping: dict[int, tuple[_Entry, OutboxRow, int | None]] = {}

    # -- queries -----------------------------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        """Ops submitted (or restored) and not yet answered by the server."""
        return self._pending

    @property
    def last_seq(self) -> int:
        """The seq of the latest op submitted or restored (0 before any)."""
        return self._next_seq - 1

    def oldest_pending_seq(self) -> int | None:
        """The lowest seq still unanswered (None when nothing is pending). O(sub-docs): each
        lane's queue is in seq order, so its head is its oldest."""
        if not self._pending:
            return None
        heads = [lane.queue[0].row.seq for lane in self._lanes.values() if lane.queue]
        # A lane whose loaded restored rows are all answered still has older ones on disk: none
        # of them is below `loaded_up_to + 1`.
        heads.extend(
            lane.loaded_up_to + 1
            for lane in self._lanes.values()
            if lane.on_disk and not lane.restored
        )
        heads.extend(self._unpersisted)
        return min(heads, default=None)

    def pending_in(self, workspace_id: str, sub_doc: str | None = None) -> int:
        """Unanswered ops of the workspace (of one sub-doc): O(its sub-docs)."""
        return sum(
            len(lane.queue) + lane.on_disk
            for (ws, doc), lane in self._lanes.items()
            if ws == workspace_id and (sub_doc is None or doc == sub_doc)
        )

    def lane_pending(self, workspace_id: str, sub_doc: str) -> LanePending:
        """The sub-doc's unanswered ops: those in memory, and the range of restored rows still
        on disk only. To list them all, read that range through the outbox, then call this again
        and merge (`LanePending.with_disk`): rows loaded or answered during the read are then
        where the second call says. O(the lane's loaded ops)."""
        lane = self._lanes.get((workspace_id, sub_doc))
        if lane is None:
            return LanePending((), None)
        on_disk = None
        if lane.on_disk:
            on_disk = BacklogRange(workspace_id, sub_doc, lane.loaded_up_to, self._restored_seq)
        return LanePending(tuple(entry.row for entry in lane.queue), on_disk)

    @property
    def in_flight_count(self) -> int:
        return len(self._batches)

    def acknowledged_clock(self, workspace_id: str, sub_doc: str) -> int:
        """The highest clock the server reported to this client for the sub-doc (0 if none)."""
        lane = self._lanes.get((workspace_id, sub_doc))
        return lane.clock if lane is not None else 0

    def is_parked(self, workspace_id: str, sub_doc: str) -> bool:
        lane = self._lanes.get((workspace_id, sub_doc))
        return lane is not None and lane.parked

    def refused_workspaces(self) -> frozenset[str]:
        """Workspaces with ops parked because the server refused the token they went with."""
        return frozenset(key[0] for key in self._refused)

    def workspaces(self) -> set[str]:
        """Workspaces with unanswered ops."""
        return {key[0] for key, lane in self._lanes.items() if lane.queue or lane.on_disk}

    def decisions(self) -> list[Decision]:
        """Drain the decisions taken since the last call (oldest first). Call after every event."""
        out, self._out = self._out, []
        return out

    # -- events ------------------------------------------------------------------------------------

    def use_lanes(self, client_id: str, lane_seqs: Mapping[Key, int]) -> None:
        """Stamp ops submitted from now on as `client_id`'s, each lane going on from its last
        minted seq in `lane_seqs` (what the outbox kept). Call before any `submit`."""
        self.client_id = client_id
        self._lane_seqs = dict(lane_seqs)

    def restore(
        self, rows: Iterable[OutboxRow], backlog: Iterable[LaneBacklog] | None = None
    ) -> None:
        """Take the rows a previous client left in the outbox. Call once, before any `submit`:
        resent ops go first, in their original order, with their original op_ids.

        `rows` is all of them, or (with `backlog`, each lane's count and last seq) the first
        rows of each lane, whole atomic groups: the rest is read page by page (`Load`)."""
        if self._restored or self._next_seq != 1:
            raise RuntimeError("restore() must be called once, before any submit()")
        self._restored = True
        for row in sorted(rows, key=lambda r: r.seq):
            lane = self._lane(row.workspace_id, row.sub_doc)
            lane.queue.append(_Entry(row, persisted=True, awaited=False, size=row_size(row)))
            lane.restored += 1
            lane.loaded_up_to = row.seq
            self._restored_seq = max(self._restored_seq, row.seq)
            self._pending += 1
        for summary in backlog or ():
            lane = self._lane(summary.workspace_id, summary.sub_doc)
            on_disk = max(summary.count - lane.restored, 0)
            lane.on_disk = on_disk
            self._pending += on_disk
            self._restored_seq = max(self._restored_seq, summary.last_seq)
        self._next_seq = self._restored_seq + 1
        for lane in self._lanes.values():
            self._maybe_send(lane)

    def loaded(self, workspace_id: str, sub_doc: str, rows: Sequence[OutboxRow]) -> None:
        """The rows a `Load` read: they queue behind the lane's restored rows, ahead of its new
        ops. An answer no `Load` is waiting for is ignored."""
        lane = self._lanes.get((workspace_id, sub_doc))
        if lane is None or not lane.loading:
            return
        lane.loading = False
        after = lane.loaded_up_to
        fresh = sorted(
            (
                row
                for row in rows
                if after < row.seq <= self._restored_seq
                and (row.workspace_id, row.sub_doc) == lane.key
            ),
            key=lambda row: row.seq,
        )
        entries = [_Entry(row, persisted=True, awaited=False, size=row_size(row)) for row in fresh]
        if len(rows) < self.restore_page or len(entries) >= lane.on_disk:
            # A short page is the end of the lane's backlog: whatever was counted beyond it is
            # gone from the file, and waiting for it would wedge the lane for good.
            self._pending -= max(lane.on_disk - len(entries), 0)
            lane.on_disk = 0
        else:
            lane.on_disk -= len(entries)
        if entries:
            ahead = [lane.queue.popleft() for _ in range(lane.restored)]
            lane.queue.extendleft(reversed(ahead + entries))
            lane.restored += len(entries)
            lane.loaded_up_to = fresh[-1].seq
        self._maybe_send(lane)

    def load_failed(self, workspace_id: str, sub_doc: str, error: WorkspaceError) -> None:
        """A `Load` could not be read. The lane gives up as after its last failed send (its new
        ops cannot leave before the unread rows): awaiters get `StillPendingError`, and the next
        connect, submit to it or `retry_parked` loads again."""
        lane = self._lanes.get((workspace_id, sub_doc))
        if lane is None or not lane.loading:
            return
        lane.loading = False
        lane.last_error = error
        self._give_up(lane, error)

    def submit(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[Mapping[str, Any]],
        *,
        atomic: bool = False,
    ) -> list[OutboxRow]:
        """Accept ops (JSON objects) from the app. An op without `op_id` gets one minted now,
        once: it is the op's identity for every retry and resend. Decides `Persist`; nothing is
        sent before `persisted` confirms the write."""
        self._restored = True
        lane = self._lane(workspace_id, sub_doc)
        group = self._next_seq if atomic else None
        now = self._now()
        rows: list[OutboxRow] = []
        for op in ops:
            op_id = op.get("op_id") or self.new_op_id()
            body = dict(op)
            body["op_id"] = op_id
            lane_seq: int | None = None
            if self.client_id is not None and "seq" not in body and "client_id" not in body:
                lane_seq = self._lane_seqs.get(lane.key, 0) + 1
                self._lane_seqs[lane.key] = lane_seq
                body["client_id"] = self.client_id
                body["seq"] = lane_seq
            body.setdefault("minted_at", int(now * 1000))
            row = OutboxRow(
                seq=self._next_seq,
                workspace_id=workspace_id,
                sub_doc=sub_doc,
                op_id=op_id,
                op_json=dumps_body(body),
                created_at=now,
                atomic_group=group,
                lane_seq=lane_seq,
            )
            self._next_seq += 1
            entry = _Entry(row, persisted=False, awaited=True, size=row_size(row))
            lane.queue.append(entry)
            self._unpersisted[row.seq] = entry
            rows.append(row)
        self._pending += len(rows)
        if rows:
            self._out.append(Persist(tuple(rows)))
        if lane.parked:
            # A new op is a new attempt cycle for the lane: its older ops must go first.
            self._unpark(lane)
        return rows

    def persisted(self, seqs: Iterable[int]) -> None:
        """The outbox write of these rows is durable: they may be sent."""
        lanes: dict[Key, _Lane] = {}
        gave_up: list[tuple[int, Commit | WorkspaceError]] = []
        for seq in seqs:
            entry = self._unpersisted.pop(seq, None)
            if entry is None:
                continue
            entry.persisted = True
            lane = self._lanes[(entry.row.workspace_id, entry.row.sub_doc)]
            if lane.parked and entry.awaited:
                entry.awaited = False
                gave_up.append((seq, StillPendingError(entry.row.op_id, lane.last_error)))
            lanes[lane.key] = lane
        if gave_up:
            self._out.append(Resolve(tuple(gave_up)))
        for lane in lanes.values():
            self._maybe_send(lane)

    def persist_failed(self, seqs: Iterable[int], error: BaseException) -> None:
        """The outbox write failed: these ops were never sent and never will be."""
        outcomes: list[tuple[int, Commit | WorkspaceError]] = []
        lanes: dict[Key, _Lane] = {}
        unsent: dict[Key, list[int]] = {}
        for seq in seqs:
            entry = self._unpersisted.pop(seq, None)
            if entry is None:
                continue
            lane = self._lanes[(entry.row.workspace_id, entry.row.sub_doc)]
            if entry.row.lane_seq is not None:
                unsent.setdefault(lane.key, []).append(entry.row.lane_seq)
            lane.queue.remove(entry)
            self._pending -= 1
            lanes[lane.key] = lane
            if entry.awaited:
                # The outbox's own errors already carry a code: say it once in the message.
                reason = error.message if isinstance(error, WorkspaceError) else str(error)
                outcomes.append(
                    (seq, OutboxError("outbox_write_failed", f"op {entry.row.op_id}: {reason}"))
                )
        for key, lane_seqs in unsent.items():
            # The lane's newest seqs were never stored nor sent: they are minted again, so the
            # server never waits for a seq that will not come (`seq_gap` for good).
            low, high = min(lane_seqs), max(lane_seqs)
            if high == self._lane_seqs.get(key) and len(set(lane_seqs)) == high - low + 1:
                self._lane_seqs[key] = low - 1
        if outcomes:
            self._out.append(Resolve(tuple(outcomes)))
        for lane in lanes.values():
            self._maybe_send(lane)

    def batch_answered(self, batch_id: int, results: Any) -> None:
        """The server answered batch `batch_id` with `results` (one per op, in order). An answer to
        a batch no longer in flight (it timed out and was resent) is ignored."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            return
        lane = batch.lane
        lane.in_flight = None
        outcomes = parse_results([entry.row.op_id for entry in batch.entries], results)
        if isinstance(outcomes, WorkspaceError):
            self._fail(batch, outcomes)
            return
        gap = next((i for i, o in enumerate(outcomes) if _is_gap(o)), None)
        if gap is not None:
            # The server is missing an earlier seq of the lane (a send it has not decided yet):
            # nothing from the gap on was applied. Ops before it are answered (an atomic
            # batch's are not: it failed whole), the rest go again, in order, after a backoff.
            gap_error = outcomes[gap]
            assert isinstance(gap_error, WorkspaceError)
            if gap and not batch.atomic:
                self._settle(lane, batch.entries[:gap], outcomes[:gap])
            # The gap op heads what is left of the lane (an atomic batch is all still queued).
            start = gap if batch.atomic else 0
            if self._restamp(lane, _expected_seq(results, gap), start):
                return  # the lane goes on once the outbox holds the new stamps (`restamped`)
            rest = batch.entries if batch.atomic else batch.entries[gap:]
            self._fail(
                _Batch(lane, rest, batch.atomic),
                ProtocolError("seq_gap", gap_error.message),
            )
            return
        self._settle(lane, batch.entries, outcomes)
        self._maybe_send(lane)

    def restamped(self, seqs: Iterable[int], error: BaseException | None) -> None:
        """The outbox write of a `Restamp` is durable (`error` None): its rows may be sent. If it
        failed, the rows keep their old stamps and the lane retries after a backoff (the server
        answers `seq_gap` again, and the restamp is tried again)."""
        lanes: dict[Key, _Lane] = {}
        reverted: dict[Key, list[_Entry]] = {}
        for seq in seqs:
            under_way = self._restamping.pop(seq, None)
            if under_way is None:
                continue
            entry, old, counter = under_way
            entry.persisted = True
            key = (entry.row.workspace_id, entry.row.sub_doc)
            lane = lanes[key] = self._lanes[key]
            if error is not None:
                entry.row = old
                entry.size = row_size(old)
                reverted.setdefault(key, []).append(entry)
                if counter is not None:
                    self._lane_seqs[key] = counter
        for key, lane in lanes.items():
            if key in reverted:
                reason = error.message if isinstance(error, WorkspaceError) else str(error)
                self._fail(_Batch(lane, reverted[key], False), ProtocolError("seq_gap", reason))
            else:
                self._maybe_send(lane)

    def _restamp(self, lane: _Lane, expected: int | None, start: int = 0) -> bool:
        """The server answered `seq_gap` for the op at `lane.queue[start]`: it decided exactly
        seqs 1 .. `expected` - 1 of this lane (it never decides n + 1 before n) and none of them
        under this op's op_id. Either it waits for `expected`, which this client will never send
        (that op was dropped after a whole-request refusal, or discarded, or its outbox write
        failed), or `expected` is past the op's own seq (a stale copy of an op this client gave
        up was decided at that seq after the lane was renumbered over it). Either way the op
        and those queued after it were not decided: they are renumbered `expected`,
        `expected` + 1, ... in order (their op_ids and fingerprints unchanged; an op_id on
        record is answered before its seq is looked at), durably before any is sent. Returns
        False when there is nothing to renumber.
        (tests/client/test_lane_stamps.py, tests/client/core/test_lane_stamps.py,
        test_a_dropped_op_does_not_wedge_its_lane_over_http)
        """
        client_id = self.client_id
        if client_id is None or expected is None or expected < 1:
            return False
        run: list[tuple[_Entry, int]] = []
        for entry in itertools.islice(lane.queue, start, None):
            seq = stamped_seq(entry.row.op_json, client_id) if entry.persisted else None
            if seq is None or entry.row.seq in self._restamping:
                break
            run.append((entry, seq))
        if not run or run[0][1] == expected:
            return False
        counter = self._lane_seqs.get(lane.key)
        last = expected + len(run) - 1
        whole = start + len(run) == len(lane.queue) and not lane.on_disk
        rows: list[OutboxRow] = []
        for offset, (entry, _) in enumerate(run):
            old = entry.row
            new_seq = expected + offset
            entry.row = OutboxRow(
                old.seq,
                old.workspace_id,
                old.sub_doc,
                old.op_id,
                restamp(old.op_json, client_id, new_seq),
                old.created_at,
                old.attempts,
                old.atomic_group,
                new_seq,
            )
            entry.size = row_size(entry.row)
            entry.persisted = False
            self._restamping[old.seq] = (entry, old, counter if whole else None)
            rows.append(entry.row)
        lane_seqs: tuple[tuple[str, str, int], ...] = ()
        if whole:
            # Nothing of the lane is minted past the run: the next op follows it with no gap.
            self._lane_seqs[lane.key] = last
            lane_seqs = ((lane.key[0], lane.key[1], last),)
        self._out.append(Restamp(tuple(rows), lane_seqs))
        return True

    def _settle(
        self, lane: _Lane, entries: list[_Entry], outcomes: Sequence[Commit | WorkspaceError]
    ) -> None:
        for outcome in outcomes:
            if isinstance(outcome, Commit) and outcome.clock > lane.clock:
                lane.clock = outcome.clock
        lane.failures = 0
        lane.last_error = None
        self._answer(lane, entries, outcomes)

    def batch_failed(self, batch_id: int, error: WorkspaceError) -> None:
        """Sending batch `batch_id` failed with `error` (retryable or final, see
        `WorkspaceError.retryable`). A report for a batch no longer in flight is ignored."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            return
        batch.lane.in_flight = None
        self._fail(batch, error)

    def timer_fired(self, workspace_id: str, sub_doc: str, token: int) -> None:
        """A `Wait` elapsed. Stale tokens are ignored."""
        lane = self._lanes.get((workspace_id, sub_doc))
        if lane is None or lane.waiting_token != token:
            return
        lane.waiting_token = None
        self._maybe_send(lane)

    def connection_opened(self, workspace_id: str) -> None:
        """A connection to the workspace opened: the network is back, so lanes that gave up start
        a fresh attempt cycle (their ops are resent in order)."""
        for lane in self._lanes.values():
            if lane.key[0] == workspace_id and lane.parked:
                self._unpark(lane)

    def retry_parked(self) -> None:
        """Start a fresh attempt cycle on every lane that gave up."""
        for lane in self._lanes.values():
            if lane.parked:
                self._unpark(lane)

    def discard(self, workspace_id: str, sub_doc: str | None = None) -> tuple[int, Resolve | None]:
        """The app gives up on the workspace's unanswered ops (of one sub-doc, or all): those
        not in flight leave the outbox (`Discard`, durably) and will never be sent again; their
        awaiters get `OpDiscardedError` (saying whether an earlier send may have applied it). A
        batch in flight stays: the server may be applying it now, so its ops get its answer.
        Returns how many ops were discarded (rows still on disk included) and the `Resolve` of
        their awaiters, which the shell carries out only once the `Discard` it decides is
        durable: an app told "discarded" whose op came back after a power loss and was sent
        would have one intent applied that it had given up."""
        seqs: list[int] = []
        backlog: list[BacklogRange] = []
        outcomes: list[tuple[int, Commit | WorkspaceError]] = []
        on_disk = 0
        for lane in self._lanes.values():
            if lane.key[0] != workspace_id or (sub_doc is not None and lane.key[1] != sub_doc):
                continue
            batch = self._batches.get(lane.in_flight) if lane.in_flight is not None else None
            kept = len(batch.entries) if batch is not None else 0
            # The batch in flight is the head of the lane (a prefix: see `_maybe_send`).
            while len(lane.queue) > kept:
                entry = lane.queue.pop()
                self._unpersisted.pop(entry.row.seq, None)
                seqs.append(entry.row.seq)
                if entry.awaited:
                    error = OpDiscardedError(entry.row.op_id, maybe_applied=entry.maybe_applied)
                    outcomes.append((entry.row.seq, error))
            lane.restored = min(lane.restored, kept)
            if lane.on_disk:
                backlog.append(
                    BacklogRange(lane.key[0], lane.key[1], lane.loaded_up_to, self._restored_seq)
                )
                on_disk += lane.on_disk
                self._pending -= lane.on_disk
                lane.on_disk = 0
            lane.loading = False  # a page being read now is ignored when it comes
            lane.waiting_token = None  # a retry timer set before is stale
            lane.parked = False
            lane.failures = 0
            lane.last_error = None
            self._refused.discard(lane.key)
        self._pending -= len(seqs)
        seqs.sort()
        if seqs or backlog:
            self._out.append(Discard(tuple(seqs), tuple(backlog)))
        outcomes.sort(key=lambda outcome: outcome[0])
        return len(seqs) + on_disk, Resolve(tuple(outcomes)) if outcomes else None

    # -- internals ---------------------------------------------------------------------------------

    def _lane(self, workspace_id: str, sub_doc: str) -> _Lane:
        key = (workspace_id, sub_doc)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key, batch_cap=self.max_batch_ops)
        return lane

    def _unpark(self, lane: _Lane) -> None:
        lane.parked = False
        self._refused.discard(lane.key)
        lane.failures = 0
        self._maybe_send(lane)

    def _maybe_send(self, lane: _Lane) -> None:
        cap = lane.batch_cap
        if lane.on_disk:
            # Restored rows on disk are a barrier: a batch is a prefix of the loaded restored
            # rows, never reaching into the new ops queued behind them. The next page is read
            # while the last batch of loaded ones is under way (a lane that gave up reads again
            # once it is unparked).
            if not lane.loading and not lane.parked and lane.restored <= self.max_batch_ops:
                self._load(lane)
            cap = min(cap, lane.restored)
            if not cap:
                return
        if lane.in_flight is not None or lane.waiting_token is not None or lane.parked:
            return
        if not lane.queue or not lane.queue[0].persisted:
            return
        entries: list[_Entry] = []
        group = lane.queue[0].row.atomic_group
        if group is not None:
            # An atomic call's ops travel together, alone, whatever the batch caps say.
            for entry in lane.queue:
                if entry.row.atomic_group != group:
                    break
                if not entry.persisted:
                    return
                entries.append(entry)
            if lane.on_disk and len(entries) == lane.restored:
                # The group runs to the end of what is loaded: the rest of it may be on disk
                # (the outbox loads groups whole, but a part of one must never leave alone).
                if not lane.loading:
                    self._load(lane)
                return
        else:
            size = 0
            for entry in lane.queue:
                if not entry.persisted or entry.row.atomic_group is not None:
                    break
                if entries and (len(entries) >= cap or size + entry.size > self.max_batch_bytes):
                    break
                entries.append(entry)
                size += entry.size
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(lane, entries, atomic=group is not None)
        lane.in_flight = batch_id
        self._out.append(
            Send(
                batch_id,
                lane.key[0],
                lane.key[1],
                tuple(entry.row for entry in entries),
                atomic=group is not None,
            )
        )

    def _load(self, lane: _Lane) -> None:
        lane.loading = True
        self._out.append(
            Load(lane.key[0], lane.key[1], lane.loaded_up_to, self._restored_seq, self.restore_page)
        )

    def _answer(
        self,
        lane: _Lane,
        entries: list[_Entry],
        outcomes: Sequence[Commit | WorkspaceError],
    ) -> None:
        """Entries (the head of the lane) got their answers: resolve, forget, dequeue."""
        for entry in entries:
            head = lane.queue.popleft()
            if head is not entry:  # pragma: no cover - a broken invariant must be loud
                raise AssertionError("answered entries are not the head of their lane")
        if lane.restored:  # restored entries are the head of the lane: these go first
            lane.restored -= min(lane.restored, len(entries))
        self._pending -= len(entries)
        self._out.append(Forget(tuple(entry.row.seq for entry in entries)))
        resolved = tuple(
            (entry.row.seq, outcome)
            for entry, outcome in zip(entries, outcomes, strict=True)
            if entry.awaited
        )
        if resolved:
            self._out.append(Resolve(resolved))

    def _fail(self, batch: _Batch, error: WorkspaceError) -> None:
        lane = batch.lane
        entries = batch.entries
        if error.retryable:
            lane.failures += 1
            lane.last_error = error
            for entry in entries:
                entry.maybe_applied = True
            self._out.append(CountAttempt(tuple(entry.row.seq for entry in entries)))
            if lane.failures >= self.max_attempts:
                self._give_up(lane, error)
                return
            if error.retry_after is not None:  # a 429's or 503's Retry-After wins over jitter
                delay = min(max(error.retry_after, 0.0), self.retry_after_cap)
            else:
                delay = self._backoff(lane.failures)
            token = self._next_token
            self._next_token += 1
            lane.waiting_token = token
            self._out.append(Wait(lane.key[0], lane.key[1], delay, token))
            return
        if isinstance(error, AuthError | ForbiddenError):
            # The token was refused (expired, revoked, not for this workspace): no answer about
            # the ops, which the server never looked at. Forgotten as answered, an offline app
            # whose token expired lost every op it had queued (restored ones without a word).
            # They wait, parked, for a token that may (`set_token` retries the parked lanes).
            lane.failures = 0
            lane.last_error = error
            self._refused.add(lane.key)
            self._give_up(lane, error)
            return
        lane.failures = 0
        lane.last_error = None
        if isinstance(error, InvalidRequestError) and not batch.atomic and len(entries) > 1:
            if error.code in _BATCH_TOO_BIG:
                lane.batch_cap = max(1, len(entries) // 2)
                self._maybe_send(lane)
                return
            if error.op_index is not None and 0 <= error.op_index < len(entries):
                # Nothing of the request was applied: only the named op is bad.
                culprit = entries[error.op_index]
                lane.queue.remove(culprit)
                if culprit.row.seq <= self._restored_seq:
                    lane.restored -= 1
                self._pending -= 1
                self._out.append(Forget((culprit.row.seq,)))
                if culprit.awaited:
                    self._out.append(Resolve(((culprit.row.seq, error),)))
                self._maybe_send(lane)
                return
        self._answer(lane, entries, [error] * len(entries))
        self._maybe_send(lane)

    def _give_up(self, lane: _Lane, error: WorkspaceError) -> None:
        lane.parked = True
        lane.failures = 0
        outcomes: list[tuple[int, Commit | WorkspaceError]] = []
        for entry in lane.queue:
            if entry.awaited and entry.persisted:
                entry.awaited = False
                outcomes.append((entry.row.seq, StillPendingError(entry.row.op_id, error)))
        if outcomes:
            self._out.append(Resolve(tuple(outcomes)))
