"""`token_provider` racing the app's own calls, through the real server on loopback: a provider
cancelled under itself leaves its lane free; a start cancelled while the provider is out leaves the
outbox unlocked; a provider answering bytes at start does not spin the websocket reconnect; a
provider answer arriving after `set_token` never replaces the app's token; `close()` during a
refresh raises no `CancelledError` into app calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import AuthError, StillPendingError, SyncStatus, WorkspaceClient

from ..helpers import WS, fast_config, server_log, token_for

#: Every wait is bounded: what never comes fails the test instead of hanging it.
BOUND = 10.0


def _insert() -> NodeInsert:
    return NodeInsert(node_id="n", parent_id="root")


async def _refused(client: WorkspaceClient) -> SyncStatus:
    """The first status the client's watch yields that names WS as refused."""
    async with asyncio.timeout(BOUND):
        async for status in client.watch_sync_status():
            if WS in status.refused:
                return status
    raise AssertionError("the watch ended first")


# -- token_provider ----------------------------------------------------------------------------


async def test_a_provider_cancelled_under_itself_is_a_failed_refresh_not_a_wedged_lane(
    server_url: str, tmp_path: Path
) -> None:
    """A provider awaiting a task of its own that was cancelled raises `CancelledError`. It
    escaped the refresh into the refused request's task, which ended without reporting its
    batch: the batch stayed in flight, and `apply_op` (and `wait_synced`) hung for ever."""
    calls = 0

    async def provider() -> str:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError  # as `await some_task` does when that task was cancelled

    async with WorkspaceClient(
        server_url,
        token="expired-token",
        token_provider=provider,
        outbox=tmp_path / "app.outbox",
        config=fast_config(ops_over_websocket=False),
    ) as client:
        with pytest.raises(StillPendingError) as pending:
            await asyncio.wait_for(client.apply_op(WS, "tree", _insert()), BOUND)
        assert isinstance(pending.value.last_error, AuthError)
        assert isinstance(client.token_refresher.last_error, asyncio.CancelledError)
        client.set_token(token_for(WS))  # the op waited in the outbox, and goes once
        await client.wait_synced(timeout=BOUND)
        attempts = client.config.retry_attempts
    assert calls == attempts  # asked again with the backoff, then the refusal stood
    assert [entry["op_id"] for entry in await server_log(server_url, "tree")] == [
        pending.value.op_id
    ]


async def test_a_start_cancelled_while_the_provider_is_out_leaves_the_outbox_free(
    server_url: str, tmp_path: Path
) -> None:
    asked = asyncio.Event()

    async def silent_provider() -> str:
        asked.set()
        await asyncio.Event().wait()  # its auth server never answers
        raise AssertionError("unreachable")

    outbox = tmp_path / "app.outbox"
    client = WorkspaceClient(
        server_url, token_provider=silent_provider, outbox=outbox, config=fast_config()
    )
    starting = asyncio.ensure_future(client.start())
    await asyncio.wait_for(asked.wait(), BOUND)
    starting.cancel()  # the app gave up waiting for it
    with pytest.raises(asyncio.CancelledError):
        await starting
    await client.close()
    # The outbox was left open and locked (and the HTTP session unclosed): `outbox_locked`.
    async with WorkspaceClient(
        server_url, token=token_for(WS), outbox=outbox, config=fast_config()
    ) as again:
        commit = await asyncio.wait_for(again.apply_op(WS, "tree", _insert()), BOUND)
    assert commit.clock == 1


async def test_a_provider_answering_bytes_at_start_is_asked_again_not_looped_on(
    server_url: str,
) -> None:
    """Taken as the token, b'...' was sent as `Bearer b'...'`, which never matched the token
    the client held: every refusal looked like one of a token replaced meanwhile, so the
    provider was never asked again and the websocket reconnected at once, for ever (hundreds
    of handshakes a second), never saying `refused`."""
    calls = 0

    async def provider() -> str:
        nonlocal calls
        calls += 1
        return token_for(WS).encode()  # type: ignore[return-value]  # the app's bug

    attempts = 3
    async with WorkspaceClient(
        server_url, token_provider=provider, config=fast_config(retry_attempts=attempts)
    ) as client:
        assert client.token is None
        assert isinstance(client.token_refresher.last_error, TypeError)
        with pytest.raises(StillPendingError):
            await asyncio.wait_for(client.apply_op(WS, "tree", _insert()), BOUND)
        await _refused(client)  # the websocket gave up, and says so
        sock = client._sockets[WS]
        assert sock.final_error is not None
        assert sock.connections <= attempts
    assert 2 <= calls <= attempts + 1  # asked again on the refusal, a bounded number of times


async def test_set_token_while_the_provider_is_out_wins_over_its_late_answer(
    server_url: str, tmp_path: Path
) -> None:
    """The user signed in again while the provider (of the old session) was still out. Its
    late answer replaced the app's token, and the ops went with the old user's token."""
    asked = asyncio.Event()
    release = asyncio.Event()

    async def stale_provider() -> str:
        asked.set()
        await release.wait()
        return token_for("other")  # the old session's token: not for this workspace

    async with WorkspaceClient(
        server_url,
        token="expired-token",
        token_provider=stale_provider,
        outbox=tmp_path / "app.outbox",
        config=fast_config(ops_over_websocket=False),
    ) as client:
        call = asyncio.ensure_future(client.apply_op(WS, "tree", _insert()))
        await asyncio.wait_for(asked.wait(), BOUND)
        fresh = token_for(WS)
        client.set_token(fresh)
        release.set()
        commit = await asyncio.wait_for(call, BOUND)
        assert client.token == fresh
    assert commit.clock == 1
    assert [entry["op_id"] for entry in await server_log(server_url, "tree")] == [commit.op_id]


async def test_close_during_a_refresh_leaves_app_calls_their_refusal_not_a_cancellation(
    server_url: str,
) -> None:
    """`close()` abandons the refresh under way. An app's `get_state` waiting on it got the
    refresh's `CancelledError` though nobody had cancelled it (a `TaskGroup` around it would
    take it for its own cancellation)."""
    asked = asyncio.Event()

    async def silent_provider() -> str:
        asked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    client = WorkspaceClient(
        server_url, token="expired-token", token_provider=silent_provider, config=fast_config()
    )
    await client.start()
    read = asyncio.ensure_future(client.get_state(WS, "tree"))
    await asyncio.wait_for(asked.wait(), BOUND)
    await asyncio.wait_for(client.close(), BOUND)
    with pytest.raises(AuthError):
        await asyncio.wait_for(read, BOUND)
