"""How long a subscriber behind a lossy link stays behind once the writes stop.

One run: a fresh `cv-server` app on loopback (in this process), a `FaultProxy` in front of it
that drops each server-to-client chunk with probability `--cut` (and with it the connection),
a subscriber connected through the proxy, and a writer connected straight to the server that
commits `--rate` ops a second for `--write` seconds. When the writer stops, the clock of its last
commit is the target; the figure is the time until the subscriber has seen it. Each run is
bounded by `--timeout` (a run that hits it is reported at the bound, marked `>`).

    .venv/bin/python -m bench.catchup [--runs 10] [--write 20] [--rate 20] [--cut 0.15]

Reported: the catch-up seconds of every run, and p50 / p99 / max by nearest rank (with ten runs,
p99 is the slowest run), plus the subscriber's websocket connects per run and the longest wait
its websocket slept before a reconnect, and the longest of its other retry waits (catch-up
reads through the same lossy link).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from aiohttp import web

from bench._procs import percentiles
from cv_mutations import NodeInsert
from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.testing import FaultProxy

SECRET = b"bench-catchup-secret-0123456789abcdef"
WS = "ws1"
SUB_DOC = "tree"


class Waits:
    """The subscriber's `sleep`: sleeps, and keeps the longest wait of its websocket's run loop
    (its task is named `cv-socket-*`) apart from the longest of every other retry."""

    def __init__(self) -> None:
        self.socket = 0.0
        self.other = 0.0

    async def __call__(self, delay: float) -> None:
        task = asyncio.current_task()
        if task is not None and task.get_name().startswith("cv-socket-"):
            self.socket = max(self.socket, delay)
        else:
            self.other = max(self.other, delay)
        await asyncio.sleep(delay)


async def _one_run(
    seed: int, *, write_s: float, rate: float, cut: float, bound: float, waits: Waits
) -> tuple[float, bool, int]:
    """(catch-up seconds, whether it finished within `bound`, subscriber connects)."""
    with tempfile.TemporaryDirectory(prefix="bench-catchup-") as tmp:
        app = create_app(ServerConfig(db_path=Path(tmp) / "server.db", token_secret=SECRET))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        server_url = f"http://127.0.0.1:{port}"
        token = mint_token(SECRET, [WS], now=time.time())
        seen = 0
        advanced = asyncio.Condition()
        try:
            async with FaultProxy(server_url, seed=seed) as proxy:
                proxy.cut_chunks(cut)
                async with (
                    WorkspaceClient(
                        proxy.url, token=token, config=ClientConfig(sleep=waits)
                    ) as reader,
                    WorkspaceClient(server_url, token=token) as writer,
                ):

                    async def follow() -> None:
                        nonlocal seen
                        async for committed in reader.subscribe(WS, SUB_DOC):
                            async with advanced:
                                seen = committed.clock
                                advanced.notify_all()

                    follower = asyncio.create_task(follow())
                    last = 0
                    loop = asyncio.get_running_loop()
                    end = loop.time() + write_s
                    n = 0
                    while loop.time() < end:
                        commit = await writer.apply_op(
                            WS, SUB_DOC, NodeInsert(node_id=f"n{n}", parent_id="root")
                        )
                        last = commit.clock
                        n += 1
                        await asyncio.sleep(1.0 / rate)
                    stopped = time.perf_counter()
                    finished = True
                    try:
                        async with asyncio.timeout(bound), advanced:
                            await advanced.wait_for(lambda: seen >= last)
                    except TimeoutError:
                        finished = False
                    caught_up = time.perf_counter() - stopped
                    follower.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await follower
                    sockets = reader._sockets.get(WS)  # a benchmark's probe
                    connects = sockets.connections if sockets is not None else 0
                    return caught_up, finished, connects
        finally:
            await runner.cleanup()


async def _main(args: argparse.Namespace) -> None:
    samples: list[float] = []
    for run in range(args.runs):
        waits = Waits()
        seconds, finished, connects = await _one_run(
            run, write_s=args.write, rate=args.rate, cut=args.cut, bound=args.timeout, waits=waits
        )
        samples.append(seconds)
        mark = "" if finished else ">"
        print(
            f"run {run}: caught up in {mark}{seconds:.2f} s ({connects} websocket connects, "
            f"longest reconnect wait {waits.socket:.2f} s, longest other retry wait "
            f"{waits.other:.2f} s)"
        )
    stats = percentiles(samples)
    print(
        f"catch-up after writes stop, {args.runs} runs, cut {args.cut:.0%} of server chunks: "
        f"p50 {stats['p50']:.2f} s, p99 {stats['p99']:.2f} s, max {stats['max']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="repeated runs (default 10)")
    parser.add_argument("--write", type=float, default=20.0, help="seconds of writes per run")
    parser.add_argument("--rate", type=float, default=20.0, help="ops per second while writing")
    parser.add_argument("--cut", type=float, default=0.15, help="share of server chunks cut")
    parser.add_argument("--timeout", type=float, default=150.0, help="bound on one catch-up")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
