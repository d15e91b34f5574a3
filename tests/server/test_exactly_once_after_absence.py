"""Exactly once after any absence (docs/ops.md#exactly-once), with a real SDK process on a
durable outbox, on both backends: ops the server applied but whose answers were cut, and ops
still waiting in the outbox, are resent after their op_id records are gone and each is applied
once (the counter equals the ops sent)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from cv_server import ServerConfig, create_app
from cv_server.keys import STORES
from cv_workspace_client.testing import FaultProxy

from .conftest import auth
from .op_records import (
    RETENTION_SECONDS,
    SKEW_SECONDS,
    SNAPSHOT_EVERY,
    compact_past,
    outlive_the_window,
)

WS, DOC = "ws1", "counter"
SCRIPT = Path(__file__).with_name("exactly_once_client.py")
TIMEOUT = 60


class SdkProcess:
    """The SDK script as a child process, spoken to line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str, outbox: Path) -> SdkProcess:
        token = auth(WS)["Authorization"].removeprefix("Bearer ")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",  # not the script's folder first on sys.path: its `http/` would shadow `http`
            str(SCRIPT),
            url,
            token,
            str(outbox),
            WS,
            DOC,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def say(self, line: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{line}\n".encode())
        await self.proc.stdin.drain()
        answer = await asyncio.wait_for(self.proc.stdout.readline(), TIMEOUT)
        assert answer, f"the SDK process died (exit {self.proc.returncode})"
        return answer.decode().strip()

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert await asyncio.wait_for(self.proc.wait(), TIMEOUT) == 0


async def counter(server: TestServer) -> tuple[int, int]:
    """The counter's value and the sub-doc's clock, read straight from the server."""
    url = str(server.make_url(f"/v1/workspaces/{WS}/docs/{DOC}"))
    async with aiohttp.ClientSession() as session, session.get(url, headers=auth(WS)) as response:
        body = await response.json()
    return body["state"]["nodes"]["n"]["fields"].get("c", 0), body["clock"]


@pytest.fixture
async def stand(
    aiohttp_server: Callable[..., Any], make_server_config: Callable[..., ServerConfig]
) -> AsyncIterator[tuple[TestServer, FaultProxy, ServerConfig]]:
    config = make_server_config(
        oplog_retention_seconds=RETENTION_SECONDS,
        minted_at_skew_seconds=SKEW_SECONDS,
        snapshot_every=SNAPSHOT_EVERY,
    )
    server: TestServer = await aiohttp_server(create_app(config))

    async with aiohttp.ClientSession() as session:
        url = str(server.make_url(f"/v1/workspaces/{WS}/docs/{DOC}/ops"))
        body = {"ops": [{"type": "node.insert", "node_id": "n", "parent_id": "root"}]}
        async with session.post(url, json=body, headers=auth(WS)) as response:
            assert response.status == 200, await response.text()
    async with FaultProxy(str(server.make_url("")).rstrip("/")) as proxy:
        yield server, proxy, config


async def write_later_op(server: TestServer) -> None:
    """One op of another writer after the SDK's: the op at the latest snapshot is one that
    compaction keeps, so the SDK's ops all fall below it."""
    url = str(server.make_url(f"/v1/workspaces/{WS}/docs/{DOC}/ops"))
    body = {"ops": [{"type": "node.insert", "node_id": "later", "parent_id": "root"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=auth(WS)) as response,
    ):
        assert response.status == 200, await response.text()


async def wait_for_count(server: TestServer, count: int) -> None:
    async def reached() -> None:
        while (await counter(server))[0] < count:  # noqa: ASYNC110 - another process's write
            await asyncio.sleep(0.02)

    await asyncio.wait_for(reached(), TIMEOUT)


async def test_ops_applied_unheard_and_ops_queued_are_applied_once_after_a_restart(
    stand: tuple[TestServer, FaultProxy, ServerConfig], tmp_path: Path
) -> None:
    """Three ops are applied but every answer is cut; the server becomes unreachable; four more
    are queued; the process is SIGKILLed. The server's compaction deletes the three's log rows
    and op_id records. A new process on the outbox resends all seven: the three are answered as
    decided (never applied again), the four applied, each once."""
    server, proxy, _config = stand
    outbox = tmp_path / "app.outbox"
    first = await SdkProcess.start(proxy.url, outbox)
    proxy.cut_fraction(1.0)  # every answer is lost after the server committed
    assert await first.say("submit 3") == "stored 3"
    await wait_for_count(server, 3)
    proxy.refuse = True
    proxy.drop_all()
    assert await first.say("submit 4") == "stored 7"
    await first.kill()

    await write_later_op(server)  # clock 5, after the three applied at 2..4
    await outlive_the_window(time.time())
    await compact_past(server.app[STORES].oplog, WS, DOC, 4)
    proxy.refuse = False
    proxy.cut_fraction(0.0)
    second = await SdkProcess.start(proxy.url, outbox)
    assert await second.say("sync") == "synced"
    await second.stop()
    value, clock = await counter(server)
    assert value == 7
    assert clock == 1 + 7 + 1  # the insert, each op once, and the later op


async def test_a_cut_between_seq_n_and_n_plus_1_applies_each_op_once(
    stand: tuple[TestServer, FaultProxy, ServerConfig], tmp_path: Path
) -> None:
    """Seqs 1..3 are committed and their answer cut; while the server is unreachable 4..6 are
    queued behind them and compaction deletes the log rows and op_id records of 1..3. When the
    network is back the SDK resends 1..6 in one lane: 1..3 are at or below the mark (answered,
    not applied), 4..6 apply, each once."""
    server, proxy, _config = stand
    sdk = await SdkProcess.start(proxy.url, tmp_path / "app.outbox")
    proxy.cut_fraction(1.0)
    assert await sdk.say("submit 3") == "stored 3"
    await wait_for_count(server, 3)
    proxy.refuse = True
    proxy.drop_all()
    assert await sdk.say("submit 3") == "stored 6"
    await write_later_op(server)  # clock 5, after seqs 1..3 at 2..4
    await outlive_the_window(time.time())
    await compact_past(server.app[STORES].oplog, WS, DOC, 4)
    proxy.cut_fraction(0.0)
    proxy.refuse = False
    assert await sdk.say("sync") == "synced"
    await sdk.stop()
    value, clock = await counter(server)
    assert value == 6
    assert clock == 1 + 6 + 1
