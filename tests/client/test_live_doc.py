"""`LiveDoc` through the real server: an edit is in the view the moment it is made, offline
included; other clients' commits rebase it; once everything is answered the view is the server's
state — including when an op replayed after going offline is rejected with nobody waiting."""

from __future__ import annotations

import asyncio

import pytest

from cv_mutations import NodeDelete, NodeIncrement, NodeInsert
from cv_workspace_client import OpRejectedError, StillPendingError, WorkspaceClient
from cv_workspace_client.live import LiveDoc

from .helpers import WS, fast_config, token_for
from .live_helpers import BOUND, count_of, offline_view, settled


async def test_edits_show_at_once_and_the_view_ends_as_the_servers_state(
    server_url: str,
) -> None:
    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as mine,
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as theirs,
    ):
        await mine.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        async with LiveDoc(mine, WS, "tree") as doc:
            assert count_of(doc.state) == 0
            calls = [
                asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="n", field="c")))
                for _ in range(5)
            ]
            await asyncio.sleep(0)  # the calls start: each is in the view before any answer
            assert count_of(doc.state) == 5
            assert len(doc.pending) == 5
            others = [
                theirs.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=10))
                for _ in range(3)
            ]
            await asyncio.wait_for(asyncio.gather(*calls, *others), BOUND)
            truth = await settled(doc, server_url)
            assert doc.state.to_json() == truth["state"]
            assert count_of(doc.state) == 35


async def test_offline_edits_stay_in_the_view_and_land_after_what_others_did_meanwhile(
    server_url: str,
) -> None:
    async with offline_view(server_url) as net:
        doc = net.doc
        for _ in range(3):
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="n", field="c")), BOUND)
        assert count_of(doc.state) == 3  # the app still shows its edits
        await net.theirs.apply_op(WS, "tree", NodeInsert(node_id="m", parent_id="root"))
        assert "m" not in doc.state.nodes  # not seen while offline

        net.back_online()
        truth = await settled(doc, server_url)
        assert doc.state.to_json() == truth["state"]
        assert count_of(doc.state) == 3
        assert "m" in doc.state.nodes


async def test_an_edit_rejected_when_replayed_leaves_the_view_though_nobody_waits(
    server_url: str,
) -> None:
    """Offline, the app increments a node; meanwhile another client deletes it. Replayed, the
    increment is rejected with no caller left to tell (it had given up): the view drops it once
    the client has nothing pending and the feed has caught up."""
    async with offline_view(server_url) as net:
        doc = net.doc
        with pytest.raises(StillPendingError):
            await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="n", field="c")), BOUND)
        assert count_of(doc.state) == 1
        await net.theirs.apply_op(WS, "tree", NodeDelete(node_id="n"))

        net.back_online()
        truth = await settled(doc, server_url)
        assert "n" not in doc.state.nodes
        assert doc.state.to_json() == truth["state"]


async def test_a_rejected_edit_raises_and_leaves_the_view(server_url: str) -> None:
    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as mine,
        LiveDoc(mine, WS, "tree") as doc,
    ):
        with pytest.raises(OpRejectedError):
            await asyncio.wait_for(doc.apply_op(NodeIncrement(node_id="zz", field="c")), BOUND)
        assert doc.pending == ()
        assert "zz" not in doc.state.nodes
        await asyncio.wait_for(doc.apply_op(NodeInsert(node_id="a", parent_id="root")), BOUND)
        truth = await settled(doc, server_url)
        assert doc.state.to_json() == truth["state"]


async def test_ops_get_the_clients_op_ids_and_none_is_taken_after_close(
    server_url: str,
) -> None:
    """The op_id of an op applied through the view came from `cv_mutations.new_op_id`, not the
    client's injected minter; and `apply_op` on a closed view sent an op shown nowhere."""
    minted = iter(f"mine_{i:04d}" for i in range(100))
    async with WorkspaceClient(
        server_url, token=token_for(WS), config=fast_config(), new_op_id=lambda: next(minted)
    ) as client:
        doc = LiveDoc(client, WS, "tree")
        async with doc:
            commit = await asyncio.wait_for(
                doc.apply_op(NodeInsert(node_id="n", parent_id="root")), BOUND
            )
        assert commit.op_id == "mine_0000"
        with pytest.raises(RuntimeError):
            await doc.apply_op(NodeIncrement(node_id="n", field="c"))
        assert client.pending_count() == 0
        assert client.mint_op_id() == "mine_0001"
