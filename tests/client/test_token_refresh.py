"""A token the server refuses (expired, revoked, for another workspace) is no answer about the ops
sent with it: they stay in the outbox under their op_ids, the app hears `StillPendingError`
carrying the auth error, and `set_token()` sends them, once each, in order. So an offline app
whose token expired before it reconnects keeps every op it queued, and ops restored from the
outbox are kept too: the tests below pin each of these paths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import (
    AuthError,
    ForbiddenError,
    StillPendingError,
    SyncStatus,
    WorkspaceClient,
)
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config, server_log, server_state, token_for

BOUND = 20.0


def _ops() -> list[NodeInsert | NodeIncrement]:
    return [NodeInsert(node_id="n", parent_id="root")] + [
        NodeIncrement(node_id="n", field="c") for _ in range(4)
    ]


@pytest.mark.parametrize(
    ("bad_token", "refusal"),
    [("not-a-token", AuthError), (token_for("other"), ForbiddenError)],
    ids=["unauthorized", "forbidden"],
)
@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_ops_refused_for_the_token_stay_pending_and_go_once_a_new_token_is_set(
    server_url: str, tmp_path: Path, bad_token: str, refusal: type[Exception], websocket: bool
) -> None:
    config = fast_config(ops_over_websocket=websocket)
    async with WorkspaceClient(
        server_url, token=bad_token, outbox=tmp_path / "app.outbox", config=config
    ) as client:
        calls = [asyncio.ensure_future(client.apply_op(WS, "tree", op)) for op in _ops()]
        for call in calls:
            with pytest.raises(StillPendingError) as pending:
                await asyncio.wait_for(call, BOUND)
            assert isinstance(pending.value.last_error, refusal)
        assert client.pending_count() == 5  # not one of them was answered
        assert await server_log(server_url, "tree") == []

        client.set_token(token_for(WS))
        await client.wait_synced(timeout=BOUND)
        assert client.sync_status == SyncStatus(pending=0, connected=client.sync_status.connected)
    log = await server_log(server_url, "tree")
    assert [entry["clock"] for entry in log] == [1, 2, 3, 4, 5]
    assert len({entry["op_id"] for entry in log}) == 5
    assert (await server_state(server_url, "tree"))["state"]["nodes"]["n"]["fields"] == {"c": 4}


async def test_ops_restored_under_an_expired_token_are_kept_until_a_new_one_comes(
    server_url: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True  # offline: the ops wait in the outbox
        async with WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=outbox, config=fast_config()
        ) as offline:
            calls = [asyncio.ensure_future(offline.apply_op(WS, "tree", op)) for op in _ops()]
            for call in calls:
                with pytest.raises(StillPendingError):
                    await asyncio.wait_for(call, BOUND)
        proxy.refuse = False
        # Back online with a token that has expired meanwhile (here: one the server refuses).
        async with WorkspaceClient(
            proxy.url, token="expired-token", outbox=outbox, config=fast_config()
        ) as client:
            client.retry_pending()
            with pytest.raises(TimeoutError):
                await client.wait_synced(timeout=0.5)  # refused, so never synced: still there
            assert client.pending_count() == 5
            assert await server_log(server_url, "tree") == []
            client.set_token(token_for(WS))
            await client.wait_synced(timeout=BOUND)
            # The websocket that gave up on the old token is back, and feeds subscriptions.
            await client.connect(WS, timeout=BOUND)
            async with client.subscribe(WS, "tree") as sub:
                clocks = [(await asyncio.wait_for(anext(sub), BOUND)).clock for _ in range(5)]
    assert clocks == [1, 2, 3, 4, 5]
    log = await server_log(server_url, "tree")
    assert [entry["clock"] for entry in log] == [1, 2, 3, 4, 5]
    assert len({entry["op_id"] for entry in log}) == 5


async def test_the_sync_status_says_which_workspaces_need_a_new_token(
    server_url: str, tmp_path: Path
) -> None:
    """The app's cue to sign in again: `refused` names the workspace, and clears once the new
    token has sent what waited."""
    async with WorkspaceClient(
        server_url, token="expired-token", outbox=tmp_path / "app.outbox", config=fast_config()
    ) as client:
        watch = client.watch_sync_status()
        assert (await asyncio.wait_for(anext(watch), BOUND)).refused == frozenset()
        call = asyncio.ensure_future(client.apply_op(WS, "tree", _ops()[0]))
        refused = await asyncio.wait_for(_first(watch, lambda s: bool(s.refused)), BOUND)
        assert refused.refused == frozenset({WS})
        assert refused.pending == 1
        with pytest.raises(StillPendingError):
            await asyncio.wait_for(call, BOUND)
        client.set_token(token_for(WS))
        back = await asyncio.wait_for(_first(watch, lambda s: s.synced and not s.refused), BOUND)
        assert back.pending == 0
    assert len(await server_log(server_url, "tree")) == 1


async def _first(
    watch: AsyncIterator[SyncStatus], predicate: Callable[[SyncStatus], bool]
) -> SyncStatus:
    async for status in watch:
        if predicate(status):
            return status
    raise AssertionError("the watch ended first")
