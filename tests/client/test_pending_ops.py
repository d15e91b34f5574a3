"""`WorkspaceClient.pending_ops` reading a restored backlog while the client replays it: the list
read mid-replay is the client's list when it returns, a listing read page by page is the lane's
pending ops, and a client closed during the read raises as a closed client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from cv_mutations import NodeIncrement, NodeInsert, new_op_id
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client._core.machine import BacklogRange, OutboxRow
from cv_workspace_client.testing import FaultProxy

from .core.test_machine_stateful import SUB_DOCS
from .helpers import WS, fast_config, server_log, token_for
from .live_helpers import BOUND
from .outbox.test_paging import ClientRestoredPageByPage, page_of


def _inc() -> NodeIncrement:
    return NodeIncrement(node_id="n", field="c", op_id=new_op_id())


# -- pending_ops while the client replays ---------------------------------------------------------


async def _backlog(proxy: FaultProxy, outbox: Path) -> list[str]:
    """A client that applied single ops and atomic groups to `tree` (and a few to `other`) with
    the server unreachable, then quit: they wait in `outbox`. Returns `tree`'s op_ids in order."""
    proxy.refuse = True
    config = fast_config(retry_attempts=1, ops_over_websocket=False)
    calls: list[tuple[list[NodeIncrement], bool]] = []
    for i in range(24):
        calls.append(([_inc() for _ in range(1 + i % 4)], i % 3 == 1))
    async with WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config) as a:
        submitted = [
            asyncio.ensure_future(a.apply_ops(WS, "tree", ops, atomic=atomic))
            for ops, atomic in calls
        ]
        submitted.append(asyncio.ensure_future(a.apply_ops(WS, "other", [_inc(), _inc()])))
        for call in submitted:
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(call, BOUND)
    proxy.refuse = False
    return [op.op_id for ops, _ in calls for op in ops if op.op_id is not None]


async def test_pending_ops_read_while_the_backlog_replays_is_the_client_s_list_when_it_returns(
    server_url: str, tmp_path: Path
) -> None:
    """Listed again and again while the restored backlog (pages of 4, atomic groups cut by
    them) is loaded, sent and answered: each list is exactly what the client still has, once
    each, in order — a suffix of the ops as submitted, as long as the pending count."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(server_url, token=token_for(WS)) as theirs:
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        order = await _backlog(proxy, outbox)
        config = fast_config(max_batch_ops=2, ops_over_websocket=False)
        async with WorkspaceClient(
            server_url, token=token_for(WS), outbox=outbox, config=config
        ) as b:
            lists = read = 0
            async with asyncio.timeout(BOUND):
                async for _ in b.watch_sync_status():  # listed at every step of the replay
                    read += b._machine.lane_pending(WS, "tree").on_disk is not None
                    listed = [op_id for op_id, _ in await b.pending_ops(WS, "tree")]
                    assert len(listed) == b.pending_count(WS, "tree")
                    assert listed == order[len(order) - len(listed) :]
                    lists += 1
                    if not listed:
                        break
            assert await b.pending_ops(WS, "tree") == []
        assert lists > 3
        assert read > 3  # from the disk, while the client loaded and sent
        log = [e["op_id"] for e in await server_log(server_url, "tree")]
        assert log[1:] == order


class ListedWhileRestoring(ClientRestoredPageByPage):
    """The page-by-page restore model, plus the shell's `pending_ops`: a lane's listing is read
    a page at a time from the outbox at any moment of the replay (loads, sends, answers,
    losses, discards, submits between two pages), then merged with a fresh `lane_pending`."""

    def __init__(self) -> None:
        #: (incarnation, sub_doc, the range being read, rows read so far, next after_seq)
        self.listing: tuple[int, str, BacklogRange, list[OutboxRow], int] | None = None
        super().__init__()

    @rule(page=st.integers(1, 3), whole_groups=st.booleans(), sub_doc=st.sampled_from(SUB_DOCS))
    def client_crashes_and_the_app_lists(self, page: int, whole_groups: bool, sub_doc: str) -> None:
        """A restart, and the app's view listing a lane at once (its backlog still on disk)."""
        self.client_crashes(page, whole_groups)
        self.listing = None
        self.app_lists_pending_ops(sub_doc)

    def on_disk_now(self) -> list[OutboxRow]:
        """What a read of the outbox file sees: committed rows, deletes decided included."""
        gone = set(self.unflushed_deletes)
        rows = [*self.outbox.values(), *self.unflushed_inserts]
        return [row for row in rows if row.seq not in gone]

    @precondition(lambda self: self.listing is None)
    @rule(sub_doc=st.sampled_from(SUB_DOCS))
    def app_lists_pending_ops(self, sub_doc: str) -> None:
        lane = self.client.lane_pending(WS, sub_doc)
        if lane.on_disk is None:
            self.check_listing(sub_doc, lane.with_disk([]))
        else:
            self.listing = (self.incarnation, sub_doc, lane.on_disk, [], lane.on_disk.after_seq)

    @precondition(lambda self: self.listing is not None)
    @rule(pages=st.integers(1, 3), meanwhile=st.sampled_from(["", "load", "answer", "send"]))
    def pages_of_the_listing_are_read(self, pages: int, meanwhile: str) -> None:
        """A few pages, with the client loading, sending or answering between two of them."""
        for _ in range(pages):
            if self.listing is not None:
                self.a_page_of_the_listing_is_read()
            if meanwhile == "load" and self.loads:
                self.load_arrives(0)
            elif meanwhile == "answer" and self.responses:
                self.answer_arrives(0)
            elif meanwhile == "send" and self.requests:
                self.request_arrives(0, duplicate=False)

    def a_page_of_the_listing_is_read(self) -> None:
        assert self.listing is not None
        incarnation, sub_doc, span, read, after = self.listing
        if incarnation != self.incarnation:  # the client crashed under the read
            self.listing = None
            return
        page = self.client.restore_page
        rows = page_of(self.on_disk_now(), (WS, sub_doc), after, span.up_to_seq, page, True)
        read.extend(rows)
        if len(rows) >= page:
            self.listing = (incarnation, sub_doc, span, read, rows[-1].seq)
            return
        self.listing = None
        self.check_listing(sub_doc, self.client.lane_pending(WS, sub_doc).with_disk(read))

    def teardown(self) -> None:
        while self.listing is not None:  # a listing under way ends as the example does
            self.a_page_of_the_listing_is_read()
        super().teardown()

    def check_listing(self, sub_doc: str, listed: list[OutboxRow]) -> None:
        seqs = [row.seq for row in listed]
        assert seqs == sorted(set(seqs)), seqs  # once each, in the order they leave
        assert len(listed) == self.client.pending_in(WS, sub_doc)
        alive = {row.seq: row for row in self.on_disk_now()}
        for row in listed:
            # Never an op answered (deleted) or discarded: each is on disk, or being written.
            assert row.sub_doc == sub_doc
            assert alive.get(row.seq) == row or row.seq in self.client._unpersisted, row


def test_a_listing_read_page_by_page_during_the_replay_is_the_lane_s_pending_ops(
    tmp_path: Path,
) -> None:
    class Example(ListedWhileRestoring):
        base_dir = tmp_path

    run_state_machine_as_test(
        Example,
        settings=settings(
            max_examples=150,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


async def test_pending_ops_on_a_client_closed_during_its_read_raises_as_a_closed_client(
    server_url: str, tmp_path: Path
) -> None:
    """Every verb of a closed client raises `RuntimeError` (`LiveDoc` takes it for "the client
    closed under me"); `pending_ops` closed under its read of the backlog raised the outbox's
    `OutboxError("outbox_closed")` instead, out of a `LiveDoc` being opened."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        await _backlog(proxy, outbox)
        proxy.refuse = True
        config = fast_config(max_batch_ops=2, retry_attempts=1, ops_over_websocket=False)
        client = WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=config)
        await client.start()
        listing = asyncio.ensure_future(client.pending_ops(WS, "tree"))
        await asyncio.sleep(0)  # it runs up to its first read of the backlog
        await client.close()
        with pytest.raises(RuntimeError, match="not open"):
            await asyncio.wait_for(listing, BOUND)
