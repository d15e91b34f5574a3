"""`ConditionalWrites`, the part of `WorkspaceClient` that sends compare-and-set applies
(`if_clock`, docs/ops.md#conflicts), runs read-modify-write with bounded retries, and sends
applies that enqueue work with their commit (`enqueue`, docs/queue.md, "Start work with the
change that needs it").

A conditional apply is not kept in the outbox: its caller must learn whether it committed, to
re-read and try again on a conflict, and a resend after a restart would be a write nobody waits
for. It goes over HTTP at once, retried under the same op_ids on a lost connection or a 5xx like
a read (`retry_attempts` tries): a retry of a batch that committed is answered `duplicate: true`
by the server, never as a conflict, so the retries cannot apply it twice. An apply that
enqueues travels the same way, for the same reasons: a retry under the same op_ids enqueues
nothing new and is answered with the same requests (the server derives their ids from the
op_ids).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from cv_mutations import SubDocState
from cv_workspace_client._core.conflicts import ConflictRetryPolicy, conflict_delays
from cv_workspace_client._core.wire import dumps_body, parse_results
from cv_workspace_client._io.http import HttpApi
from cv_workspace_client._io.pump import OpLike, as_op
from cv_workspace_client._io.reads import Reads, check_ids
from cv_workspace_client._io.retry import retrying
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    OpRejectedError,
    ProtocolError,
    VersionConflictError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit
from cv_workspace_client.queue_models import AppliedAndEnqueued, EnqueuedRequest, EnqueueItem

__all__ = ["Change", "ConditionalWrites"]

#: What `read_modify_write` calls with the state it read: the ops to apply to it (or an
#: awaitable of them).
Change = Callable[[SubDocState], Sequence[OpLike] | Awaitable[Sequence[OpLike]]]


class ConditionalWrites:
    """Compare-and-set applies over the `HttpApi` that `api()` gives, retried under `config`."""

    def __init__(
        self,
        config: ClientConfig,
        api: Callable[[], HttpApi],
        reads: Reads,
        mint: Callable[[], str],
    ) -> None:
        self.config = config
        self._api = api
        self._reads = reads
        self._mint = mint

    async def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[OpLike],
        *,
        atomic: bool,
        if_clock: int,
        fresh_ids: bool = False,
    ) -> list[Commit | OpRejectedError]:
        """Send `ops` as one request based on `if_clock`; one outcome each.

        Raises `VersionConflictError` (the sub-doc is at another clock: nothing applied), the
        final 4xx errors, or the last retryable error after `retry_attempts` tries (then the
        ops' fate is unknown: sending the same ops, same op_ids, again tells it).
        """
        results, _ = await self.send(
            workspace_id, sub_doc, ops, atomic=atomic, if_clock=if_clock, fresh_ids=fresh_ids
        )
        return results

    async def apply_and_enqueue(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[OpLike],
        enqueue: Sequence[EnqueueItem],
        *,
        atomic: bool,
        if_clock: int | None,
    ) -> AppliedAndEnqueued:
        """Send `ops` with `enqueue` as one request: the server commits the requests with the
        ops, only if the batch applies an op. Raises as `apply`."""
        items = list(enqueue)
        if not items:
            raise ValueError("enqueue must name at least one request")
        results, answer = await self.send(
            workspace_id,
            sub_doc,
            ops,
            atomic=atomic,
            if_clock=if_clock,
            enqueue=[item.to_body() for item in items],
        )
        enqueued = answer.get("enqueued") if answer is not None else None
        if not isinstance(enqueued, list) or len(enqueued) != len(items):
            raise ProtocolError("bad_answer", "an apply answer without one answer per item")
        return AppliedAndEnqueued(results, [_enqueued(one) for one in enqueued])

    async def send(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[OpLike],
        *,
        atomic: bool,
        if_clock: int | None,
        fresh_ids: bool = False,
        enqueue: list[dict[str, Any]] | None = None,
    ) -> tuple[list[Commit | OpRejectedError], dict[str, Any] | None]:
        """One apply over HTTP, retried under the same op_ids: the outcomes, and the whole
        answer (None for an empty batch, which is not sent)."""
        check_ids(workspace_id, sub_doc)
        if if_clock is not None and (
            isinstance(if_clock, bool) or not isinstance(if_clock, int) or if_clock < 0
        ):
            raise ValueError("if_clock must be an integer clock >= 0")
        raws: list[dict[str, Any]] = []
        for op in ops:
            raw = as_op(op).model_dump(mode="json", exclude_none=True)
            if fresh_ids or "op_id" not in raw:
                raw["op_id"] = self._mint()
            raws.append(raw)
        if not raws:
            return [], None
        members: dict[str, Any] = {"ops": raws, "atomic": atomic}
        if if_clock is not None:
            members["if_clock"] = if_clock
        if enqueue is not None:
            members["enqueue"] = enqueue
        body = dumps_body(members)
        http = self._api()
        op_ids = [raw["op_id"] for raw in raws]
        outcomes: list[Commit | WorkspaceError] | WorkspaceError | None = None
        answer: dict[str, Any] = {}
        async for attempt in retrying(self.config):
            with attempt:
                answer = await http.post_apply(workspace_id, sub_doc, body)
                outcomes = parse_results(op_ids, answer["results"])
                if isinstance(outcomes, WorkspaceError):
                    raise outcomes
        assert isinstance(outcomes, list)
        results: list[Commit | OpRejectedError] = []
        for outcome in outcomes:
            if isinstance(outcome, VersionConflictError):
                raise outcome  # a server would answer 409; the same failure either way
            if isinstance(outcome, Commit | OpRejectedError):
                results.append(outcome)
            else:
                raise outcome
        return results, answer

    async def read_modify_write(
        self,
        workspace_id: str,
        sub_doc: str,
        change: Change,
        *,
        atomic: bool = True,
        policy: ConflictRetryPolicy | None = None,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> list[Commit | OpRejectedError]:
        """Read the sub-doc, `change(state)` → ops, apply them based on the clock read; on a
        conflict wait (`policy`) and start over, with new op_ids. Raises the last
        `VersionConflictError` once the policy's retries are spent."""
        delays = conflict_delays(policy or self.config.conflict_retry, uniform)
        while True:
            clock, state = await self._reads.get_state(workspace_id, sub_doc)
            made = change(state)
            ops = await made if inspect.isawaitable(made) else made
            try:
                return await self.apply(
                    workspace_id, sub_doc, ops, atomic=atomic, if_clock=clock, fresh_ids=True
                )
            except VersionConflictError:
                delay = next(delays, None)
                if delay is None:
                    raise
            await self.config.sleep(delay)


def _enqueued(answer: Any) -> EnqueuedRequest | None:
    """One item's answer of an apply that enqueues (None: not enqueued, `status: null`)."""
    try:
        if answer["status"] is None:
            return None
        return EnqueuedRequest(
            request_id=str(answer["request_id"]),
            status=answer["status"],
            coalesced=bool(answer["coalesced"]),
            stream_url=str(answer["stream_url"]),
            input_differs=bool(answer.get("input_differs", False)),
        )
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"enqueue answer: {exc!r}") from None
