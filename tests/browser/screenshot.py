"""Take the dashboard screenshot of the docs (`docs/images/dashboard.png`) on a live workload.

    .venv/bin/python -m tests.browser.screenshot docs/images/dashboard.png [--seconds 30]

Runs the real server on a loopback port (a temporary SQLite file), then for `--seconds`: an SDK
client commits ops to a few sub-docs at a varying rate, a worker claims and completes requests of
two stages (taking a little while each, so the charts have something to show), compute locks are
held, one request is poisoned and others wait for a worker class nobody serves. Headless Chromium
(the browser tests' driver) watches the page all along, then the screenshot is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from cv_mutations import new_op_id
from cv_server import ServerConfig, create_app
from cv_workspace_client import WorkspaceClient
from tests.browser.conftest import SECRET, WS, dashboard_url, open_browser, token_for

STAGES = ("evaluate", "summarize")


def insert(node_id: str) -> dict[str, Any]:
    return {"type": "node.insert", "node_id": node_id, "parent_id": "root", "op_id": new_op_id()}


async def post(http: aiohttp.ClientSession, path: str, **body: Any) -> Any:
    async with http.post(path, json=body) as resp:
        resp.raise_for_status()
        return None if resp.status == 204 else await resp.json()


async def writer(sdk: WorkspaceClient, rng: random.Random, stop: asyncio.Event) -> None:
    count = 0
    while not stop.is_set():
        burst = rng.choice((1, 2, 3, 8, 15))
        doc = rng.choice(("jobs", "candidates", "candidates", "notes"))
        await sdk.apply_ops(WS, doc, [insert(f"n{count + i}") for i in range(burst)])
        count += burst
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(0.1, 0.6))


async def worker(http: aiohttp.ClientSession, rng: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stage = rng.choice(STAGES)
        await post(http, f"/v1/workspaces/{WS}/requests", stage=stage, worker_class="demo")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(0.05, 0.4))  # it waits in the queue
        answer = await post(http, "/v1/queue/claim", worker_classes=["demo"], worker_id="worker-1")
        if answer is None:
            continue
        row = answer["request"]
        await asyncio.sleep(rng.uniform(0.2, 0.9) * (2 if row["stage"] == "evaluate" else 1))
        path = f"/v1/workspaces/{WS}/requests/{row['request_id']}/complete"
        await post(http, path, claim_token=row["claim_token"], result={"ok": True})


async def scene(http: aiohttp.ClientSession) -> None:
    """What stands still on the page: locks held, a poisoned request, requests waiting."""
    for task, holder in (("eval:salary", "worker-2"), ("eval:title", "worker-3")):
        await post(
            http, f"/v1/workspaces/{WS}/locks/acquire", job_id="job-42", task=task, holder=holder
        )
    body = {"stage": "evaluate", "worker_class": "gpu", "max_dequeues": 1}
    poisoned = await post(http, f"/v1/workspaces/{WS}/requests", **body)
    held = await post(http, "/v1/queue/claim", worker_classes=["gpu"], worker_id="worker-gpu")
    error = {
        "code": "provider_unavailable",
        "message": "the model provider answered 503 three times",
    }
    path = f"/v1/workspaces/{WS}/requests/{poisoned['request_id']}/fail"
    await post(http, path, claim_token=held["request"]["claim_token"], error=error)
    for stage in ("summarize", "evaluate"):
        await post(http, f"/v1/workspaces/{WS}/requests", stage=stage, worker_class="gpu")
    await post(http, f"/v1/workspaces/{WS}/requests", stage="summarize", worker_class="cpu")
    await post(http, "/v1/queue/claim", worker_classes=["cpu"], worker_id="worker-cpu")


async def main(out: Path, seconds: float) -> None:
    """`out`: an absolute path (the browser driver runs in another directory)."""
    rng = random.Random(21)
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(db_path=Path(tmp) / "cv.db", token_secret=SECRET)
        server = TestServer(create_app(config), host="127.0.0.1")
        await server.start_server()
        base = str(server.make_url("")).rstrip("/")
        headers = {"Authorization": f"Bearer {token_for(WS)}"}
        try:
            async with (
                aiohttp.ClientSession(base, headers=headers) as http,
                WorkspaceClient(base, token=token_for(WS), outbox=Path(tmp) / "outbox") as sdk,
                open_browser(Path(tmp) / "profile") as browser,
            ):
                await scene(http)
                await browser.call("goto", url=dashboard_url(server, token_for(WS), refresh="1"))
                stop = asyncio.Event()
                tasks = [
                    asyncio.create_task(writer(sdk, rng, stop)),
                    asyncio.create_task(worker(http, rng, stop)),
                ]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), seconds)
                await browser.call("screenshot", path=str(out), fullPage=True)
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            await server.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    asyncio.run(main(args.out.resolve(), args.seconds))
