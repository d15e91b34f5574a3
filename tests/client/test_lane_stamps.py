"""Lane stamps through a real server on loopback (docs/client.md#exactly-once): a hole the SDK
leaves in its own lane (an op the server refuses with the whole request) never wedges the ops
after it."""

from __future__ import annotations

import asyncio
import json

from cv_mutations import NodeIncrement, NodeInsert, NodeUpdate
from cv_workspace_client import Commit, InvalidRequestError, WorkspaceClient

from .helpers import WS, fast_config, server_log, server_state

TIMEOUT = 20


async def test_a_dropped_op_does_not_wedge_its_lane_over_http(server_url: str, token: str) -> None:
    """One op of a batch carries an integer the log cannot hold: the server refuses the whole
    request naming it (422, `op_index`), the SDK drops it and resends the rest. Its seq is never
    decided, so the server answers the next ones `seq_gap` (expecting the dropped seq); the SDK
    renumbers them and they commit, each once, in order."""
    config = fast_config(ops_over_websocket=False, retry_attempts=3)
    async with WorkspaceClient(server_url, token=token, config=config) as client:
        await client.apply_op(WS, "lane", NodeInsert(node_id="n", parent_id="root"))
        ops: list[NodeIncrement | NodeUpdate] = [
            NodeIncrement(node_id="n", field="c", by=1),
            NodeUpdate(node_id="n", set={"huge": 2**70}),
            NodeIncrement(node_id="n", field="c", by=1),
            NodeIncrement(node_id="n", field="c", by=1),
        ]
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(client.apply_op(WS, "lane", op) for op in ops), return_exceptions=True
            ),
            TIMEOUT,
        )
    assert isinstance(outcomes[1], InvalidRequestError)
    assert outcomes[1].op_index == 1
    committed = [outcomes[0], outcomes[2], outcomes[3]]
    assert all(isinstance(o, Commit) and not o.duplicate for o in committed), outcomes
    log = await server_log(server_url, "lane")
    assert [entry["op"]["seq"] for entry in log] == [1, 2, 3, 4]  # no hole, in order
    assert [entry["op"]["client_id"] for entry in log] == [log[0]["op"]["client_id"]] * 4
    state = await server_state(server_url, "lane")
    assert state["state"]["nodes"]["n"]["fields"] == {"c": 3}
    assert json.dumps(log).count('"huge"') == 0
