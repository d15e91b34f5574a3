"""`token_provider` and `discard_pending()`, through the real server on loopback: a provider
cancelled under itself leaves its lane free; a start cancelled while the provider is out leaves the
outbox unlocked; a provider answering bytes at start does not spin the websocket reconnect; a
provider answer arriving after `set_token` never replaces the app's token; `close()` during a
refresh raises no `CancelledError` into app calls; a discard whose delete failed is not reported
done (nor its ops applied by the next client); callers of discarded ops are answered when the
discard is cancelled or fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import (
    AuthError,
    OpDiscardedError,
    OutboxError,
    StillPendingError,
    SyncStatus,
    WorkspaceClient,
)
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, fast_config, server_log, token_for

#: Every wait is bounded: what never comes fails the test instead of hanging it.
BOUND = 10.0


def _insert() -> NodeInsert:
    return NodeInsert(node_id="n", parent_id="root")


def _increment() -> NodeIncrement:
    return NodeIncrement(node_id="n", field="c")


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


# -- discard_pending ---------------------------------------------------------------------------


async def _one_op_waiting_out_a_retry(
    client: WorkspaceClient,
) -> asyncio.Future[object]:
    """An op whose first send failed (the server unreachable) and that waits out its retry:
    unanswered, awaited, not in flight."""
    call: asyncio.Future[object] = asyncio.ensure_future(client.apply_op(WS, "tree", _insert()))
    async with asyncio.timeout(BOUND):  # a state: the first send failed, a retry waits
        while client._machine.in_flight_count or client.pending_count() < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    return call


#: A retry that never comes during the test, and HTTP only: the op stays unanswered, not in flight.
WAITING = fast_config(backoff=lambda failures: 3600.0, ops_over_websocket=False)


async def test_a_discard_whose_delete_fails_is_not_reported_done(
    server_url: str, tmp_path: Path
) -> None:
    """The outbox refused the delete (a read-only file here; a full disk, an I/O error). The
    write carried no `done`, so the failure went unseen: `discard_pending` returned 1, the
    caller heard `OpDiscardedError` ("never applied"), and the next client on the outbox
    replayed the row and applied it."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=WAITING)
        await client.start()
        try:
            told, disk_back = await _a_discard_that_fails(client)
            assert not isinstance(told, OpDiscardedError)
            disk_back()
        finally:
            await client.close()
    # Never said to be discarded; the disk back before `close()`, the close finished the
    # discard the app had asked for: the next client does not apply it.
    await _nothing_left_for_the_next_client(server_url, outbox)


async def _a_discard_that_fails(
    client: WorkspaceClient,
) -> tuple[BaseException, Callable[[], None]]:
    """`discard_pending(WS)` of one op waiting out a retry, while every write of the outbox fails
    in SQLite (a read-only file here; a full disk, an I/O error): what its caller was told,
    and how to bring the disk back."""
    call = await _one_op_waiting_out_a_retry(client)
    store = client._outbox
    assert isinstance(store, SQLiteOutbox)
    conn = store._conn
    assert conn is not None
    conn.execute("PRAGMA query_only = 1")
    with pytest.raises(OutboxError):
        await asyncio.wait_for(client.discard_pending(WS), BOUND)
    with pytest.raises(OutboxError) as told:
        await asyncio.wait_for(call, BOUND)

    def disk_back() -> None:
        conn.execute("PRAGMA query_only = 0")

    return told.value, disk_back


async def _nothing_left_for_the_next_client(server_url: str, outbox: Path) -> None:
    async with WorkspaceClient(
        server_url, token=token_for(WS), outbox=outbox, config=fast_config()
    ) as again:
        assert again.pending_count() == 0
    assert await server_log(server_url, "tree") == []


async def test_a_failed_discard_is_retried_by_the_next_discard_pending(
    server_url: str, tmp_path: Path
) -> None:
    """After a failed discard the ops had left the machine: calling `discard_pending` again
    once the disk was back deleted nothing (0), and the next client on the outbox applied the
    op the app had given up, twice asked."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=WAITING)
        await client.start()
        try:
            _, disk_back = await _a_discard_that_fails(client)
            disk_back()
            # Another workspace's discard neither retries it nor counts it.
            assert await asyncio.wait_for(client.discard_pending("other"), BOUND) == 0
            assert await asyncio.wait_for(client.discard_pending(WS), BOUND) == 1
            assert await asyncio.wait_for(client.discard_pending(WS), BOUND) == 0
        finally:
            await client.close()
    await _nothing_left_for_the_next_client(server_url, outbox)


async def test_a_discard_cancelled_while_it_is_made_durable_still_tells_the_callers(
    server_url: str, tmp_path: Path
) -> None:
    """The app's timeout cancelled `discard_pending` during its fsync. The deletion was made,
    but the callers of the discarded ops were never told: they hung until `close()`, which
    then told them the op "stays in the outbox and will be replayed" — it was gone."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=WAITING)
        await client.start()
        try:
            call = await _one_op_waiting_out_a_retry(client)
            discarding = asyncio.ensure_future(client.discard_pending(WS))
            await asyncio.sleep(0)  # it runs up to its fsync
            discarding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await discarding
        finally:
            await client.close()
        with pytest.raises(OpDiscardedError):
            await asyncio.wait_for(call, BOUND)
    async with WorkspaceClient(
        server_url, token=token_for(WS), outbox=outbox, config=fast_config()
    ) as again:
        assert again.pending_count() == 0


async def test_a_discard_that_cannot_be_made_durable_tells_its_callers_at_once(
    server_url: str, tmp_path: Path
) -> None:
    """The outbox file was removed under the client: the discard cannot be made durable and
    `discard_pending` raises. Its callers were left hanging (until `close()`)."""
    directory = tmp_path / "app"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(
            proxy.url, token=token_for(WS), outbox=directory / "app.outbox", config=WAITING
        )
        await client.start()
        try:
            call = await _one_op_waiting_out_a_retry(client)
            (directory / "app.outbox").unlink()
            with pytest.raises(OutboxError) as failed:
                await asyncio.wait_for(client.discard_pending(WS), BOUND)
            assert failed.value.code == "outbox_sync_failed"
            assert call.done()
            with pytest.raises(OutboxError) as told:
                await call
            assert told.value.code == "outbox_sync_failed"
            assert not isinstance(told.value, OpDiscardedError)
        finally:
            await client.close()


async def test_a_discard_racing_close_is_reported_once_durable(
    server_url: str, tmp_path: Path
) -> None:
    """`close()` while the discard is being made durable: the caller hears `OpDiscardedError`
    (not "still pending"), the discard returns its count, and nothing comes back."""
    outbox = tmp_path / "app.outbox"
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(proxy.url, token=token_for(WS), outbox=outbox, config=WAITING)
        await client.start()
        call = await _one_op_waiting_out_a_retry(client)
        discarding = asyncio.ensure_future(client.discard_pending(WS))
        await asyncio.sleep(0)
        await client.close()
        assert await asyncio.wait_for(discarding, BOUND) == 1
        with pytest.raises(OpDiscardedError):
            await asyncio.wait_for(call, BOUND)
    async with WorkspaceClient(
        server_url, token=token_for(WS), outbox=outbox, config=fast_config()
    ) as again:
        assert again.pending_count() == 0
    assert await server_log(server_url, "tree") == []
