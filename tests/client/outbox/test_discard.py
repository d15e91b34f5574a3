"""`discard_pending()` made durable (`cv_workspace_client._outbox.discard`), through the real
server on loopback: a discard whose delete failed is not reported done (nor its ops applied by the
next client); callers of discarded ops are answered when the discard is cancelled or fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import OpDiscardedError, OutboxError, WorkspaceClient
from cv_workspace_client._outbox.sqlite import SQLiteOutbox
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, fast_config, server_log, token_for

#: Every wait is bounded: what never comes fails the test instead of hanging it.
BOUND = 10.0


def _insert() -> NodeInsert:
    return NodeInsert(node_id="n", parent_id="root")


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
