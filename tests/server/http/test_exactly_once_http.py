"""Exactly once through real HTTP on both backends (docs/ops.md#exactly-once): a raw op dated
by `minted_at` and resent after its op_id record is gone is `op_expired`, the log unchanged; a
lane op past its mark is refused `seq_gap`, nothing applied out of order, and the same ops sent
in order apply."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from tests.server.conftest import ClientFactory
from tests.server.helpers import WS, get_doc, get_ops, insert, post_ops
from tests.server.op_records import (
    RETENTION_SECONDS,
    SKEW_SECONDS,
    SNAPSHOT_EVERY,
    compact_past,
    outlive_the_window,
)

CLIENT = "client-0000000000001"


def put(value: int, **stamp: Any) -> dict[str, Any]:
    """`node.update` setting `v` on node "n": the order ops apply in shows in the result."""
    return {"type": "node.update", "node_id": "n", "set": {"v": value}, **stamp}


async def test_a_raw_op_resent_after_its_record_is_gone_is_expired_and_the_log_unchanged(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    config = make_server_config(
        oplog_retention_seconds=RETENTION_SECONDS,
        minted_at_skew_seconds=SKEW_SECONDS,
        snapshot_every=SNAPSHOT_EVERY,
    )
    client = await aiohttp_client(create_app(config))
    await post_ops(client, [insert("n")])
    minted = time.time()
    op = put(1, op_id=new_op_id(), minted_at=int(minted * 1000))
    (committed,) = (await post_ops(client, [op]))["results"]
    assert committed == {"op_id": op["op_id"], "clock": 2, "duplicate": False}
    (again,) = (await post_ops(client, [op]))["results"]
    assert again == {**committed, "duplicate": True}  # on record: answered from it

    await post_ops(client, [insert("later")])  # clock 3: the op at the latest snapshot stays
    await outlive_the_window(minted)
    await compact_past(client.app[STORES].oplog, WS, "tree", 2)
    log_before, doc_before = await get_ops(client, since=2), await get_doc(client)
    (expired,) = (await post_ops(client, [op]))["results"]
    assert expired["op_id"] == op["op_id"]
    assert expired["duplicate"] is False
    assert expired["error"]["code"] == "op_expired"
    assert expired["error"]["clock"] == 3  # the head: what the client reads from
    assert await get_ops(client, since=2) == log_before
    assert await get_doc(client) == doc_before


async def test_a_seq_gap_applies_nothing_out_of_order_and_a_resend_in_order_applies(
    aiohttp_client: ClientFactory, make_server_config: Callable[..., ServerConfig]
) -> None:
    client = await aiohttp_client(create_app(make_server_config()))
    await post_ops(client, [insert("n")])
    now = int(time.time() * 1000)
    ops = [
        put(seq, op_id=new_op_id(), client_id=CLIENT, seq=seq, minted_at=now) for seq in (1, 2, 3)
    ]
    (first,) = (await post_ops(client, ops[:1]))["results"]
    assert first["clock"] == 2
    log_before = await get_ops(client)

    # Seq 2 is cut on its way: 3 arrives first and is refused, with the seq the lane expects.
    (gap,) = (await post_ops(client, ops[2:]))["results"]
    assert gap["error"]["code"] == "seq_gap"
    assert gap["error"]["expected_seq"] == 2
    assert await get_ops(client) == log_before
    assert (await get_doc(client))["state"]["nodes"]["n"]["fields"]["v"] == 1

    # In order, 2 then 3 apply, each once; a resend of all three changes nothing more.
    results = (await post_ops(client, ops[1:]))["results"]
    assert [r["clock"] for r in results] == [3, 4]
    again = (await post_ops(client, ops))["results"]
    assert [(r["clock"], r["duplicate"]) for r in again] == [(2, True), (3, True), (4, True)]
    log = (await get_ops(client))["ops"]
    assert [entry["op"]["set"]["v"] for entry in log[1:]] == [1, 2, 3]
    assert (await get_doc(client))["state"]["nodes"]["n"]["fields"]["v"] == 3
