"""What an agent pays per call through `cv-workspace mcp` (docs/mcp.md), next to the SDK called
directly, in the same run against the same real `cv-server`:

- `get_state`: a small sub-doc's state (a read, retried like any idempotent read);
- `apply_ops`: one `node.increment` (a durable commit; over the websocket for both).

The SDK side is one `WorkspaceClient` in this process; the MCP side is the MCP server as a
subprocess over stdio (as an agent host starts it), driven by the `mcp` SDK's client, each call
awaited before the next (as an agent makes them). Rounds alternate the two sides.

    .venv/bin/python -m bench.mcp [--calls 300] [--rounds 3]

Reported: per-call latency p50 / p99 in ms, best round of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from bench._procs import ServerProcess, percentiles
from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import WorkspaceClient

WS = "bench"
DOC = "mcp"


async def _timed(calls: int, one: Callable[[], Awaitable[Any]]) -> list[float]:
    samples: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        await one()
        samples.append((time.perf_counter() - start) * 1000.0)
    return samples


async def _sdk_round(url: str, token: str, calls: int) -> dict[str, list[float]]:
    async with WorkspaceClient(url, token=token) as client:
        await client.connect(WS)
        read = await _timed(calls, lambda: client.get_state(WS, DOC))
        bump = NodeIncrement(node_id="n", field="sdk")
        write = await _timed(calls, lambda: client.apply_op(WS, DOC, bump))
    return {"get_state": read, "apply_ops": write}


async def _mcp_round(url: str, token_file: Path, calls: int) -> dict[str, list[float]]:
    args = ["-m", "cv_workspace_client.cli", "workspace", "mcp"]
    args += ["--url", url, "--token-file", str(token_file)]
    params = StdioServerParameters(command=sys.executable, args=args, cwd=os.getcwd())
    async with Client(params) as client:
        state = {"workspace_id": WS, "sub_doc": DOC}
        bump = {**state, "ops": [{"type": "node.increment", "node_id": "n", "field": "mcp"}]}
        await client.call_tool("get_state", state)  # the SDK client's first connection
        await client.call_tool("apply_ops", bump)  # and its websocket
        read = await _timed(calls, lambda: client.call_tool("get_state", state))
        write = await _timed(calls, lambda: client.call_tool("apply_ops", bump))
    return {"get_state": read, "apply_ops": write}


async def _seed(url: str, token: str) -> None:
    async with WorkspaceClient(url, token=token) as client:
        await client.apply_op(WS, DOC, NodeInsert(node_id="n", parent_id="root"))


async def _main(calls: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.start(Path(tmp) / "cv.db")
        try:
            token_file = Path(tmp) / "token"
            token_file.write_text(server.token + "\n")
            await _seed(server.url, server.token)
            best: dict[tuple[str, str], dict[str, float]] = {}
            for _ in range(rounds):
                for side in ("sdk", "mcp"):
                    if side == "sdk":
                        measured = await _sdk_round(server.url, server.token, calls)
                    else:
                        measured = await _mcp_round(server.url, token_file, calls)
                    for call, samples in measured.items():
                        figures = percentiles(samples)
                        key = (call, side)
                        if key not in best or figures["p50"] < best[key]["p50"]:
                            best[key] = figures
        finally:
            server.stop()
    print(f"{calls} calls a round, best of {rounds} rounds (ms per call)")
    for call in ("get_state", "apply_ops"):
        sdk, mcp = best[(call, "sdk")], best[(call, "mcp")]
        print(
            f"{call:<10} sdk p50 {sdk['p50']:6.2f}  p99 {sdk['p99']:6.2f}   "
            f"mcp p50 {mcp['p50']:6.2f}  p99 {mcp['p99']:6.2f}   "
            f"mcp - sdk p50 {mcp['p50'] - sdk['p50']:+6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(_main(args.calls, args.rounds))


if __name__ == "__main__":
    main()
