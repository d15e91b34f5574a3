"""What a stage handler sees (docs/stages.md): the claimed request, a context to write through, and
the two exceptions that steer the worker.

```python
async def evaluate(ctx: StageContext) -> dict[str, Any]:
    if "cols" not in ctx.input:
        raise ExpectedError("bad_input", "cols is required")   # an answer: never retried
    await ctx.apply_op("tree", NodeIncrement(node_id=ctx.job_id, field="runs"), key="count")
    return {"ok": True}                                        # the JSON result

STAGES = {"evaluate": Stage(evaluate, ttl=None)}
```

A stage is at-least-once (docs/stages.md): it may run again after a crash, a lapsed lease or an
unexpected error. Its writes stay exactly-once because `apply_op` derives each op_id from
`(request_id, run, key)`: the re-driven attempt writes the same op_ids and the server dedupes them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cv_mutations import Op
from cv_workspace_client._queue.holder import stage_write
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.compute import ComputeResult, compute_once
from cv_workspace_client.errors import (
    AuthError,
    ExpectedError,
    ForbiddenError,
    InvalidRequestError,
    LeaseLostError,
    NotFoundError,
    OpRejectedError,
    RequestCancelledError,
)
from cv_workspace_client.models import Commit
from cv_workspace_client.providers import Provider

__all__ = [
    "ExpectedError",
    "Handler",
    "LeaseLostError",
    "RequestCancelledError",
    "Stage",
    "StageContext",
    "StageRequest",
    "op_id_for",
]

_log = logging.getLogger("cv_workspace_client.stage")

T = TypeVar("T")

#: Bytes of sha256 kept in a derived op_id: 24 bytes = 32 base64url chars, inside the op_id
#: alphabet `[A-Za-z0-9_-]{8,64}` and far from any collision.
_OP_ID_BYTES = 24
#: Version of the op_id recipe; changing the recipe would make a re-driven stage write anew.
_OP_ID_RECIPE = "cv-stage-op/v1"


@dataclass(frozen=True, slots=True)
class StageRequest:
    """The claimed request, as the handler sees it (no claim token: that stays with the worker)."""

    request_id: str
    workspace_id: str
    stage: str
    job_id: str | None
    branch_path: str | None
    input: Any
    run: int
    dequeue_count: int
    created_at: float
    claimed_at: float | None
    #: The grant of the token that enqueued the request (`{"scopes", "sub_docs"}`), or None for
    #: a token with every scope and sub-doc: the stage's writes stay inside it (docs/stages.md).
    enqueue_grant: Mapping[str, Any] | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StageRequest:
        """Build it from a request row as the queue routes send it. Raises `KeyError`/`TypeError`
        on a row of the wrong shape."""
        claimed_at = row.get("claimed_at")
        return cls(
            request_id=str(row["request_id"]),
            workspace_id=str(row["workspace_id"]),
            stage=str(row["stage"]),
            job_id=row.get("job_id"),
            branch_path=row.get("branch_path"),
            input=row.get("input"),
            run=int(row["run"]),
            dequeue_count=int(row["dequeue_count"]),
            created_at=float(row["created_at"]),
            claimed_at=None if claimed_at is None else float(claimed_at),
            enqueue_grant=_grant(row.get("enqueue_grant")),
        )

    @property
    def scope_key(self) -> str | None:
        """A short key naming `enqueue_grant` (None for the full grant): compute-lock keys carry
        it, so work done for one grant is never shared with another."""
        if self.enqueue_grant is None:
            return None
        canonical = json.dumps(dict(self.enqueue_grant), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _grant(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"enqueue_grant must be an object or null, not {value!r}")
    return value


Handler = Callable[["StageContext"], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Stage:
    """A handler and how the worker runs it.

    `ttl`: seconds an identical request (same workspace, stage, job, branch and input) is answered
    from this worker's cache with `cache: "hit"` (docs/queue.md: only for stages whose answers may
    be a little stale; None = always fresh). `worker_class`: the queue class the worker claims for
    it; defaults to the stage name.
    """

    handler: Handler
    ttl: float | None = None
    worker_class: str | None = None

    def __post_init__(self) -> None:
        if self.ttl is not None and not self.ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds or None: {self.ttl!r}")


def op_id_for(request_id: str, run: int, key: str) -> str:
    """The op_id a stage write gets: base64url(sha256(recipe, request_id, run, key))[:32].

    The same for every attempt of one run (a re-driven stage's writes dedupe on the server), new
    for a deliberate rerun (run + 1). JSON array framing keeps fields from bleeding together.
    """
    material = json.dumps([_OP_ID_RECIPE, request_id, run, key], separators=(",", ":"))
    digest = hashlib.sha256(material.encode("utf-8")).digest()[:_OP_ID_BYTES]
    return base64.urlsafe_b64encode(digest).decode("ascii")


#: Errors that are the server's final word on a write (it was not applied, and a retry of the same
#: op gets the same answer): a handler may catch these and go on.
_FINAL_ANSWERS = (OpRejectedError, InvalidRequestError, AuthError, ForbiddenError, NotFoundError)


class LeaseState:
    """Whether the worker still holds the request (`lost`), and whether someone cancelled it
    (`cancelled`); the worker's heartbeat flips one of them, once."""

    __slots__ = ("cancelled", "lost")

    def __init__(self) -> None:
        self.lost = False
        self.cancelled = False


class StageContext:
    """The handler's view of one claimed request: its fields, and the ways to act on it.

    Build one per run (the worker does). `client` is the worker's `WorkspaceClient`, `provider`
    the expensive call (None when the worker was started without one).
    """

    def __init__(
        self,
        request: StageRequest,
        client: WorkspaceClient,
        *,
        provider: Provider | None = None,
        worker_id: str,
        lease: LeaseState | None = None,
        claim_token: str | None = None,
    ) -> None:
        self.request = request
        #: The worker's claim on the request: with it, the writes of a request enqueued under a
        #: limited grant go through the route that holds them to that grant (`apply_op`).
        self._claim_token = claim_token
        self.client = client
        self.provider = provider
        self.worker_id = worker_id
        self._lease = lease or LeaseState()
        self._writes = 0
        self._settled = asyncio.Event()
        self._settled.set()
        #: The first write of this run that ended without the server's final answer (its retries
        #: ran out, the client closed, the outbox failed): it may still commit later, or never.
        self._unsettled: BaseException | None = None
        #: The writes the server refused for good, by the refusal raised to the handler: the
        #: worker names the op when such a refusal ends the run (`refused_write`).
        self._refused: list[tuple[BaseException, dict[str, Any]]] = []

    @property
    def input(self) -> Any:
        return self.request.input

    @property
    def workspace_id(self) -> str:
        return self.request.workspace_id

    @property
    def job_id(self) -> str | None:
        return self.request.job_id

    @property
    def branch_path(self) -> str | None:
        return self.request.branch_path

    @property
    def stage(self) -> str:
        return self.request.stage

    @property
    def lease_lost(self) -> bool:
        return self._lease.lost

    def op_id_for(self, key: str) -> str:
        """The deterministic op_id of this run's write named `key` (see `op_id_for`)."""
        return op_id_for(self.request.request_id, self.request.run, key)

    @property
    def cancelled(self) -> bool:
        """True once the worker's heartbeat learned that someone cancelled the request."""
        return self._lease.cancelled

    def ensure_lease(self) -> None:
        """Raise `LeaseLostError` once the worker's heartbeat found its claim gone, or
        `RequestCancelledError` once it learned the request was cancelled. Call it before any
        side effect that `apply_op` does not cover."""
        if self._lease.lost:
            raise LeaseLostError()
        if self._lease.cancelled:
            raise RequestCancelledError()

    async def apply_op(self, sub_doc: str, op: Op, *, key: str) -> Commit:
        """Write `op` to `sub_doc` of this request's workspace under the op_id derived from
        `key`; return once the server committed it (a re-driven run gets `duplicate=True`).

        Use one distinct `key` per write of the stage. Raises `LeaseLostError` if the lease is
        gone, `RequestCancelledError` if the request was cancelled, and whatever
        `WorkspaceClient.apply_op` raises.
        """
        self.ensure_lease()
        derived = op.model_copy(update={"op_id": self.op_id_for(key)})
        self._writes += 1
        self._settled.clear()
        try:
            commit = await self._write(sub_doc, derived)
            _log.info(
                "wrote %s to %s at clock %s",
                derived.op_id,
                sub_doc,
                commit.clock,
                extra={
                    "event": "stage_write",
                    "op_id": derived.op_id,
                    "sub_doc": sub_doc,
                    "clock": commit.clock,
                    "duplicate": commit.duplicate,
                },
            )
            return commit
        except BaseException as exc:
            if isinstance(exc, _FINAL_ANSWERS):
                write = {"key": key, "sub_doc": sub_doc, "type": op.type, "op_id": derived.op_id}
                self._refused.append((exc, write))
            elif self._unsettled is None:
                self._unsettled = exc
            raise
        finally:
            self._writes -= 1
            if self._writes == 0:
                self._settled.set()

    async def _write(self, sub_doc: str, op: Op) -> Commit:
        # A request enqueued under a limited grant is written through the stage-write route,
        # where the server checks the sub-doc against the grant recorded on the request (the
        # enqueuer's code, `forbidden_sub_doc`, when outside it); others through the outbox.
        # tests/worker/test_enqueue_grant.py pins both.
        if self.request.enqueue_grant is not None and self._claim_token is not None:
            return await stage_write(
                self.client,
                self.workspace_id,
                self.request.request_id,
                self._claim_token,
                sub_doc,
                op,
            )
        return await self.client.apply_op(self.workspace_id, sub_doc, op)

    def refused_write(self, exc: BaseException) -> dict[str, Any] | None:
        """The write of this run (`key`, `sub_doc`, op `type`, `op_id`) whose final refusal is
        `exc` — or the exception `exc` was raised from — or None if it is no such refusal."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            for refusal, write in self._refused:
                if refusal is current:
                    return write
            current = current.__cause__ or current.__context__
        return None

    async def writes_settled(self) -> None:
        """Return once no `apply_op` of this context is in flight, and every one of them got the
        server's answer. The worker awaits it before completing (docs/stages.md: never ack before
        the work's writes committed), so a write the handler spawned but did not await lands first.

        Raises the first write's error that was not a final answer (`StillPendingError` once its
        retries ran out, say), even if the handler caught it or never looked: the write waits in
        the outbox uncommitted, so the run fails and is re-driven, and its writes, under the
        same op_ids, dedupe with whatever the outbox resends. A rejection is an answer (the same
        op gets the same one again): it does not fail the run here.
        """
        # One turn of the loop first: a write spawned with `create_task(ctx.apply_op(...))` just
        # before the handler returned has not started yet, so it is not counted in flight yet.
        await asyncio.sleep(0)
        await self._settled.wait()
        if self._unsettled is not None:
            raise self._unsettled

    async def compute(
        self,
        job_id: str,
        task: str,
        *,
        check: Callable[[], Awaitable[T | None]],
        compute: Callable[[], Awaitable[T]],
        sub_doc: str | None = None,
        wait: float | None = None,
    ) -> ComputeResult[T]:
        """Run an expensive call at most once per `(workspace, job_id, task)` under the compute
        lock (docs/stages.md); see `cv_workspace_client.compute.compute_once`."""
        return await compute_once(
            self.client,
            self.workspace_id,
            job_id,
            task,
            check=check,
            compute=compute,
            holder=self.worker_id,
            sub_doc=sub_doc,
            wait=wait,
            lease=self.ensure_lease,
            scope_key=self.request.scope_key,
        )
