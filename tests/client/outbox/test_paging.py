"""A large outbox backlog is restored a page per sub-doc at a time, never whole.

- The Hypothesis model of `core/test_machine_hostile_answers` (hostile link, refusals, crashes) with
  restores of 1-3 rows per page, page reads answered (or failing) at any moment among submits, acks,
  failures, reorders and crashes, and readers that do or do not keep atomic groups whole.
- The machine's barrier, step by step: no new op of a sub-doc leaves before its restored ops
  still on disk, and `pending_count` / `wait_synced` count those.
- The SQLite outbox: the lane index (and files from before it), the first page per lane at open,
  pages that never split an atomic group, reads in the executor while the loop writes.
- Through a real server: 20,000 pending ops replayed in order, once each, with
  `max_batch_ops=50`, while the app submits new ops to the same sub-docs.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cv_mutations import NodeInsert
from cv_workspace_client import Commit, WorkspaceClient
from cv_workspace_client._core.machine import (
    LaneBacklog,
    Load,
    OutboxMachine,
    OutboxRow,
    Send,
)
from cv_workspace_client._outbox.base import MemoryOutbox, OutboxWrite
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.errors import OutboxError, StillPendingError

from ..core.test_machine_hostile_answers import INCREMENT, RETRY_AFTER_CAP, ClientFacingEveryAnswer
from ..core.test_machine_stateful import SUB_DOCS, index
from ..helpers import WS, fast_config, server_log
from ..machine_helpers import commit_results, inc, make_machine, of_type
from .test_file_hazards import (
    damage_file,
    digest,
    siblings,
    written_outbox,
)

TIMEOUT = 60


def backlog_of(rows: list[OutboxRow]) -> list[LaneBacklog]:
    lanes: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row in rows:
        lanes[(row.workspace_id, row.sub_doc)].append(row.seq)
    return [LaneBacklog(ws, sub_doc, len(seqs), max(seqs)) for (ws, sub_doc), seqs in lanes.items()]


def page_of(
    rows: list[OutboxRow], key: tuple[str, str], after: int, up_to: int, limit: int, whole: bool
) -> list[OutboxRow]:
    """What an outbox reads for a `Load`; `whole=False` is a reader that splits atomic groups
    (the machine must still never send part of one)."""
    lane = sorted(
        (r for r in rows if (r.workspace_id, r.sub_doc) == key and after < r.seq <= up_to),
        key=lambda r: r.seq,
    )
    page = lane[:limit]
    if whole:
        for row in lane[limit:]:
            if row.atomic_group is None or row.atomic_group != page[-1].atomic_group:
                break
            page.append(row)
    return page


# -- the Hypothesis model, restoring page by page -----------------------------------------------


class ClientRestoredPageByPage(ClientFacingEveryAnswer):
    def __init__(self) -> None:
        self.page = 1
        self.whole_groups = True
        self.loads: list[tuple[int, Load]] = []
        super().__init__()

    def new_client(self, rows: list[OutboxRow]) -> OutboxMachine:
        machine = OutboxMachine(
            now=lambda: 0.0,
            new_op_id=self.minter,
            backoff=lambda failures: 0.1 * failures,
            max_attempts=3,
            max_batch_ops=4,
            retry_after_cap=RETRY_AFTER_CAP,
            restore_page=self.page,
        )
        self.rows = {row.seq: row for row in rows}
        backlog = backlog_of(rows)
        first = [
            row
            for lane in backlog
            for row in page_of(
                rows,
                (lane.workspace_id, lane.sub_doc),
                0,
                lane.last_seq,
                self.page,
                self.whole_groups,
            )
        ]
        machine.restore(first, backlog)
        self.drain(machine)
        return machine

    def drain(self, machine: OutboxMachine | None = None) -> None:
        machine = machine or self.client
        decisions = machine.decisions()
        self.loads.extend((self.incarnation, d) for d in of_type(decisions, Load))
        rest = [d for d in decisions if not isinstance(d, Load)]
        super().drain(cast(OutboxMachine, _Drained(rest)))

    @initialize(
        calls=st.lists(
            # Atomic groups no larger than the model server's smallest limit (2), as its
            # `submit_atomic` makes them: a bigger one is refused whole, as it should be.
            st.tuples(st.sampled_from(SUB_DOCS), st.integers(1, 2), st.booleans()),
            min_size=1,
            max_size=8,
        ),
        page=st.integers(1, 3),
        whole_groups=st.booleans(),
    )
    def a_previous_client_left_a_backlog(
        self, calls: list[tuple[str, int, bool]], page: int, whole_groups: bool
    ) -> None:
        """Every example starts on an outbox holding ops (some atomic groups) that a client
        which crashed wrote and never sent."""
        seq = 0
        for sub_doc, count, atomic in calls:
            group = seq + 1 if atomic else None
            for _ in range(count):
                seq += 1
                op_id = self.minter()
                op_json = orjson.dumps({**INCREMENT, "op_id": op_id}).decode()
                self.outbox[seq] = OutboxRow(seq, WS, sub_doc, op_id, op_json, 0.0, 0, group)
                self.reached_outbox[op_id] = (sub_doc, len(self.reached_outbox))
        self.client_crashes(page, whole_groups)

    @rule(page=st.integers(1, 3), whole_groups=st.booleans())
    def client_crashes(self, page: int = 1, whole_groups: bool = True) -> None:
        """Process death, then a new client that restores `page` rows per lane at a time."""
        self.page, self.whole_groups = page, whole_groups
        self.loads.clear()
        super().client_crashes()

    @precondition(lambda self: self.loads)
    @rule(i=index)
    def load_arrives(self, i: int) -> None:
        """A page read, answered at any moment (the rows on disk are what the outbox holds)."""
        incarnation, load = self.loads.pop(i % len(self.loads))
        if incarnation != self.incarnation:
            return
        rows = page_of(
            list(self.outbox.values()),
            (load.workspace_id, load.sub_doc),
            load.after_seq,
            load.up_to_seq,
            load.limit,
            self.whole_groups,
        )
        self.client.loaded(load.workspace_id, load.sub_doc, rows)
        self.drain()

    @precondition(lambda self: self.loads)
    @rule(i=index)
    def load_fails(self, i: int) -> None:
        incarnation, load = self.loads.pop(i % len(self.loads))
        if incarnation == self.incarnation:
            error = OutboxError("outbox_read_failed", "disk I/O error")
            self.client.load_failed(load.workspace_id, load.sub_doc, error)
            self.drain()

    @invariant()
    def loaded_restored_rows_stay_within_a_few_pages(self) -> None:
        machine = self.client
        bound = machine.max_batch_ops + machine.restore_page + 3  # + the rest of a group
        for lane in machine._lanes.values():
            assert lane.restored <= bound, (lane.key, lane.restored)

    def settle(self) -> None:
        self.limit = None
        for _ in range(10_000):
            self.outbox_commits()
            if self.responses:
                self.answer_arrives(0)
            elif self.requests:
                self.request_arrives(0, duplicate=False)
            elif self.loads:
                self.load_arrives(0)
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


class _Drained:
    """Hands the parent's `drain` the decisions already taken from the machine."""

    def __init__(self, decisions: list[Any]) -> None:
        self._decisions = decisions

    def decisions(self) -> list[Any]:
        return self._decisions


def test_a_backlog_restored_a_few_rows_at_a_time_is_applied_once_in_order(
    tmp_path: Path,
) -> None:
    class Example(ClientRestoredPageByPage):
        base_dir = tmp_path

    run_state_machine_as_test(
        Example,
        settings=settings(
            max_examples=200,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_a_discarded_op_that_a_dead_process_sent_may_land_after_a_later_op(
    tmp_path: Path,
) -> None:
    """The known limit of `discard_pending` (README), pinned: a client restored an op its
    previous process had sent, whose request was still on its way (held by a proxy, say). The
    app discarded it and wrote a new op, which the server committed first; then the dead
    process's request arrived and was applied too, after it. Nothing the client does can stop
    a request it no longer controls; a server-side fence could (noted in the changelog). What
    still holds: each op at most once, and the ops the app still means in order."""

    class Example(ClientRestoredPageByPage):
        base_dir = tmp_path

    model = Example()
    try:
        model.a_previous_client_left_a_backlog(calls=[("b", 1, False)], page=1, whole_groups=True)
        (restored,) = model.reached_outbox
        model.client_crashes()  # its send (incarnation 1) is still in the network
        model.request_rate_limited(i=0, retry_after=0.0)  # the new process's send: 429
        model.app_discards(sub_doc="b")
        assert restored in model.discarded
        model.submit(poison=[False], sub_doc="b")
        model.outbox_commits()
        [(_, late), (_, later)] = model.requests
        assert [row.op_id for row in late.rows] == [restored]
        model.request_arrives(i=1, duplicate=False)  # the later op, committed first
        model.request_arrives(i=0, duplicate=False)  # then the dead process's request
        model.settle()
        log = [str(entry.op_id) for entry in model.log("b")[1:]]
        assert log == [later.rows[0].op_id, restored]
    finally:
        model.teardown()  # also checks quiescence with the rules above


# -- the machine, step by step ----------------------------------------------------------------


def restored_rows(count: int, sub_doc: str = "d", first_seq: int = 1) -> list[OutboxRow]:
    return [
        OutboxRow(
            seq,
            WS,
            sub_doc,
            f"old{seq:05d}",
            orjson.dumps({**inc(), "op_id": f"old{seq:05d}"}).decode(),
            0.0,
        )
        for seq in range(first_seq, first_seq + count)
    ]


def test_new_ops_wait_behind_restored_ops_still_on_disk() -> None:
    machine = make_machine(max_batch_ops=2)  # pages of 4
    rows = restored_rows(10)
    machine.restore(rows[:4], backlog_of(rows))
    assert machine.pending_count == 10
    assert machine.last_seq == 10
    (send,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in send.rows] == [1, 2]
    (new,) = machine.submit(WS, "d", [inc()])
    assert new.seq == 11
    machine.persisted([11])
    machine.batch_answered(send.batch_id, commit_results(send, 1))
    decisions = machine.decisions()
    (send,) = of_type(decisions, Send)
    assert [r.seq for r in send.rows] == [3, 4]
    (load,) = of_type(decisions, Load)  # two left loaded: the next page is read meanwhile
    assert (load.after_seq, load.up_to_seq, load.limit) == (4, 10, 4)
    machine.batch_answered(send.batch_id, commit_results(send, 3))
    assert not of_type(machine.decisions(), Send)  # op 11 must wait for rows 5..10
    assert machine.oldest_pending_seq() == 5
    machine.loaded(WS, "d", rows[4:8])
    sent: list[int] = []
    while decisions := machine.decisions():
        for load in of_type(decisions, Load):
            assert machine._lanes[(WS, "d")].restored <= 2  # at most a batch left loaded
            machine.loaded(WS, "d", rows[load.after_seq : load.after_seq + load.limit])
        for send in of_type(decisions, Send):
            sent.extend(r.seq for r in send.rows)
            machine.batch_answered(send.batch_id, commit_results(send, 100 + sent[-1]))
    assert sent == [5, 6, 7, 8, 9, 10, 11]
    assert machine.pending_count == 0


def test_an_atomic_group_cut_by_a_page_never_leaves_in_part() -> None:
    machine = make_machine(max_batch_ops=5, restore_page=2)
    rows = [
        OutboxRow(
            seq,
            WS,
            "d",
            f"g{seq}",
            orjson.dumps({**inc(), "op_id": f"g{seq}"}).decode(),
            0.0,
            atomic_group=1,
        )
        for seq in (1, 2, 3)
    ]
    machine.restore(rows[:2], backlog_of(rows))  # a reader that cut the group
    decisions = machine.decisions()
    assert not of_type(decisions, Send)
    assert of_type(decisions, Load)
    machine.loaded(WS, "d", rows[2:])
    (send,) = of_type(machine.decisions(), Send)
    assert [r.seq for r in send.rows] == [1, 2, 3]
    assert send.atomic


def test_a_failed_page_read_gives_up_the_lane_and_the_next_connect_reads_it_again() -> None:
    machine = make_machine(max_batch_ops=1, restore_page=1)
    rows = restored_rows(3)
    machine.restore(rows[:1], backlog_of(rows))
    first = machine.decisions()
    (new,) = machine.submit(WS, "d", [inc()])
    machine.persisted([new.seq])
    machine.decisions()
    (send,) = of_type(first, Send)
    (load,) = of_type(first, Load)
    machine.load_failed(WS, "d", OutboxError("outbox_read_failed", "disk I/O error"))
    machine.batch_answered(send.batch_id, commit_results(send, 1))
    outcomes = [o for r in machine.decisions() if hasattr(r, "outcomes") for _, o in r.outcomes]
    assert isinstance(outcomes[0], StillPendingError)
    assert outcomes[0].op_id == new.op_id
    assert machine.pending_count == 3
    machine.connection_opened(WS)
    (load,) = of_type(machine.decisions(), Load)
    assert load.after_seq == 1


# -- the SQLite outbox -----------------------------------------------------------------------


def op_row(seq: int, sub_doc: str, group: int | None = None, tag: str = "old") -> OutboxRow:
    op_id = f"{tag}{seq:06d}"
    op = NodeInsert(node_id=op_id, parent_id="root").model_dump(mode="json", exclude_none=True)
    return OutboxRow(
        seq, WS, sub_doc, op_id, orjson.dumps({**op, "op_id": op_id}).decode(), 0.0, 0, group
    )


def interleaved(count: int, sub_docs: tuple[str, ...], group_every: int = 0) -> list[OutboxRow]:
    """`count` rows dealt over `sub_docs`; with `group_every`, every so often an atomic group of
    three consecutive ops of one sub-doc."""
    rows: list[OutboxRow] = []
    seq = 1
    while seq <= count:
        sub_doc = sub_docs[seq % len(sub_docs)]
        if group_every and seq % group_every == 0 and seq + 2 <= count:
            rows.extend(op_row(s, sub_doc, group=seq) for s in (seq, seq + 1, seq + 2))
            seq += 3
        else:
            rows.append(op_row(seq, sub_doc))
            seq += 1
    return rows


async def write_backlog(path: Path, rows: list[OutboxRow]) -> None:
    outbox = await SQLiteOutbox.open(path)
    try:
        for start in range(0, len(rows), 5000):
            outbox.write(OutboxWrite(inserts=rows[start : start + 5000]))
    finally:
        await outbox.close()


async def test_open_with_a_page_reads_each_lane_s_count_and_first_page_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.outbox"
    rows = interleaved(400, ("a", "b", "c"), group_every=7)
    await write_backlog(path, rows)
    outbox = await SQLiteOutbox.open(path, page_rows=10)
    try:
        by_lane: dict[str, list[OutboxRow]] = defaultdict(list)
        for row in rows:
            by_lane[row.sub_doc].append(row)
        assert sorted((b.sub_doc, b.count, b.last_seq) for b in outbox.backlog) == [
            (sub_doc, len(lane), lane[-1].seq) for sub_doc, lane in sorted(by_lane.items())
        ]
        loaded = {sub_doc: [r for r in outbox.rows if r.sub_doc == sub_doc] for sub_doc in by_lane}
        for sub_doc, lane in by_lane.items():
            # A page ends where a group ends: 10 rows, or up to 2 more to finish a group.
            assert 10 <= len(loaded[sub_doc]) <= 12
            assert loaded[sub_doc] == lane[: len(loaded[sub_doc])]
            # The rest, page by page, is the lane in order, with no group cut in two.
            read = list(loaded[sub_doc])
            while True:
                page = await outbox.read_lane(WS, sub_doc, read[-1].seq, 400, 10)
                if not page:
                    break
                assert page[0].atomic_group is None or page[0].atomic_group == page[0].seq
                read.extend(page)
            assert read == lane
    finally:
        await outbox.close()
    # Without a page, everything is read at open, as before.
    whole = await SQLiteOutbox.open(path)
    try:
        assert whole.rows == rows
    finally:
        await whole.close()


def schema(path: Path) -> dict[str, str | None]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT name, sql FROM sqlite_master").fetchall())
    finally:
        conn.close()


#: The outbox and its two small lane tables (the client id; each lane's last minted seq): what a
#: file holds with no backlog index.
OUTBOX_AND_LANES = {"outbox", "outbox_client", "outbox_lanes"}


def lane_table_rows(path: Path) -> tuple[int, int]:
    """Rows of `outbox_client` and `outbox_lanes`: one, and one per lane, however many ops."""
    conn = sqlite3.connect(path)
    try:
        return (
            conn.execute("SELECT count(*) FROM outbox_client").fetchone()[0],
            conn.execute("SELECT count(*) FROM outbox_lanes").fetchone()[0],
        )
    finally:
        conn.close()


async def test_a_backlog_index_covers_only_the_rows_found_at_open(tmp_path: Path) -> None:
    """New rows are above the index's bound: writing and deleting them costs nothing more than
    before. The index goes once the backlog is answered, and a page or less needs none."""
    path = tmp_path / "app.outbox"
    await write_backlog(path, interleaved(30, ("a", "b")))
    small = await SQLiteOutbox.open(path, page_rows=30)
    await small.close()
    assert set(schema(path)) == OUTBOX_AND_LANES
    outbox = await SQLiteOutbox.open(path, page_rows=10)
    try:
        conn = outbox._conn  # the file is locked to any other connection
        assert conn is not None
        (index_sql,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'outbox_backlog'"
        ).fetchone()
        assert index_sql.endswith("WHERE seq <= 30")
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT op FROM outbox WHERE workspace_id = ? AND sub_doc = ?"
            " AND seq > ? AND seq <= 30 ORDER BY seq",
            (WS, "a", 0),
        ).fetchall()
        assert "USING INDEX outbox_backlog" in str(plan)
        outbox.write(OutboxWrite(inserts=[op_row(31, "a", tag="new")]))
        outbox.write(OutboxWrite(deletes=list(range(1, 31))))
        entries = conn.execute(
            "SELECT count(*) FROM outbox INDEXED BY outbox_backlog WHERE seq <= 30"
        ).fetchone()[0]
        assert entries == 0
    finally:
        await outbox.close()
    again = await SQLiteOutbox.open(path, page_rows=10)  # one row left: no index
    try:
        assert [r.seq for r in again.rows] == [31]
    finally:
        await again.close()
    assert set(schema(path)) == OUTBOX_AND_LANES
    assert lane_table_rows(path) == (1, 0)  # rows written by hand carry no lane seq


async def test_an_unstamped_outbox_holding_the_backlog_index_is_still_taken_for_an_outbox(
    tmp_path: Path,
) -> None:
    path = tmp_path / "app.outbox"
    await write_backlog(path, interleaved(30, ("a",)))
    held = await SQLiteOutbox.open(path, page_rows=10)
    await held.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id = 0")  # as written before outboxes were stamped
    conn.commit()
    conn.close()
    outbox = await SQLiteOutbox.open(path)
    try:
        assert len(outbox.rows) == 30
    finally:
        await outbox.close()


@pytest.mark.parametrize("damage", ["first_page", "half", "garbled_page"])
async def test_a_damaged_outbox_is_refused_and_left_as_it_was_by_a_paged_open(
    tmp_path: Path, damage: str
) -> None:
    """Making the backlog index is the one write a paged open makes: on a damaged file it
    fails, and the file is left byte for byte as it was."""
    path = tmp_path / "app.outbox"
    await written_outbox(path, 2000)
    damage_file(path, damage)
    before = digest(path)
    with pytest.raises(OutboxError) as caught:
        await SQLiteOutbox.open(path, page_rows=10, busy_timeout_ms=200)
    assert caught.value.code == "outbox_open_failed"
    assert digest(path) == before
    assert siblings(path) == []


async def test_pages_are_read_off_the_loop_while_the_loop_writes(tmp_path: Path) -> None:
    path = tmp_path / "app.outbox"
    rows = interleaved(20_000, ("a", "b"))
    await write_backlog(path, rows)
    outbox = await SQLiteOutbox.open(path, page_rows=500)
    try:
        lane = [r for r in rows if r.sub_doc == "a"]
        read = [r for r in outbox.rows if r.sub_doc == "a"]
        seq = 30_000
        while len(read) < len(lane):
            reading = asyncio.ensure_future(outbox.read_lane(WS, "a", read[-1].seq, 20_000, 500))
            while not reading.done():  # the loop keeps writing new rows and deleting old ones
                seq += 1
                done: asyncio.Future[BaseException | None] = (
                    asyncio.get_running_loop().create_future()
                )
                outbox.write(
                    OutboxWrite(
                        inserts=[op_row(seq, "a", tag="new")],
                        deletes=[seq - 1] if seq > 30_001 else [],
                        done=done.set_result,
                    )
                )
                assert await done is None
                await asyncio.sleep(0)  # a write is synchronous: let the read's answer in
            read.extend(await reading)
        assert read == lane
    finally:
        await outbox.close()


async def test_the_memory_outbox_reads_lanes_the_same_way() -> None:
    outbox = MemoryOutbox()
    rows = interleaved(30, ("a",), group_every=4)
    outbox.write(OutboxWrite(inserts=rows))
    page = await outbox.read_lane(WS, "a", 0, 30, 4)
    assert page == page_of(rows, (WS, "a"), 0, 30, 4, whole=True)


# -- through a real server ------------------------------------------------------------------


async def test_a_client_replays_20000_pending_ops_in_order_once_each_while_the_app_writes(
    server_url: str, token: str, tmp_path: Path
) -> None:
    sub_docs = ("d0", "d1", "d2", "d3")
    path = tmp_path / "app.outbox"
    old = interleaved(20_000, sub_docs, group_every=97)
    await write_backlog(path, old)
    config = fast_config(max_batch_ops=50)
    client = WorkspaceClient(server_url, token=token, outbox=path, config=config)
    await client.start()
    try:
        assert client.pending_count() == 20_000
        page = client._machine.restore_page
        assert page == 2 * config.max_batch_ops
        most_loaded = 0
        waiters: list[asyncio.Future[Commit]] = []
        for i in range(200):  # the app writes while the backlog drains
            sub_doc = sub_docs[i % len(sub_docs)]
            op = NodeInsert(node_id=f"new{i:04d}", parent_id="root")
            waiters.append(asyncio.ensure_future(client.apply_op(WS, sub_doc, op)))
            most_loaded = max(
                most_loaded, max(lane.restored for lane in client._machine._lanes.values())
            )
            await asyncio.sleep(0)
            if i % 20 == 0:
                await asyncio.sleep(0.01)
        synced = asyncio.ensure_future(client.wait_synced(timeout=TIMEOUT))
        while not synced.done():
            most_loaded = max(
                most_loaded, max(lane.restored for lane in client._machine._lanes.values())
            )
            await asyncio.sleep(0.005)
        await synced
        commits = await asyncio.gather(*waiters)
        assert not any(commit.duplicate for commit in commits)
        new = {
            sub_doc: [c.op_id for c in commits[i :: len(sub_docs)]]
            for i, sub_doc in enumerate(sub_docs)
        }
        assert client.pending_count() == 0
        # Memory: per sub-doc, never more than a batch in flight and two pages (plus a group).
        assert most_loaded <= config.max_batch_ops + 2 * page + 2
    finally:
        await client.close()
    for sub_doc in sub_docs:
        log = [entry["op_id"] for entry in await server_log(server_url, sub_doc)]
        expected_old = [r.op_id for r in old if r.sub_doc == sub_doc]
        # Every old op once, in seq order, then the new ones once each, in submission order.
        assert log == expected_old + new[sub_doc]
    reopened = await SQLiteOutbox.open(path)
    try:
        assert reopened.rows == []
    finally:
        await reopened.close()
