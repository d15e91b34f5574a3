"""The client's state machine paired with the real commit pipeline, through a hostile link.

Hypothesis drives one client (`OutboxMachine`, pure) against a real `SQLiteOpLogStore` on a SQLite
file, through a simulated link that drops, duplicates, delays and reorders requests, answers and
subscription frames, and crashes the client: the new incarnation is restored from what reached
the (simulated) outbox; what had not reached it is lost, as in a real crash.

At quiescence (everything delivered, timers fired, the link healthy again):

- every op that reached the outbox was applied exactly once (each is a `node.increment` by 1,
  so the counter equals the number of such ops) and no op that never reached it was applied;
- the ops of each sub-doc are in the log in submission order;
- the outbox is empty;
- each commit the client was told about carries the clock the log gives that op;
- the subscriber's clock equals the server's head, and it saw every clock exactly once, in order.

The app may also give ops up (`discard`): a discarded op leaves the outbox and is never sent
again. One the client said was never applied (`OpDiscardedError.maybe_applied` False) is never
in the log; one an earlier send may have applied is there at most once, in its place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cv_mutations import NodeInsert, fingerprint, parse_op
from cv_server.oplog import IncomingOp, LogEntry
from cv_server.sqlite.oplog import SQLiteOpLogStore
from cv_workspace_client._core.machine import (
    CountAttempt,
    Discard,
    Forget,
    OutboxMachine,
    OutboxRow,
    Persist,
    Resolve,
    Send,
    Wait,
)
from cv_workspace_client._core.subscription import ResumeTracker, Verdict
from cv_workspace_client.errors import (
    ConnectionFailedError,
    OpDiscardedError,
    StillPendingError,
)
from cv_workspace_client.models import Commit
from tests.stateful import AsyncStateMachine

from ..machine_helpers import counting_minter

WS = "ws1"
SUB_DOCS = ("a", "b")
INCREMENT = {"type": "node.increment", "node_id": "n", "field": "c", "by": 1}
index = st.integers(min_value=0, max_value=10_000)


def incoming(op_json: str) -> IncomingOp:
    raw = json.loads(op_json)
    return IncomingOp(op=parse_op(raw), raw=raw, fingerprint=fingerprint(raw))


class ClientThroughHostileLink(AsyncStateMachine):
    #: Where each example's server database goes (set by the test to a tmp_path directory).
    base_dir: Path

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="example-", dir=self.base_dir))
        self.store = self.run(SQLiteOpLogStore.open(self.dir / "server.db"))
        for sub_doc in SUB_DOCS:  # the counter every op increments
            raw = NodeInsert(node_id="n", parent_id="root").model_dump(mode="json")
            self.run(self.store.append(WS, sub_doc, [incoming(json.dumps(raw))]))
        self.minter = counting_minter("intent_")  # op_ids stay unique across incarnations
        # The durable outbox, and the writes decided but not yet durable (a crash loses them).
        self.outbox: dict[int, OutboxRow] = {}
        self.unflushed_inserts: list[OutboxRow] = []
        self.unflushed_deletes: list[int] = []
        # op_id -> (sub_doc, rank): ranks count ops in the order they reached the outbox, which
        # is the order they were submitted in (seqs restart when a client finds it empty).
        self.reached_outbox: dict[str, tuple[str, int]] = {}
        self.told: dict[str, int] = {}  # op_id -> clock of a Commit the app was given
        self.discarded: set[str] = set()  # op_ids the app gave up (`discard`)
        self.never_applied: set[str] = set()  # ... and was told no send of them was applied
        # The link: requests carry the incarnation that sent them; answers to a dead one vanish.
        self.incarnation = 0
        self.requests: list[tuple[int, Send]] = []
        self.responses: list[tuple[int, int, Any]] = []
        self.timers: list[Wait] = []
        # One subscriber per sub-doc, fed live entries through the same kind of link.
        self.frames: list[tuple[str, LogEntry]] = []
        self.trackers = {sub_doc: ResumeTracker(1) for sub_doc in SUB_DOCS}
        self.delivered: dict[str, list[int]] = {sub_doc: [] for sub_doc in SUB_DOCS}
        self.client = self.new_client([])

    # -- plumbing -------------------------------------------------------------------------------

    def new_client(self, rows: list[OutboxRow]) -> OutboxMachine:
        machine = OutboxMachine(
            now=lambda: 0.0,
            new_op_id=self.minter,
            backoff=lambda failures: 0.1 * failures,
            max_attempts=3,
            max_batch_ops=4,
        )
        machine.restore(rows)
        self.drain(machine)
        return machine

    def drain(self, machine: OutboxMachine | None = None) -> None:
        machine = machine or self.client
        for decision in machine.decisions():
            if isinstance(decision, Persist):
                self.unflushed_inserts.extend(decision.rows)
            elif isinstance(decision, Send):
                self.requests.append((self.incarnation, decision))
            elif isinstance(decision, Forget):
                self.unflushed_deletes.extend(decision.seqs)
            elif isinstance(decision, Wait):
                self.timers.append(decision)
            elif isinstance(decision, Resolve):
                self.resolved(decision)
            elif isinstance(decision, Discard):
                self.discard_rows(decision)
            else:
                assert isinstance(decision, CountAttempt)

    def discard_rows(self, discard: Discard) -> None:
        """The shell makes a discard durable before it tells anyone (`discard_pending`)."""
        for seq in discard.seqs:
            row = self.outbox.pop(seq)  # committed: the shell wrote what came before it
            self.discarded.add(row.op_id)
        for lane in discard.backlog:  # rows a paging model left on disk only
            for seq, row in list(self.outbox.items()):
                key = (row.workspace_id, row.sub_doc)
                if key == (lane.workspace_id, lane.sub_doc) and (
                    lane.after_seq < seq <= lane.up_to_seq
                ):
                    del self.outbox[seq]
                    self.discarded.add(row.op_id)

    def resolved(self, resolve: Resolve) -> None:
        for _, outcome in resolve.outcomes:
            if isinstance(outcome, Commit):
                self.told[outcome.op_id] = outcome.clock
            elif isinstance(outcome, OpDiscardedError):
                if not outcome.maybe_applied:
                    self.never_applied.add(outcome.op_id)
            else:  # the link may lose answers, but nothing here is ever rejected
                assert isinstance(outcome, StillPendingError), outcome

    def serve(self, send: Send) -> list[dict[str, Any]]:
        ops = [incoming(row.op_json) for row in send.rows]
        outcomes, entries = self.run(
            self.store.append(send.workspace_id, send.sub_doc, ops, atomic=send.atomic)
        )
        self.frames.extend((send.sub_doc, entry) for entry in entries)  # publish after commit
        return [outcome.to_json() for outcome in outcomes]

    def log(self, sub_doc: str) -> list[LogEntry]:
        entries: list[LogEntry] = self.run(self.store.read_since(WS, sub_doc, 0, 1_000_000))[1]
        return entries

    def catch_up(self, sub_doc: str, target: int | None) -> None:
        tracker = self.trackers[sub_doc]
        _, entries = self.run(self.store.read_since(WS, sub_doc, tracker.last, 1_000_000))
        for entry in entries:
            if target is not None and entry.clock > target:
                break
            assert tracker.offer(entry.clock) is Verdict.DELIVER
            self.delivered[sub_doc].append(entry.clock)

    def offer_frame(self, sub_doc: str, entry: LogEntry) -> None:
        tracker = self.trackers[sub_doc]
        verdict = tracker.offer(entry.clock)
        if verdict is Verdict.GAP:
            self.catch_up(sub_doc, entry.clock - 1)
            verdict = tracker.offer(entry.clock)
        if verdict is Verdict.DELIVER:
            self.delivered[sub_doc].append(entry.clock)

    # -- the app --------------------------------------------------------------------------------

    @rule(sub_doc=st.sampled_from(SUB_DOCS), count=st.integers(1, 3), atomic=st.booleans())
    def submit(self, sub_doc: str, count: int, atomic: bool) -> None:
        self.client.submit(WS, sub_doc, [INCREMENT] * count, atomic=atomic)
        self.drain()

    @rule(sub_doc=st.sampled_from((*SUB_DOCS, None)))
    def app_discards(self, sub_doc: str | None) -> None:
        """The app gives up what is pending (one sub-doc, or the workspace). The shell first
        writes what it had queued, then the discard, durably, then tells the callers."""
        self.outbox_commits()
        _, resolve = self.client.discard(WS, sub_doc)
        self.drain()
        if resolve is not None:
            self.resolved(resolve)

    # -- the outbox -----------------------------------------------------------------------------

    @rule(count=st.integers(1, 8))
    def outbox_commits(self, count: int = 1_000_000) -> None:
        """The outbox's writer commits the `count` oldest queued inserts and every queued delete
        (more inserts may still be queued behind them)."""
        inserts = self.unflushed_inserts[:count]
        del self.unflushed_inserts[:count]
        deletes, self.unflushed_deletes = self.unflushed_deletes, []
        for row in inserts:
            self.outbox[row.seq] = row
            self.reached_outbox[row.op_id] = (row.sub_doc, len(self.reached_outbox))
        for seq in deletes:
            self.outbox.pop(seq, None)
        self.client.persisted([row.seq for row in inserts])
        self.drain()

    # -- the link -------------------------------------------------------------------------------

    @precondition(lambda self: self.requests)
    @rule(i=index, duplicate=st.booleans())
    def request_arrives(self, i: int, duplicate: bool) -> None:
        """Any in-flight request (reordering), possibly a copy that will arrive again."""
        incarnation, send = self.requests[i % len(self.requests)]
        if not duplicate:
            self.requests.remove((incarnation, send))
        self.responses.append((incarnation, send.batch_id, self.serve(send)))

    @precondition(lambda self: self.requests)
    @rule(i=index)
    def request_is_lost(self, i: int) -> None:
        incarnation, send = self.requests.pop(i % len(self.requests))
        if incarnation == self.incarnation:  # the client's timeout notices
            self.client.batch_failed(send.batch_id, ConnectionFailedError("timeout"))
            self.drain()

    @precondition(lambda self: self.responses)
    @rule(i=index)
    def answer_arrives(self, i: int) -> None:
        incarnation, batch_id, results = self.responses.pop(i % len(self.responses))
        if incarnation == self.incarnation:
            self.client.batch_answered(batch_id, results)
            self.drain()

    @precondition(lambda self: self.responses)
    @rule(i=index)
    def answer_is_lost(self, i: int) -> None:
        """The worst moment: committed on the server, never heard by the client."""
        incarnation, batch_id, _ = self.responses.pop(i % len(self.responses))
        if incarnation == self.incarnation:
            self.client.batch_failed(batch_id, ConnectionFailedError("connection_lost"))
            self.drain()

    @precondition(lambda self: self.timers)
    @rule(i=index)
    def timer_fires(self, i: int) -> None:
        wait = self.timers.pop(i % len(self.timers))
        self.client.timer_fired(wait.workspace_id, wait.sub_doc, wait.token)
        self.drain()

    @rule()
    def connection_reopens(self) -> None:
        self.client.connection_opened(WS)
        self.drain()

    @rule()
    def client_crashes(self) -> None:
        """Process death: unflushed outbox writes, timers and open connections die with it."""
        self.incarnation += 1
        self.unflushed_inserts.clear()
        self.unflushed_deletes.clear()
        self.timers.clear()
        self.client = self.new_client(sorted(self.outbox.values(), key=lambda r: r.seq))

    # -- the subscriber's link ------------------------------------------------------------------

    @precondition(lambda self: self.frames)
    @rule(i=index, fate=st.sampled_from(["deliver", "drop", "duplicate"]))
    def live_frame(self, i: int, fate: str) -> None:
        sub_doc, entry = self.frames[i % len(self.frames)]
        if fate != "duplicate":
            self.frames.remove((sub_doc, entry))
        if fate != "drop":
            self.offer_frame(sub_doc, entry)

    @rule(sub_doc=st.sampled_from(SUB_DOCS))
    def subscriber_reconnects(self, sub_doc: str) -> None:
        """Resubscribe with since=last: the server replays the log after it."""
        self.catch_up(sub_doc, None)

    # -- what must hold at every step ---------------------------------------------------------

    @invariant()
    def at_most_one_batch_in_flight_per_sub_doc(self) -> None:
        assert self.client.in_flight_count <= len(SUB_DOCS)

    @invariant()
    def the_log_holds_each_op_at_most_once_in_submission_order(self) -> None:
        for sub_doc in SUB_DOCS:
            ours = [str(e.op_id) for e in self.log(sub_doc)[1:]]
            assert len(ours) == len(set(ours))
            ranks = [self.reached_outbox[op_id][1] for op_id in ours]  # KeyError: never persisted
            # In order: the ops the app still means. One it discarded while a request of it may
            # still be on its way (`maybe_applied`) can land after ops submitted later: see
            # `meant`.
            kept = [
                rank for op_id, rank in zip(ours, ranks, strict=True) if op_id not in self.discarded
            ]
            assert kept == sorted(kept)
            assert not self.never_applied & set(ours)

    @invariant()
    def the_subscriber_saw_each_clock_once_in_order(self) -> None:
        for sub_doc in SUB_DOCS:
            assert self.delivered[sub_doc] == list(range(2, 2 + len(self.delivered[sub_doc])))

    # -- quiescence -----------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            self.settle()
            self.check_quiescence()
        finally:
            try:
                self.run(self.store.close())
            finally:
                self.close_loop()
            shutil.rmtree(self.dir, ignore_errors=True)

    def settle(self) -> None:
        """The network heals: deliver everything, fire every timer, reconnect parked lanes."""
        for _ in range(10_000):
            self.outbox_commits()
            if self.responses:
                self.answer_arrives(0)
            elif self.requests:
                self.request_arrives(0, duplicate=False)
            elif self.timers:
                self.timer_fires(0)
            elif self.client.pending_count:
                self.connection_reopens()
            elif self.unflushed_deletes or self.unflushed_inserts:
                continue
            else:
                break
        else:  # pragma: no cover - a livelock is a failure
            raise AssertionError("the client never settled")
        while self.frames:
            self.live_frame(0, "deliver")

    def check_quiescence(self) -> None:
        assert self.client.pending_count == 0
        assert self.outbox == {}
        for sub_doc in SUB_DOCS:
            log = self.log(sub_doc)
            head = log[-1].clock
            ours = [str(entry.op_id) for entry in log[1:]]
            applied = set(ours)
            expected = sorted(
                (rank, op_id)
                for op_id, (doc, rank) in self.reached_outbox.items()
                # A discarded op is there only if a send before the discard applied it.
                if doc == sub_doc and (op_id not in self.discarded or op_id in applied)
            )
            wanted = [op_id for _, op_id in expected]
            assert sorted(ours) == sorted(wanted)  # exactly once, none lost
            assert meant(ours, self.discarded) == meant(wanted, self.discarded)  # in order
            _, state = self.run(self.store.get_state(WS, sub_doc))
            assert state.nodes["n"].fields.get("c", 0) == len(expected)
            tracker = self.trackers[sub_doc]
            if tracker.behind(head):  # the `synced` frame tells the subscriber the head
                self.catch_up(sub_doc, head)
            assert tracker.last == head
            assert self.delivered[sub_doc] == list(range(2, head + 1))
            clocks = {entry.op_id: entry.clock for entry in log}
            for op_id, clock in self.told.items():
                if self.reached_outbox[op_id][0] == sub_doc:
                    assert clocks[op_id] == clock
            assert self.client.acknowledged_clock(WS, sub_doc) <= head


def meant(op_ids: list[str], discarded: set[str]) -> list[str]:
    """The ops the app still means, in the order given. Order is promised for these. An op the
    app discarded (`discard_pending`) while a request of it may still be on its way, its
    answer lost or sent by a process that died (`maybe_applied`), may land after ops submitted
    to its sub-doc later: the client no longer controls that request, and the server has no
    fence against it."""
    return [op_id for op_id in op_ids if op_id not in discarded]


def test_every_op_is_applied_once_in_order_whatever_the_link_and_crashes_do(
    tmp_path: Path,
) -> None:
    class Example(ClientThroughHostileLink):
        base_dir = tmp_path

    run_state_machine_as_test(
        Example,
        settings=settings(
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
