"""Acceptance: SIGKILL the real server mid-load; every acknowledged op survives exactly once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.acceptance.procs import ServerProcess, free_port, mint_cli_token

pytestmark = pytest.mark.acceptance

WRITERS = 4
OPS_PER_WRITER = 600


async def _read_log(url: str, token: str) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"}
    entries: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        while True:
            params = {"since": len(entries)}
            async with session.get(
                f"{url}/v1/workspaces/acc/docs/counter/ops", params=params, headers=headers
            ) as resp:
                page = await resp.json()
            entries += page["ops"]
            if len(entries) >= page["clock"]:
                return entries


async def _seed(url: str, token: str) -> None:
    seed = {"ops": [{"type": "node.insert", "node_id": "n", "parent_id": "root"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/v1/workspaces/acc/docs/counter/ops",
            json=seed,
            headers={"Authorization": f"Bearer {token}"},
        ) as resp,
    ):
        assert resp.status == 200


def _acked(files: list[Path]) -> dict[str, int]:
    acked: dict[str, int] = {}
    for file in files:
        for line in file.read_text().splitlines():
            op_id, clock = line.split()
            assert op_id not in acked
            acked[op_id] = int(clock)
    return acked


def test_every_acknowledged_op_survives_a_server_sigkill_exactly_once(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, "acc")
    server = ServerProcess(db, free_port(), tmp_path / "server.log")
    server.start()
    try:
        asyncio.run(_seed(server.url, token))
        outs = [tmp_path / f"writer{i}.acks" for i in range(WRITERS)]
        writers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.acceptance.writer",
                    server.url,
                    token,
                    "acc",
                    "counter",
                    str(OPS_PER_WRITER),
                    str(out),
                    "120",
                ]
            )
            for out in outs
        ]
        # Kill once a good part of the load is acknowledged, while writers are mid-stream.
        deadline = time.monotonic() + 60
        while sum(len(o.read_text().splitlines()) for o in outs if o.exists()) < 800:
            assert time.monotonic() < deadline, "writers made no progress"
            time.sleep(0.02)
        acked_before_kill = _acked([o for o in outs if o.exists()])
        server.kill()
        server.start()
        for writer in writers:
            assert writer.wait(timeout=150) == 0
        acked = _acked(outs)
        log = asyncio.run(_read_log(server.url, token))
    finally:
        server.stop()

    assert len(acked) == WRITERS * OPS_PER_WRITER
    assert [entry["clock"] for entry in log] == list(range(1, len(log) + 1))  # gap-free
    increments = [entry for entry in log if entry["op"]["type"] == "node.increment"]
    logged = [entry["op_id"] for entry in increments]
    assert len(logged) == len(set(logged))  # nothing twice
    by_id = {entry["op_id"]: entry["clock"] for entry in increments}
    for op_id, clock in acked.items():  # every acknowledged op, at the clock it was acked with
        assert by_id.get(op_id) == clock
    assert set(acked_before_kill) <= set(by_id)
    assert len(increments) == WRITERS * OPS_PER_WRITER
