"""Helpers for the compute-lock tests: tokens, a provider whose calls wait at a gate, a request
log of the real server, a stage context built the way a worker builds one, and the one cell
(`FIELD` of `JOB` in the `JOBS` sub-doc) that the compute tests race for."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import JsonValue

from cv_mutations import NodeInsert, NodeUpdate
from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.compute import (
    LOCK_MARGIN_FRACTION,
    ComputeResult,
    LockPolling,
    compute_once,
)
from cv_workspace_client.providers import Provider, ProviderResult, fake_answer
from cv_workspace_client.stage import StageContext, StageRequest
from cv_workspace_client.stages import JOBS as JOBS  # re-exported: the cell's sub-doc
from tests.clocks import SkippingClock

SECRET = b"compute-test-secret-0123456789abcdef"
WS = "ws1"
JOB = "job1"
FIELD = "eval:fit"
#: The server's compute-lock TTL (60 s): the tests keep it, and skip a server's lock clock
#: (`lock_clock`) by it to lapse a lock at the moment they choose.
LOCK_TTL = ServerConfig().compute_lock_ttl_seconds

Check = Callable[[], Awaitable[JsonValue | None]]
Compute = Callable[[], Awaitable[JsonValue]]


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces), now=time.time())


def fast_config(**overrides: Any) -> ClientConfig:
    """The default retry policy, shrunk from seconds to milliseconds for tests."""
    values: dict[str, Any] = {"retry_base_seconds": 0.005, "retry_cap_seconds": 0.05}
    values.update(overrides)
    return ClientConfig(**values)


class Watched:
    """A counter that tasks can wait on: `await watched.reach(n)` returns once it is >= n."""

    def __init__(self) -> None:
        self.value = 0
        self._changed = asyncio.Condition()

    async def add(self, n: int = 1) -> None:
        async with self._changed:
            self.value += n
            self._changed.notify_all()

    async def reach(self, n: int, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.value >= n)


class SlowCellWrites:
    """A server that holds the first write of the cell (`FIELD`) until `let_go` is set (`held`
    says it arrived) and records each lock acquisition's answer (`granted`, in order, counted
    by `acquisitions`): a compute paid for whose write is on its way and not yet committed."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.let_go = asyncio.Event()
        self.acquisitions = Watched()
        self.granted: list[bool] = []

    @web.middleware
    async def middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        writing_the_cell = request.path.endswith("/docs/jobs/ops") and not self.held.is_set()
        if writing_the_cell and FIELD.encode() in await request.read():
            self.held.set()
            await self.let_go.wait()
        response = await handler(request)
        if request.path.endswith("/locks/acquire") and isinstance(response, web.Response):
            self.granted.append('"acquired": true' in (response.text or ""))
            await self.acquisitions.add()
        return response

    async def serve(self, aiohttp_server: Any, db_path: Path) -> str:
        """Start the server (SQLite at `db_path`, the real 60 s lock TTL: no lock lapses within
        a test unless someone hands it back); its URL."""
        app = create_app(ServerConfig(db_path=db_path, token_secret=SECRET))
        app.middlewares.insert(0, self.middleware)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")


class GatedProvider:
    """A `Provider` whose calls count on arrival and then wait until their gate opens: `gate`
    for every prompt, or `open(prompt)` for one.

    With the gates held shut, the test decides how far racing callers get before any answer
    exists: that turns a race into a fixed interleaving.
    """

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.arrived = Watched()
        self.by_prompt: Counter[str] = Counter()
        self._arrived_for: dict[str, Watched] = {}
        self._gates: dict[str, asyncio.Event] = {}

    @property
    def calls(self) -> int:
        return self.arrived.value

    def arrived_for(self, prompt: str) -> Watched:
        return self._arrived_for.setdefault(prompt, Watched())

    def open(self, prompt: str) -> None:
        self._gates.setdefault(prompt, asyncio.Event()).set()

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        self.by_prompt[prompt] += 1
        await self.arrived.add()
        await self.arrived_for(prompt).add()
        own = self._gates.setdefault(prompt, asyncio.Event())
        waiters = [asyncio.ensure_future(self.gate.wait()), asyncio.ensure_future(own.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        text = fake_answer(prompt)
        return ProviderResult(text=text, raw={"choices": [{"message": {"content": text}}]})


class RequestLog:
    """Every request the real server answered: (method, path, status), and which compute locks
    were answered `locked`. Installed as the app's outermost middleware, so it sees the routes
    exactly as clients hit them."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []
        self.answered = Watched()
        #: (workspace path, job_id, task) of every acquisition answered `locked`.
        self.locked: list[tuple[str, str, str]] = []

    def count(self, suffix: str) -> int:
        return sum(1 for _, path, _ in self.entries if path.endswith(suffix))

    def locked_tasks(self, job_id: str) -> set[str]:
        return {task for _, job, task in self.locked if job == job_id}

    async def wait_for(self, predicate: Callable[[RequestLog], bool], timeout: float = 10) -> None:  # noqa: ASYNC109
        """Wait (bounded) until `predicate(self)` holds after some answered request."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self.answered.reach(self.answered.value + 1, timeout=timeout)

    async def wait_locked(self, job_id: str, task: str, timeout: float = 10) -> None:  # noqa: ASYNC109
        """Wait (bounded) until an acquisition of `job_id`/`task` was answered `locked`."""
        await self.wait_for(lambda log: task in log.locked_tasks(job_id), timeout)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        if request.path.endswith("/locks/acquire") and isinstance(response, web.Response):
            body, answer = await request.json(), json.loads(response.text or "{}")
            if answer.get("locked"):
                self.locked.append((request.path, body["job_id"], body["task"]))
        self.entries.append((request.method, request.path, response.status))
        await self.answered.add()
        return response


def stage_context(
    client: WorkspaceClient,
    *,
    request_id: str = "d_" + "0" * 40,
    stage: str = "evaluate",
    job_id: str | None = "job1",
    input: Any = None,
    run: int = 1,
    provider: Any = None,
    worker_id: str = "w-test",
    workspace_id: str = WS,
) -> StageContext:
    """The context a worker would hand the handler for a claimed request."""
    request = StageRequest(
        request_id=request_id,
        workspace_id=workspace_id,
        stage=stage,
        job_id=job_id,
        branch_path=None,
        input=input,
        run=run,
        dequeue_count=1,
        created_at=time.time(),
        claimed_at=time.time(),
    )
    return StageContext(request, client, provider=provider, worker_id=worker_id)


# -- the cell: `FIELD` of `JOB` in `WS`'s `JOBS` sub-doc -------------------------------------------


async def seed_job(client: WorkspaceClient, **fields: JsonValue) -> None:
    """Insert the `JOB` node (with `fields`) that the cell lives on."""
    await client.apply_op(WS, JOBS, NodeInsert(node_id=JOB, parent_id="root", fields=fields))


def cell(
    client: WorkspaceClient, provider: Provider, *, prompt: str = f"{JOB}/{FIELD}"
) -> tuple[Check, Compute]:
    """The check and compute of the cell, as a stage writes them: the compute pays for one
    provider call for `prompt` and writes its answer."""

    async def check() -> JsonValue | None:
        _, state = await client.get_state(WS, JOBS)
        node = state.nodes.get(JOB)
        return None if node is None else node.fields.get(FIELD)

    async def compute() -> JsonValue:
        answer = await provider.complete(prompt)
        await client.apply_op(WS, JOBS, NodeUpdate(node_id=JOB, set={FIELD: answer.text}))
        return answer.text

    return check, compute


async def compute_or_wait(
    client: WorkspaceClient,
    provider: Provider,
    holder: str,
    *,
    wait: float,
    polling: LockPolling,
    prompt: str = f"{JOB}/{FIELD}",
    check: Check | None = None,
    compute: Compute | None = None,
) -> ComputeResult[JsonValue]:
    """`compute_once` of the cell for `holder`, waiting up to `wait` s when the lock is held: on
    the value's broadcast, polling the lock to take it over if the holder goes away. `check` and
    `compute` default to `cell`'s."""
    cell_check, cell_compute = cell(client, provider, prompt=prompt)
    return await compute_once(
        client,
        WS,
        JOB,
        FIELD,
        check=cell_check if check is None else check,
        compute=cell_compute if compute is None else compute,
        holder=holder,
        sub_doc=JOBS,
        wait=wait,
        polling=polling,
    )


def stalled_after_acquiring(check: Check, clock: SkippingClock, budget: float = 0.5) -> Check:
    """`check`, whose second call (the double-check, inside the lock) first skips `clock` ahead
    until `budget` seconds of the compute's budget are left: the holder that times its compute
    on `clock` (`compute_once(now=clock.now)`) was paused that long between its acquisition and
    its compute. Its budget runs out `budget` seconds of real time later, while the server's lock
    still has most of its TTL: no one can take the key over unless the holder hands it back."""
    calls = 0

    async def stalled() -> JsonValue | None:
        nonlocal calls
        calls += 1
        if calls == 2:
            clock.skip(LOCK_TTL * (1 - LOCK_MARGIN_FRACTION) - budget)
        return await check()

    return stalled


def timed(compute: Compute, started: list[float]) -> Compute:
    """`compute`, noting in `started` the wall-clock time each call begins (when it pays)."""

    async def timed_compute() -> JsonValue:
        started.append(time.time())
        return await compute()

    return timed_compute


async def eval_writes(client: WorkspaceClient, workspace: str = WS) -> list[tuple[str, str]]:
    """(job, field) of every committed `eval:` write in the log, duplicates included."""
    _, entries = await client.read_ops(workspace, JOBS, since=0, limit=1000)
    writes = []
    for entry in entries:
        raw = entry.op.model_dump()
        if raw["type"] == "node.update":
            writes += [(raw["node_id"], k) for k in raw["set"] if k.startswith("eval:")]
    return writes


async def cell_writes(client: WorkspaceClient) -> int:
    """How many committed ops set `FIELD` (a double write shows as 2)."""
    return [field for _, field in await eval_writes(client)].count(FIELD)


# -- a holder process that dies mid-call -----------------------------------------------------------

HOLDER_SCRIPT = """
import asyncio, sys
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.compute import compute_once

async def main(url, token):
    async with WorkspaceClient(url, token=token) as client:
        async def check():
            return None
        async def compute():
            print("calling", flush=True)  # the provider call is paid from here on
            await asyncio.Event().wait()  # a provider that has not answered yet
        await compute_once(client, "ws1", "job1", "eval:fit", check=check, compute=compute,
                           holder="doomed")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@asynccontextmanager
async def holder_process(url: str, tmp_path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A worker process that takes the cell's lock and hangs in its provider call (it prints
    `calling` once it is paid); SIGKILLed on exit, so its lock is never released."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER_SCRIPT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        url,
        token_for(WS),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
