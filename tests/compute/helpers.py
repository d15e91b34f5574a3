"""Helpers for the compute-lock tests: tokens, a provider whose calls wait at a gate, a request
log of the real server, and a stage context built the way a worker builds one."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from cv_server.auth import mint_token
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.providers import ProviderResult, fake_answer
from cv_workspace_client.stage import StageContext, StageRequest

SECRET = b"compute-test-secret-0123456789abcdef"
WS = "ws1"


def token_for(*workspaces: str) -> str:
    return mint_token(SECRET, list(workspaces), now=time.time())


def fast_config(**overrides: Any) -> ClientConfig:
    """DESIGN §10's retry policy, shrunk from seconds to milliseconds for tests."""
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
