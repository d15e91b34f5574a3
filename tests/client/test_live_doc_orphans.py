"""`LiveDoc`'s orphan ops (edits whose callers stopped waiting), through the real server on
loopback: an orphan that turns up while the view settles another is settled too, and the view ends
as the server's state."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cv_mutations import NodeIncrement, NodeInsert, new_op_id
from cv_workspace_client import StillPendingError, WorkspaceClient
from cv_workspace_client.live import LiveDoc
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config, server_state, token_for
from .live_helpers import BOUND, count_of, until


def _inc() -> NodeIncrement:
    return NodeIncrement(node_id="n", field="c", op_id=new_op_id())


# -- LiveDoc: orphans ------------------------------------------------------------------------------


async def test_an_orphan_that_turns_up_while_the_view_settles_another_is_settled_too(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edit A gave up and was discarded: the view reads the server's head and waits for its
    feed (held silent here) to reach it. Meanwhile edit B, whose caller stopped waiting, is
    rejected. Every wake-up B brought was spent on A's wait: once A's was settled, B stayed in
    the view for good, with the server reachable and nothing pending."""
    async with FaultProxy(server_url) as proxy:
        config = fast_config(retry_attempts=1, ops_over_websocket=False)
        async with (
            WorkspaceClient(proxy.url, token=token_for(WS), config=config) as mine,
            WorkspaceClient(server_url, token=token_for(WS)) as theirs,
        ):
            await theirs.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            heads = asyncio.Event()
            read_ops = mine.read_ops

            async def spied(*args: Any, **kwargs: Any) -> Any:
                found = await read_ops(*args, **kwargs)
                heads.set()
                return found

            monkeypatch.setattr(mine, "read_ops", spied)
            async with LiveDoc(mine, WS, "tree") as doc:
                # Only the feed's websocket stays open, and it goes silent.
                accepted = proxy.stats.accepted
                proxy.drop_all()
                await asyncio.wait_for(proxy.wait_until(lambda s: s.accepted > accepted), BOUND)
                await mine.connect(WS, timeout=BOUND)
                await until(doc, lambda d: d.clock == 1)
                assert proxy.silence_open() == 1

                proxy.refuse = True
                with pytest.raises(StillPendingError):
                    await asyncio.wait_for(doc.apply_op(_inc()), BOUND)
                proxy.refuse = False
                await theirs.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=10))
                assert await mine.discard_pending(WS, "tree") == 1
                await asyncio.wait_for(heads.wait(), BOUND)  # the view waits for its feed

                # B: the app stops waiting for it (a cancel), and the server rejects it.
                call = asyncio.ensure_future(doc.apply_op(NodeIncrement(node_id="gone", field="c")))
                await until(doc, lambda d: len(d.pending) == 2)  # submitted
                call.cancel()
                await mine.wait_synced(timeout=BOUND)
                assert len(doc.pending) == 2

                proxy.drop_all()  # the feed comes back and reaches the head
                await until(doc, lambda d: d.clock == 2 and not d.pending)
                truth = await server_state(server_url, "tree")
                assert doc.state.to_json() == truth["state"]
                assert count_of(doc.state) == 10
