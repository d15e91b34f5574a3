"""What the websocket heartbeat costs per message: aiohttp echo round trips on loopback, server and
client in one process, alternated between three set-ups:

- `off`: no heartbeat on either end;
- `aiohttp`: aiohttp's `heartbeat=60` on both ends;
- `shipped`: what runs now: aiohttp's on the server (`ServerConfig.socket_heartbeat_seconds`),
  the SDK's own on the client (`cv_workspace_client._core.liveness`: pings answered and pongs
  seen by the reader, one attribute store per message).

    .venv/bin/python -m bench.ws_heartbeat [--trips 5000] [--rounds 6]

The timers fire once a minute; the cost is per message: aiohttp re-arms its timer as data
arrives (one extra event-loop callback per tick that received data). Reported: CPU µs per round
trip (one message in and one out on each end), median of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
from aiohttp import web

from cv_workspace_client._core.liveness import Liveness

HEARTBEAT = 60.0  # the default heartbeat of both ends


async def _round(mode: str, trips: int) -> float:
    """CPU µs per echo round trip in set-up `mode`."""
    server_heartbeat = None if mode == "off" else HEARTBEAT
    client_heartbeat = HEARTBEAT if mode == "aiohttp" else None

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=server_heartbeat)
        await ws.prepare(request)
        async for message in ws:
            await ws.send_str(message.data)
        return ws

    app = web.Application()
    app.router.add_get("/ws", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}/ws"
    try:
        async with aiohttp.ClientSession() as session:
            if mode == "shipped":
                ws = await session.ws_connect(url, autoping=False)
                live = Liveness(HEARTBEAT)
            else:
                ws = await session.ws_connect(url, heartbeat=client_heartbeat)
                live = None
            payload = "x" * 100
            started = time.process_time()
            for _ in range(trips):
                await ws.send_str(payload)
                while True:  # as the SDK's reader: every message counts as heard
                    message = await ws.receive()
                    if live is not None:
                        live.heard()
                    if message.type is aiohttp.WSMsgType.PING:
                        await ws.pong(message.data)
                        continue
                    break
            cpu = time.process_time() - started
            await ws.close()
    finally:
        await runner.cleanup()
    return cpu / trips * 1e6


async def main(trips: int, rounds: int) -> None:
    results: dict[str, list[float]] = {"off": [], "aiohttp": [], "shipped": []}
    for _ in range(rounds):
        for mode in results:  # alternated: drift on a shared machine hits all alike
            results[mode].append(await _round(mode, trips))
    off = statistics.median(results["off"])
    print(f"{trips} echo round trips x {rounds} rounds, CPU us per round trip (median):")
    for mode, values in results.items():
        median = statistics.median(values)
        print(
            f"  {mode:8} {median:7.1f}  {median - off:+6.1f} ({median / off:.2f}x)"
            f"   {sorted(round(x, 1) for x in values)}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(main(args.trips, args.rounds))
