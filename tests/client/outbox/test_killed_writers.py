"""Client processes SIGKILLed mid-stream and restarted on their outbox: every op that reached the
outbox is committed exactly once, and none is lost."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import WorkspaceClient

from ..helpers import WS, fast_config, server_log, server_state

pytestmark = pytest.mark.acceptance

TIMEOUT = 60
KILLS = 6
REPO = Path(__file__).resolve().parents[3]


def outbox_op_ids(path: Path) -> list[str]:
    """What the dead process left in its outbox file (its lock died with it)."""
    if not path.exists():
        return []
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute("SELECT op_id FROM outbox ORDER BY seq")]
    except sqlite3.OperationalError:  # killed before the table was created
        return []
    finally:
        conn.close()


async def run_until_killed(
    args: list[str], kill_after: int, kill_delay: float, committed: set[str]
) -> tuple[int, int]:
    """Start a writer, let it report `kill_after` commits, SIGKILL it `kill_delay` seconds later.
    Returns (replayed at its start, return code).

    The delay picks the moment of death within the writer's cycle: its answers arrive in bursts
    (one batch acked, its rows deleted, then the prints), so a kill right on a print would
    nearly always land between a batch's delete and the next batch's insert."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.client.outbox.writer",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    replayed, seen = -1, 0
    try:
        async with asyncio.timeout(TIMEOUT):
            while seen < kill_after:
                line = (await proc.stdout.readline()).decode().split()
                assert line, "the writer exited on its own"
                if line[0] == "started":
                    replayed = int(line[1])
                elif line[0] == "committed":
                    committed.add(line[1])
                    seen += 1
        await asyncio.sleep(kill_delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        code = await proc.wait()
    return replayed, code


async def test_clients_killed_mid_stream_lose_nothing_and_apply_nothing_twice(
    server_url: str, token: str, tmp_path: Path
) -> None:
    rng = random.Random(4)
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as setup:
        await setup.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    outbox = tmp_path / "writer.outbox"
    committed: set[str] = set()
    left_behind: set[str] = set()
    replays: list[int] = []
    for round_ in range(KILLS):
        mode = "websocket" if round_ % 2 else "http"
        args = [server_url, token, str(outbox), "tree", "16", mode]
        replayed, code = await run_until_killed(
            args, rng.randint(40, 200), rng.uniform(0.0, 0.005), committed
        )
        assert code == -signal.SIGKILL
        replays.append(replayed)
        left_behind.update(outbox_op_ids(outbox))
    # The last word: a client on the same outbox replays whatever the last victim left.
    async with WorkspaceClient(
        server_url, token=token, outbox=outbox, config=fast_config()
    ) as last:
        replays.append(last.pending_count())
        await last.wait_synced(timeout=TIMEOUT)
    assert outbox_op_ids(outbox) == []
    log = await server_log(server_url, "tree")
    logged = [entry["op_id"] for entry in log[1:]]
    assert len(logged) == len(set(logged))  # nothing applied twice...
    counter = (await server_state(server_url, "tree"))["state"]["nodes"]["n"]["fields"]["c"]
    assert counter == len(logged)  # ...not even under another op_id
    assert committed <= set(logged)
    assert left_behind <= set(logged)  # every op found in an outbox after a kill was replayed
    assert left_behind  # and kills did leave ops pending in the outbox
    assert any(count > 0 for count in replays)
