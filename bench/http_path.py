"""The server's cost per HTTP request on the worker's queue cycle, in one process.

    .venv/bin/python -m bench.http_path [--cycles 300] [--rounds 5]

Each cycle is the three requests a worker and its producer make per job over HTTP: enqueue,
claim, complete. The app (`create_app`, SQLite in a temporary directory) runs on the main
thread's event loop behind a real loopback socket; the client runs on a thread of its own with
its own loop, so `time.thread_time()` of the main thread is the server's event-loop CPU alone
(the SQLite writer thread and the client are not in it). One warm-up round, then `--rounds`
rounds; the minimum and median per request are printed.

On a loaded shared machine wall-clock CPU figures drift by ±20%; for an A/B of a small change,
count instructions instead, which do not depend on the load (the count is of every thread, the
client's included, which is the same on both sides): run it under
`valgrind --tool=callgrind` with `--rounds 1` at two `--cycles` (20 and 120) and divide the
difference of the two totals by the difference of the cycles (bench/README.md, "HTTP path").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token

SECRET = b"bench-http-path-secret-0123456789"
WORKSPACE = "ws1"


class _Turns:
    """The server's loop lets the client thread run one round at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.go = threading.Event()
        self.done: asyncio.Future[None] | None = None

    def wait_turn(self) -> None:
        self.go.wait()
        self.go.clear()

    def finished(self) -> None:
        done = self.done
        assert done is not None
        self.loop.call_soon_threadsafe(done.set_result, None)


async def _client(port: int, cycles: int, rounds: int, turns: _Turns) -> None:
    token = mint_token(SECRET, [WORKSPACE], now=time.time())
    headers = {"Authorization": f"Bearer {token}"}
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(rounds):
            turns.wait_turn()
            for _ in range(cycles):
                enqueue = f"{base}/v1/workspaces/{WORKSPACE}/requests"
                async with session.post(enqueue, json={"stage": "s"}) as resp:
                    assert resp.status == 202, await resp.text()
                claim = f"{base}/v1/queue/claim"
                async with session.post(claim, json={"worker_classes": ["s"]}) as resp:
                    assert resp.status == 200, await resp.text()
                    row = (await resp.json())["request"]
                complete = f"{enqueue}/{row['request_id']}/complete"
                async with session.post(complete, json={"claim_token": row["claim_token"]}) as resp:
                    assert resp.status == 200, await resp.text()
            turns.finished()


async def measure(cycles: int, rounds: int) -> list[float]:
    """Server event-loop CPU µs per request, one figure per round (the warm-up left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(ServerConfig(db_path=Path(tmp) / "cv.db", token_secret=SECRET))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            turns = _Turns(asyncio.get_running_loop())
            client = threading.Thread(
                target=lambda: asyncio.run(_client(port, cycles, rounds + 1, turns)), daemon=True
            )
            client.start()
            figures = []
            for index in range(rounds + 1):
                turns.done = asyncio.get_running_loop().create_future()
                before = time.thread_time()
                turns.go.set()
                await turns.done
                if index:  # the first round warms up
                    figures.append((time.thread_time() - before) / (cycles * 3) * 1e6)
            client.join()
        finally:
            await runner.cleanup()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300, help="jobs per round (3 requests each)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.cycles, args.rounds))
    print(
        f"server event-loop CPU per request (enqueue, claim, complete): "
        f"min {min(figures):.1f} us, median {statistics.median(figures):.1f} us "
        f"over {args.rounds} rounds of {args.cycles} jobs"
    )


if __name__ == "__main__":
    main()
