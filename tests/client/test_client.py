"""The asyncio shell through the real server on loopback: commits, typed errors, retries under one
op_id, replay from the outbox, and the synced signal."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import (
    AuthError,
    ClientClosedError,
    Commit,
    ForbiddenError,
    InvalidRequestError,
    OpRejectedError,
    StillPendingError,
    WorkspaceClient,
)
from cv_workspace_client.testing import FaultProxy, ProxyStats, restart_client

from .helpers import WS, RecordingSleep, fast_config, server_log, server_state, token_for

TIMEOUT = 30
MODES = [pytest.param(False, id="http"), pytest.param(True, id="websocket")]


def counter(state: dict[str, object], node: str = "n", field: str = "c") -> object:
    return state["state"]["nodes"][node]["fields"].get(field)  # type: ignore[index]


@pytest.mark.parametrize("websocket", MODES)
async def test_apply_op_mints_an_op_id_and_returns_the_commit(
    server_url: str, token: str, websocket: bool
) -> None:
    config = fast_config(ops_over_websocket=websocket)
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        first = await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        mine = await client.apply_op(
            WS,
            "tree",
            {**NodeIncrement(node_id="n", field="c").model_dump(), "op_id": "my_own_id_1"},
        )
    assert first.clock == 1
    assert len(first.op_id) == 21
    assert not first.duplicate
    assert mine == Commit(clock=2, op_id="my_own_id_1", duplicate=False)
    log = await server_log(server_url, "tree")
    assert [entry["op_id"] for entry in log] == [first.op_id, "my_own_id_1"]


@pytest.mark.parametrize("websocket", MODES)
async def test_apply_ops_returns_one_outcome_per_op_and_atomic_aborts_them_all(
    server_url: str, token: str, websocket: bool
) -> None:
    config = fast_config(ops_over_websocket=websocket)
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        outcomes = await client.apply_ops(
            WS,
            "tree",
            [
                NodeInsert(node_id="a", parent_id="root"),
                NodeInsert(node_id="a", parent_id="root"),
                NodeIncrement(node_id="a", field="c"),
            ],
        )
        atomic = await client.apply_ops(
            WS,
            "tree",
            [NodeIncrement(node_id="a", field="c"), NodeIncrement(node_id="zz", field="c")],
            atomic=True,
        )
        clock, state = await client.get_state(WS, "tree")
    assert isinstance(outcomes[0], Commit)
    assert isinstance(outcomes[1], OpRejectedError)
    assert outcomes[1].code == "node_exists"
    assert isinstance(outcomes[2], Commit)
    assert [getattr(o, "code", None) for o in atomic] == ["atomic_aborted", "node_not_found"]
    assert clock == 2
    assert state.nodes["a"].fields == {"c": 1}


@pytest.mark.parametrize("websocket", MODES)
async def test_an_answer_lost_after_the_commit_is_retried_and_applied_once(
    server_url: str, token: str, websocket: bool
) -> None:
    config = fast_config(ops_over_websocket=websocket)
    async with FaultProxy(server_url) as proxy:
        async with WorkspaceClient(proxy.url, token=token, config=config) as client:
            if websocket:
                await client.connect(WS, timeout=TIMEOUT)
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            if websocket:
                assert proxy.cut_open() == 1  # the socket: the next frame the server sends is lost
            else:
                proxy.drop_all()  # the idle keep-alive connection: the next one is the cut one
                proxy.cut_next(1)
            commit = await asyncio.wait_for(
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c")), TIMEOUT
            )
        assert proxy.stats.cuts == 1
    assert commit.duplicate  # committed by the first send, answered on the retry
    state = await server_state(server_url, "tree")
    assert counter(state) == 1
    assert state["clock"] == 2


async def test_a_final_4xx_is_raised_typed_and_never_retried(server_url: str) -> None:
    sleep = RecordingSleep()
    config = fast_config(ops_over_websocket=False, sleep=sleep)
    async with WorkspaceClient(server_url, token=token_for(WS), config=config) as client:
        with pytest.raises(InvalidRequestError) as refused:
            await client.apply_op(WS, "tree", {"type": "node.insert", "node_id": "n"})
        assert client.pending_count() == 0  # answered: gone from the outbox
    async with WorkspaceClient(server_url, token="not-a-token", config=config) as client:
        with pytest.raises(AuthError):
            await client.get_state(WS, "tree")
    assert refused.value.code == "invalid_field"
    assert sleep.delays == []  # nothing was retried


async def test_an_op_refused_for_its_token_is_not_retried_and_stays_pending(
    server_url: str,
) -> None:
    """A refused token is no answer about the op (tests/client/test_token_refresh.py)."""
    sleep = RecordingSleep()
    config = fast_config(ops_over_websocket=False, sleep=sleep)
    async with WorkspaceClient(server_url, token=token_for("other"), config=config) as client:
        with pytest.raises(StillPendingError) as pending:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
        assert isinstance(pending.value.last_error, ForbiddenError)
        assert client.pending_count() == 1
    assert sleep.delays == []  # nothing was retried


async def test_an_invalid_id_is_refused_before_anything_is_written(
    server_url: str, token: str
) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        with pytest.raises(InvalidRequestError) as caught:
            await client.apply_op(
                "bad workspace!", "tree", NodeInsert(node_id="n", parent_id="root")
            )
        assert client.pending_count() == 0
    assert caught.value.code == "invalid_id"


async def test_after_the_last_attempt_the_op_stays_pending_then_commits_on_retry(
    server_url: str, token: str, tmp_path: Path
) -> None:
    sleep = RecordingSleep()
    config = fast_config(ops_over_websocket=False, sleep=sleep)
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        async with WorkspaceClient(
            proxy.url, token=token, outbox=tmp_path / "outbox", config=config
        ) as client:
            op = NodeInsert(node_id="n", parent_id="root", op_id="intent_0001")
            with pytest.raises(StillPendingError) as caught:
                await client.apply_op(WS, "tree", op)
            assert caught.value.op_id == "intent_0001"
            assert "resent" in str(caught.value)
            assert client.pending_count() == 1
            assert not client.synced
            # Full jitter: wait n is drawn from [0, base * 2 ** (n - 1)], four waits for five sends.
            assert len(sleep.delays) == 4
            for n, delay in enumerate(sleep.delays, start=1):
                assert 0 <= delay <= 0.005 * 2 ** (n - 1)
            proxy.refuse = False
            client.retry_pending()
            await client.wait_synced(timeout=TIMEOUT)
    log = await server_log(server_url, "tree")
    assert [entry["op_id"] for entry in log] == ["intent_0001"]


async def test_a_new_client_replays_the_outbox_first_in_original_order(
    server_url: str, token: str, tmp_path: Path
) -> None:
    config = fast_config(ops_over_websocket=False, retry_attempts=1)
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        client = WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox", config=config)
        await client.start()
        ops = [NodeInsert(node_id="n", parent_id="root")] + [
            NodeIncrement(node_id="n", field="c", by=i) for i in range(1, 6)
        ]
        outcomes = await asyncio.gather(
            *(client.apply_op(WS, "tree", op) for op in ops), return_exceptions=True
        )
        assert all(isinstance(o, StillPendingError) for o in outcomes)
        op_ids = [o.op_id for o in outcomes if isinstance(o, StillPendingError)]
        proxy.refuse = False
        fresh = await restart_client(client, config=fast_config(ops_over_websocket=False))
        try:
            assert fresh.pending_count() == len(ops)
            await fresh.wait_synced(timeout=TIMEOUT)
        finally:
            await fresh.close()
    log = await server_log(server_url, "tree")
    assert [entry["op_id"] for entry in log] == op_ids  # each once, in the order submitted
    assert counter(await server_state(server_url, "tree")) == sum(range(1, 6))


async def test_closing_with_ops_pending_tells_their_awaiters(
    server_url: str, token: str, tmp_path: Path
) -> None:
    async with FaultProxy(server_url) as proxy:
        proxy.delay = 60  # nothing comes back before the close
        for outbox, error in ((tmp_path / "outbox", StillPendingError), (None, ClientClosedError)):
            client = WorkspaceClient(
                proxy.url, token=token, outbox=outbox, config=fast_config(ops_over_websocket=False)
            )
            await client.start()
            before = proxy.stats.accepted

            def connected(stats: ProxyStats, before: int = before) -> bool:
                return stats.accepted > before

            pending = asyncio.ensure_future(
                client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
            )
            await asyncio.wait_for(proxy.wait_until(connected), TIMEOUT)
            await client.close()
            with pytest.raises(error):
                await pending


async def test_synced_tracks_what_is_pending(server_url: str, token: str) -> None:
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        assert client.synced
        await client.wait_synced(timeout=1)
        futures = [
            asyncio.ensure_future(
                client.apply_op(WS, "tree", NodeInsert(node_id=f"n{i}", parent_id="root"))
            )
            for i in range(20)
        ]
        await asyncio.sleep(0)  # let the submissions happen
        assert client.pending_count() == 20
        assert not client.synced
        await client.wait_synced(timeout=TIMEOUT)
        assert client.synced
        assert client.pending_count() == 0
        commits = await asyncio.gather(*futures)
    assert [c.clock for c in commits] == list(range(1, 21))


async def test_still_pending_is_reported_only_once_the_op_is_fsynced(
    server_url: str, token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op is sent as soon as it is in the outbox file; the client may only *say* it waits in
    the outbox (StillPendingError) once the outbox's fsync covered it."""
    import os
    import threading

    entered, gate = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:  # runs on the outbox's syncer thread
        entered.set()
        gate.wait(TIMEOUT)
        real_fsync(fd)

    config = fast_config(ops_over_websocket=False, retry_attempts=1)
    loop = asyncio.get_running_loop()
    async with FaultProxy(server_url) as proxy:
        proxy.refuse = True
        async with WorkspaceClient(
            proxy.url, token=token, outbox=tmp_path / "outbox", config=config
        ) as client:
            deferred = asyncio.Event()
            defer = client._ops._still_pending_once_synced

            async def spy(*args: Any) -> None:
                deferred.set()
                await defer(*args)

            monkeypatch.setattr(client._ops, "_still_pending_once_synced", spy)
            monkeypatch.setattr(os, "fsync", held_fsync)
            try:
                apply = asyncio.ensure_future(
                    client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c"))
                )
                assert await loop.run_in_executor(None, entered.wait, TIMEOUT)
                # The one attempt fails (connection refused) and the lane gives up meanwhile.
                await asyncio.wait_for(deferred.wait(), TIMEOUT)
                assert client._machine.is_parked(WS, "tree")
                assert not apply.done()  # given up, but its fsync has not returned yet
            finally:
                gate.set()
            with pytest.raises(StillPendingError):
                await asyncio.wait_for(apply, TIMEOUT)
            assert client.pending_count() == 1
