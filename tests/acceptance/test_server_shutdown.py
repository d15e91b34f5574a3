"""Acceptance: SIGTERM stops the real server cleanly — sockets closed with 1001, exit code 0,
and nothing it acknowledged is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance


async def _scenario(server: ServerProcess, token: str) -> tuple[int | None, list[int], int]:
    headers = {"Authorization": f"Bearer {token}"}
    ops_url = f"{server.url}/v1/workspaces/acc/docs/tree/ops"
    acked: list[int] = []
    loaded = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"{server.url}/v1/workspaces/acc/socket", headers=headers)
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        assert (await ws.receive_json(timeout=10))["type"] == "synced"

        async def writer(w: int) -> None:
            for i in range(10_000):
                op = {"type": "node.insert", "node_id": f"w{w}-{i}", "parent_id": "root"}
                try:
                    async with session.post(ops_url, json={"ops": [op]}, headers=headers) as r:
                        body = await r.json(content_type=None)
                except (aiohttp.ClientError, ValueError):
                    return  # the server went away: stop writing
                if r.status != 200:
                    return
                acked.append(body["results"][0]["clock"])
                if len(acked) >= 200:  # the load has built up: time for the signal
                    loaded.set()

        async def read_until_closed() -> int | None:
            async for _ in ws:
                pass
            return ws.close_code

        reader = asyncio.create_task(read_until_closed())
        writers = [asyncio.create_task(writer(w)) for w in range(8)]
        await asyncio.wait_for(loaded.wait(), 60)
        exit_code = await asyncio.to_thread(server.terminate)
        await asyncio.gather(*writers)
        close_code = await asyncio.wait_for(reader, 10)
    return close_code, acked, exit_code


def test_sigterm_closes_sockets_with_1001_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    try:
        close_code, acked, exit_code = asyncio.run(_scenario(server, token))
        assert exit_code == 0
        assert close_code == 1001
        server.start()  # same file: every acknowledged op is there

        async def head() -> int:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"{server.url}/v1/workspaces/acc/docs/tree/ops?since=0&limit=1",
                    headers={"Authorization": f"Bearer {token}"},
                ) as resp,
            ):
                return int((await resp.json())["clock"])

        assert sorted(acked) == list(range(1, len(acked) + 1))
        assert asyncio.run(head()) >= len(acked)
    finally:
        server.stop()
