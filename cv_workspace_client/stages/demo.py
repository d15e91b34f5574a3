"""The agent side of `scripts/demo`: seed a few jobs, subscribe to them, enqueue `evaluate` for
each from two agents at once, wait for the results — all through a flaky network — then print
what the provider was paid for, what the server committed and what the subscriber saw.

`python -m cv_workspace_client.stages.demo --url SERVER --token T --provider-url P/v1`

The flaky network is a `FaultProxy` in this process between these clients and the server: it
cuts a share of the server's answers (HTTP responses, SSE streams, websocket frames). Every cut
request is retried under the same op_id / request id; the subscription resumes without a gap.
Exit status 0 when every invariant held (each cell paid once, committed once, seen once).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp

from cv_mutations import NodeInsert
from cv_workspace_client._fakes.proxy import FaultProxy
from cv_workspace_client._queue import requester as api
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.models import Committed, Snapshot
from cv_workspace_client.queue_models import EnqueuedRequest, RequestOutcome
from cv_workspace_client.stages.jobs import JOBS

__all__ = ["enqueue_evaluations", "enqueue_summary", "main"]

COLUMNS = [
    {"name": "fit", "prompt": "How well does this job fit a senior backend engineer?"},
    {"name": "seniority", "prompt": "What seniority does this job ask for?"},
    {"name": "remote", "prompt": "Can this job be done remotely?"},
]
TITLES = ["Backend engineer", "Data engineer", "SRE", "Platform lead"]


def _cells(committed: Committed) -> list[tuple[str, str, Any]]:
    raw = committed.op.model_dump()
    if raw["type"] != "node.update":
        return []
    return [(raw["node_id"], k, v) for k, v in raw["set"].items() if k.startswith("eval:")]


async def enqueue_evaluations(
    agents: Sequence[WorkspaceClient], workspace: str, jobs: Sequence[str], stage_input: Any
) -> list[EnqueuedRequest]:
    """Every agent enqueues `evaluate` for every job, all at once (the race the queue's
    deterministic request ids settle).

    Each enqueue carries its own Idempotency-Key. Without one, the server cannot tell the SDK's
    retry of an enqueue whose answer the flaky network cut from another agent's enqueue: the
    retry finds the request its own first attempt made and is answered `coalesced: true`, so
    the summary counted more coalesced enqueues than there were enqueues absorbed by another.
    Under a key, the retry gets the first attempt's answer back (`replayed`). The key is fresh
    per run: the server keeps keys for 24 h, and a second demo on the same workspace must not
    be answered with the first one's replies."""
    run = secrets.token_hex(8)
    return list(
        await asyncio.gather(
            *(
                api.enqueue(
                    agent,
                    workspace,
                    {"stage": "evaluate", "job_id": j, "input": stage_input},
                    idempotency_key=f"demo-{run}-agent{n}-{j}",
                )
                for n, agent in enumerate(agents)
                for j in jobs
            )
        )
    )


def enqueue_summary(enqueued: Sequence[EnqueuedRequest]) -> str:
    """`N enqueues, M requests (K coalesced)`: K counts the enqueues absorbed into a request
    another enqueue had made (README, docs/queue.md)."""
    ids = {e.request_id for e in enqueued}
    coalesced = sum(e.coalesced for e in enqueued)
    return f"{len(enqueued)} enqueues, {len(ids)} requests ({coalesced} coalesced)"


async def _get_json(session: aiohttp.ClientSession, url: str, **kw: Any) -> Any:
    async with session.get(url, **kw) as response:
        response.raise_for_status()
        return await response.json()


class _NoBar:
    def update(self, n: int = 1) -> None:
        del n

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _bar(total: int, desc: str) -> Any:
    """A progress bar on stderr when tqdm is installed (the dev extra: `scripts/demo`) and stderr
    is a terminal; nothing otherwise. tqdm is not an SDK dependency."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not sys.stderr.isatty())


async def run(
    url: str, token: str, provider_url: str, workspace: str, cut: float, seed: int
) -> int:
    jobs = [f"job-{i + 1}" for i in range(len(TITLES))]
    cells = len(jobs) * len(COLUMNS)
    # Retries a little faster than the default 1 s base, so the demo does not idle on the cuts.
    config = ClientConfig(retry_base_seconds=0.1, retry_cap_seconds=2.0, retry_attempts=8)
    async with FaultProxy(url, seed=seed) as proxy, aiohttp.ClientSession() as direct:
        proxy.cut_chunks(cut)  # a steady share of the server's answers never arrives
        print(f"flaky network: {proxy.url} -> {url}, cutting {cut:.0%} of the server's chunks")
        agents = [WorkspaceClient(proxy.url, token=token, config=config) for _ in range(2)]
        watcher = WorkspaceClient(proxy.url, token=token, config=config)
        for client in (*agents, watcher):
            await client.start()
        try:
            seeded = await agents[0].apply_ops(
                workspace,
                JOBS,
                [
                    NodeInsert(node_id=j, parent_id="root", fields={"title": t})
                    for j, t in zip(jobs, TITLES, strict=True)
                ],
            )
            since = max(c.clock for c in seeded if not isinstance(c, Exception))
            print(f"seeded {len(jobs)} jobs in '{JOBS}' (up to clock {since})")

            seen: list[tuple[str, str, Any]] = []
            all_seen = asyncio.Event()

            async def subscriber() -> None:
                async with watcher.subscribe(workspace, JOBS, since=since) as subscription:
                    async for committed in subscription:
                        if isinstance(committed, Snapshot):  # the demo's log is never compacted
                            continue
                        for job, field, value in _cells(committed):
                            seen.append((job, field, value))
                            shown = str(value)[:24]
                            print(f"  subscriber saw @{committed.clock}: {job} {field} = {shown}")
                        if len(seen) >= cells:
                            all_seen.set()

            follow = asyncio.create_task(subscriber())
            stage_input = {"columns": COLUMNS}
            enqueued = await enqueue_evaluations(agents, workspace, jobs, stage_input)
            ids = sorted({e.request_id for e in enqueued})
            print(f"2 agents enqueued evaluate for {len(jobs)} jobs: {enqueue_summary(enqueued)}")
            with _bar(len(ids), "requests done") as bar:

                async def waited(rid: str) -> RequestOutcome:
                    outcome = await api.wait_request(agents[1], workspace, rid, timeout=120)
                    bar.update()
                    return outcome

                outcomes = await asyncio.gather(*(waited(rid) for rid in ids))
            for outcome in outcomes:
                result = outcome.result or {}
                print(
                    f"request {outcome.request_id[:14]}… {outcome.status}: job "
                    f"{result.get('job_id')} computed {result.get('computed')}"
                )
            try:
                await asyncio.wait_for(all_seen.wait(), 30)
            finally:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
        finally:
            for client in (*agents, watcher):
                await client.close()

        # The truth, read around the flaky network: the provider's counter and the server's log.
        stats = await _get_json(direct, provider_url.rsplit("/v1", 1)[0] + "/stats")
        log = await _get_json(
            direct,
            f"{url}/v1/workspaces/{workspace}/docs/{JOBS}/ops",
            params={"since": "0", "limit": "1000"},
            headers={"Authorization": f"Bearer {token}"},
        )
        writes = [
            (e["op"]["node_id"], k)
            for e in log["ops"]
            if e["op"]["type"] == "node.update"
            for k in e["op"]["set"]
            if k.startswith("eval:")
        ]
        print()
        print(f"cells (jobs x columns):       {cells}")
        print(f"provider calls:               {stats['calls']}")
        print(f"ops committed in '{JOBS}':      {log['clock']} ({len(writes)} cell writes)")
        print(f"cells the subscriber saw:     {len(seen)} ({len(set(seen))} distinct)")
        print(f"network cuts:                 {proxy.stats.cuts}")
        ok = (
            stats["calls"] == cells
            and sorted(writes) == sorted(set(writes))
            and len(writes) == cells
            and len(seen) == len(set(seen)) == cells
            and all(o.status == "done" and o.error is None for o in outcomes)
        )
        print("every cell paid once, committed once, seen once" if ok else "INVARIANT BROKEN")
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo", description=__doc__)
    parser.add_argument("--url", required=True, help="the server")
    parser.add_argument("--token", required=True)
    parser.add_argument("--provider-url", required=True, help="the fake provider's /v1 URL")
    parser.add_argument("--workspace", default="demo")
    parser.add_argument("--cut", type=float, default=0.15, help="share of server chunks cut")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    return asyncio.run(
        run(args.url, args.token, args.provider_url, args.workspace, args.cut, args.seed)
    )


if __name__ == "__main__":
    sys.exit(main())
