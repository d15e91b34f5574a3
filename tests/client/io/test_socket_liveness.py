"""The SDK's websocket notices a connection that went silent without closing (a NAT that forgot
the flow, a peer that lost power) by its heartbeat, and reconnects: subscriptions resume and ops
in flight are resent under their op_ids, instead of waiting for the OS (hours) or the 300 s ack
deadline. Through the fault proxy's `silence_open`, on a real server on loopback."""

from __future__ import annotations

import asyncio

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client._core.liveness import Liveness, Verdict
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, fast_config, server_log

SUB = "tree"
#: A silent connection is given up within 1.5 intervals (a probe after one, half an interval
#: for its answer): noticed in under two seconds here, while a live one on a loaded machine
#: has half a second to answer its probe, so no test sees a reconnect it did not cause.
HEARTBEAT = 1.0
#: Every wait here is bounded; a missing heartbeat shows up as this timeout, not as a hang.
BOUND = 10.0


def _insert() -> NodeInsert:
    return NodeInsert(node_id="n", parent_id="root", fields={"count": 0})


def _increment() -> NodeIncrement:
    return NodeIncrement(node_id="n", field="count", by=1)


async def test_a_subscription_on_a_silenced_connection_reconnects_and_sees_the_next_op(
    server_url: str, token: str
) -> None:
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(server_url, token=token, config=fast_config()) as writer,
        WorkspaceClient(
            proxy.url, token=token, config=fast_config(socket_heartbeat_seconds=HEARTBEAT)
        ) as reader,
    ):
        sub = reader.subscribe(WS, SUB)
        await writer.apply_op(WS, SUB, _insert())
        first = await asyncio.wait_for(anext(sub), BOUND)
        assert first.clock == 1
        assert proxy.silence_open() == 1

        await writer.apply_op(WS, SUB, _increment())
        second = await asyncio.wait_for(anext(sub), BOUND)
        assert second.clock == 2
        assert proxy.stats.accepted >= 2  # a new connection carried it, not the silent one
        await sub.aclose()


async def test_an_op_sent_on_a_silenced_connection_is_resent_and_committed_once(
    server_url: str, token: str
) -> None:
    async with FaultProxy(server_url) as proxy:
        config = fast_config(socket_heartbeat_seconds=HEARTBEAT)
        async with WorkspaceClient(proxy.url, token=token, config=config) as client:
            # The socket first, so no pooled HTTP connection goes silent with it (aiohttp
            # drops idle pooled connections after 15 s; an in-flight HTTP request has only its
            # deadline, which no heartbeat can shorten).
            await client.connect(WS, timeout=BOUND)
            await client.apply_op(WS, SUB, _insert())
            assert proxy.stats.accepted == 1
            assert proxy.silence_open() == 1

            commit = await asyncio.wait_for(client.apply_op(WS, SUB, _increment()), BOUND)
            assert commit.clock == 2
            assert client.pending_count() == 0
    log = await server_log(server_url, SUB)
    assert [entry["op_id"] for entry in log].count(commit.op_id) == 1
    assert len(log) == 2


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_heartbeat_that_cannot_work_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="socket_heartbeat_seconds"):
        ClientConfig(socket_heartbeat_seconds=value)


def test_the_heartbeat_can_be_switched_off() -> None:
    assert ClientConfig(socket_heartbeat_seconds=None).socket_heartbeat_seconds is None
    assert ClientConfig().socket_heartbeat_seconds == 60.0  # The default heartbeat


# -- the heartbeat's decisions, without a socket ------------------------------------------------


def test_a_peer_heard_every_interval_is_never_probed() -> None:
    live = Liveness(60.0)
    for _ in range(5):
        assert live.tick() == (Verdict.WAIT, 60.0)
        live.heard()


def test_a_silent_peer_is_probed_then_given_up_half_an_interval_later() -> None:
    live = Liveness(60.0)
    assert live.tick() == (Verdict.WAIT, 60.0)  # the handshake counts as heard
    assert live.tick() == (Verdict.PING, 30.0)
    assert live.tick() == (Verdict.DEAD, 0.0)


def test_a_probe_answered_puts_the_peer_back_to_waiting() -> None:
    live = Liveness(60.0)
    live.tick()
    assert live.tick() == (Verdict.PING, 30.0)
    live.heard()  # the pong
    assert live.tick() == (Verdict.WAIT, 60.0)
    assert live.tick() == (Verdict.PING, 30.0)  # probed afresh after the next silent interval
