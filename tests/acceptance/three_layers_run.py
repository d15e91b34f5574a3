"""One run of the three-layers workload against live processes: seed N jobs, subscribe, enqueue
`evaluate` for every job from several SDK clients at once, wait for every request, then collect
what the provider was paid for, what the log holds and what each subscriber saw.

Shared by `test_three_layers.py` and `bench/stages.py`; the processes (server, fake provider,
workers) are the caller's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cv_mutations import NodeInsert
from cv_workspace_client import Committed, WorkspaceClient
from cv_workspace_client._queue import requester as api
from cv_workspace_client.queue_models import RequestOutcome
from cv_workspace_client.stages import JOBS

__all__ = ["WS", "RunReport", "cells_of", "columns", "job_ids", "run_evaluate"]

WS = "acc"

Cell = tuple[str, str]


def job_ids(jobs: int) -> list[str]:
    return [f"J{i:03d}" for i in range(jobs)]


def columns(count: int) -> list[dict[str, str]]:
    return [{"name": f"col{i}", "prompt": f"Rate this job on criterion {i}."} for i in range(count)]


def cells_of(committed: Committed) -> list[Cell]:
    """(job, field) of every `eval:` cell a committed op writes."""
    raw = committed.op.model_dump()
    if raw["type"] != "node.update":
        return []
    return [(raw["node_id"], key) for key in raw["set"] if key.startswith("eval:")]


@dataclass
class RunReport:
    provider_calls: int
    calls_by_prompt: dict[str, int]
    #: Every eval cell write in the log, in clock order (duplicates included).
    log_cells: list[Cell]
    #: Per subscriber, every eval cell write it was handed (duplicates included).
    seen: list[list[Cell]]
    outcomes: list[RequestOutcome]
    #: Distinct request ids per job (1 when enqueues coalesce).
    request_ids: dict[str, set[str]]
    wall_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


class _Subscriber:
    def __init__(self, client: WorkspaceClient, since: int) -> None:
        self.cells: list[Cell] = []
        self.clock = since
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._follow(client, since))

    async def _follow(self, client: WorkspaceClient, since: int) -> None:
        async with client.subscribe(WS, JOBS, since=since) as subscription:
            async for committed in subscription:
                assert isinstance(committed, Committed)  # never compacted here
                self.cells += cells_of(committed)
                async with self._changed:
                    self.clock = committed.clock
                    self._changed.notify_all()

    async def reach(self, clock: int, timeout: float) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.clock >= clock or self._task.done())
        if self._task.done():
            self._task.result()  # surface a subscription failure

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _read_log(client: WorkspaceClient) -> tuple[int, list[Committed]]:
    entries: list[Committed] = []
    while True:
        head, page = await client.read_ops(WS, JOBS, since=entries[-1].clock if entries else 0)
        entries += page
        if not page or (entries and entries[-1].clock >= head):
            return head, entries


async def _provider_stats(session: aiohttp.ClientSession, provider_url: str) -> dict[str, Any]:
    base = provider_url.rsplit("/v1", 1)[0]
    async with session.get(f"{base}/stats") as response:
        stats: dict[str, Any] = await response.json()
        return stats


async def run_evaluate(
    url: str,
    token: str,
    provider_url: str,
    *,
    jobs: int = 20,
    column_count: int = 5,
    enqueuers: int = 4,
    subscribers: int = 2,
    deterministic: bool = True,
    during: Callable[[Callable[[], Awaitable[int]]], Coroutine[Any, Any, None]] | None = None,
    timeout: float = 120.0,  # noqa: ASYNC109
) -> RunReport:
    """Run the workload; `during(provider_calls)` runs alongside it (e.g. to kill workers once
    the provider has been called enough times). `enqueuers` counts the first client too."""
    ids = job_ids(jobs)
    stage_input = {"columns": columns(column_count)}
    async with AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        clients = [
            await stack.enter_async_context(WorkspaceClient(url, token=token))
            for _ in range(enqueuers + subscribers)
        ]
        admin, extra, watchers = clients[0], clients[1:enqueuers], clients[enqueuers:]
        commits = await admin.apply_ops(
            WS,
            JOBS,
            [NodeInsert(node_id=j, parent_id="root", fields={"title": f"Job {j}"}) for j in ids],
        )
        seeded = 0
        for commit in commits:
            if isinstance(commit, Exception):
                raise commit
            seeded = max(seeded, commit.clock)
        subs = [_Subscriber(c, seeded) for c in watchers]
        stack.push_async_callback(asyncio.gather, *(s.close() for s in subs))

        async def calls() -> int:
            return int((await _provider_stats(session, provider_url))["calls"])

        started = time.perf_counter()

        async def enqueue(n: int, client: WorkspaceClient, job: str) -> str:
            body: dict[str, Any] = {"stage": "evaluate", "job_id": job, "input": stage_input}
            key = None
            if not deterministic:
                body["deterministic"] = False
                key = f"enqueuer{n}-{job}"
            return (await api.enqueue(client, WS, body, idempotency_key=key)).request_id

        # Every client enqueues every job at once, the 1 + 3 copies of a job side by side: the
        # "N tabs claiming adjacent stage rows".
        senders = list(enumerate([admin, *extra]))
        enqueued = await asyncio.gather(*(enqueue(n, c, j) for j in ids for n, c in senders))
        request_ids: dict[str, set[str]] = {j: set() for j in ids}
        for index, request_id in enumerate(enqueued):
            request_ids[ids[index // len(senders)]].add(request_id)
        side = asyncio.create_task(during(calls)) if during is not None else None
        async with asyncio.timeout(timeout):
            outcomes = await asyncio.gather(
                *(
                    api.wait_request(admin, WS, rid, timeout=timeout)
                    for rid in sorted(set(enqueued))
                )
            )
        wall = time.perf_counter() - started
        if side is not None:
            await side
        head, log = await _read_log(admin)
        for sub in subs:
            await sub.reach(head, timeout=30)
        stats = await _provider_stats(session, provider_url)
    return RunReport(
        provider_calls=int(stats["calls"]),
        calls_by_prompt={str(k): int(v) for k, v in stats["by_prompt"].items()},
        log_cells=[cell for entry in log for cell in cells_of(entry)],
        seen=[sub.cells for sub in subs],
        outcomes=list(outcomes),
        request_ids=request_ids,
        wall_seconds=wall,
    )
