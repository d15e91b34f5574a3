"""`ConditionalWrites`, the part of `WorkspaceClient` that sends compare-and-set applies
(`if_clock`, docs/ops.md#conflicts) and runs read-modify-write with bounded retries.

A conditional apply is not kept in the outbox: its caller must learn whether it committed, to
re-read and try again on a conflict, and a resend after a restart would be a write nobody waits
for. It goes over HTTP at once, retried under the same op_ids on a lost connection or a 5xx like
a read (`retry_attempts` tries): a retry of a batch that committed is answered `duplicate: true`
by the server, never as a conflict, so the retries cannot apply it twice.
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
from cv_workspace_client.errors import OpRejectedError, VersionConflictError, WorkspaceError
from cv_workspace_client.models import Commit

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
        check_ids(workspace_id, sub_doc)
        if isinstance(if_clock, bool) or not isinstance(if_clock, int) or if_clock < 0:
            raise ValueError("if_clock must be an integer clock >= 0")
        raws: list[dict[str, Any]] = []
        for op in ops:
            raw = as_op(op).model_dump(mode="json", exclude_none=True)
            if fresh_ids or "op_id" not in raw:
                raw["op_id"] = self._mint()
            raws.append(raw)
        if not raws:
            return []
        body = dumps_body({"ops": raws, "atomic": atomic, "if_clock": if_clock})
        http = self._api()
        op_ids = [raw["op_id"] for raw in raws]
        outcomes: list[Commit | WorkspaceError] | WorkspaceError | None = None
        async for attempt in retrying(self.config):
            with attempt:
                outcomes = parse_results(op_ids, await http.post_ops(workspace_id, sub_doc, body))
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
        return results

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
