"""The MCP server over the SDK: `cv-workspace mcp` (docs/mcp.md).

Agents get the workspace's reads, its writes and the work queue as MCP tools, and each sub-doc's
state as a resource (`cv://{workspace_id}/docs/{sub_doc}`) that notifies its subscribers when an
op is committed to it. Everything goes through one `WorkspaceClient` for the process lifetime,
so the SDK's rules hold for agents too: an op gets its op_id before it is first sent and keeps it
across retries (with `--outbox`, across restarts of this server too), reads and idempotent calls
are retried with the SDK's backoff, and a refusal is final.

Needs the `mcp` extra (`pip install 'cv-workspace[mcp]'`); `import cv_workspace_client` never
imports this module.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from mcp.server import MCPServer
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolResult,
    EmptyResult,
    InputRequiredResult,
    SubscribeRequestParams,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
    ToolAnnotations,
    UnsubscribeRequestParams,
)
from pydantic import Field, JsonValue, ValidationError

from cv_mutations import Op
from cv_workspace_client._queue.requester import get_blob
from cv_workspace_client._version import package_version
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.errors import OpRejectedError, ProtocolError, WorkspaceError
from cv_workspace_client.mcp_server.access import hidden_tools_note, token_scopes, tool_allowed
from cv_workspace_client.mcp_server.answers import (
    ApplyAnswer,
    CommittedOp,
    EnqueueAnswer,
    EnqueueSpec,
    ListAnswer,
    OpOutcome,
    OpsAnswer,
    RequestAnswer,
    StateAnswer,
    WaitAnswer,
    arguments_error,
    tool_error,
    workspace_error,
)
from cv_workspace_client.mcp_server.feeds import DOC_URI, ResourceFeeds, parse_doc_uri
from cv_workspace_client.mcp_server.schedule_tools import (
    SCHEDULE_ANNOTATIONS,
    SCHEDULE_TOOL_NAMES,
    ScheduleTools,
)
from cv_workspace_client.mcp_server.transports import (
    DRAIN_SECONDS,
    ListenFailed,
    run_http,
    run_stdio,
)
from cv_workspace_client.queue_models import EnqueueItem, QueuedRequest

__all__ = [
    "DRAIN_SECONDS",
    "MAX_WAIT_SECONDS",
    "TOOL_NAMES",
    "ListenFailed",
    "build_server",
    "serve_http",
    "serve_stdio",
]


_log = logging.getLogger(__name__)

#: The tools, by name: part of the contract (docs/mcp.md).
TOOL_NAMES = (
    "get_state",
    "read_ops",
    "apply_ops",
    "enqueue",
    "get_request",
    "wait_request",
    "list_requests",
    "cancel_request",
    "replay_request",
    "discard_request",
    *SCHEDULE_TOOL_NAMES,
)

#: The longest one `wait_request` call may wait. Agent hosts cut a tool call that runs for
#: minutes (their request timeouts are in that range), and the queue's own waiter deadline is
#: 60 s (the default here); a longer wait is several calls, which is safe: a wait's end never
#: ends the work.
MAX_WAIT_SECONDS = 600.0
_DEFAULT_WAIT_SECONDS = 60.0
#: The server's own page bound (the list route's, and the op log's default `catchup_page`): the
#: server answers at most that many rows a call.
_MAX_LIST = 1000

_READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
#: What a host may assume of each tool (hints: a host may run read-only ones without asking).
#: `cancel_request` and `replay_request` are idempotent: repeated, they answer the row as it
#: stands (or refuse the transition) and change nothing more. `apply_ops` is only when its ops
#: carry op_ids, and `enqueue` only with a `job_id` or an `idempotency_key`: not hinted.
_ANNOTATIONS: dict[str, ToolAnnotations] = {
    **dict.fromkeys(
        ("get_state", "read_ops", "get_request", "wait_request", "list_requests"), _READ_ONLY
    ),
    "apply_ops": ToolAnnotations(destructive_hint=True, open_world_hint=False),
    "enqueue": ToolAnnotations(destructive_hint=False, open_world_hint=False),
    "cancel_request": ToolAnnotations(
        destructive_hint=True, idempotent_hint=True, open_world_hint=False
    ),
    "replay_request": ToolAnnotations(
        destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
    # Deletes the row: a second call answers not_found, so not idempotent in its answer.
    "discard_request": ToolAnnotations(
        destructive_hint=True, idempotent_hint=False, open_world_hint=False
    ),
    **SCHEDULE_ANNOTATIONS,
}

WorkspaceId = Annotated[str, Field(description="the workspace's id")]
SubDoc = Annotated[str, Field(description="the sub-doc's name (e.g. `jobs`, `tree`)")]
RequestId = Annotated[str, Field(description="the request's id (`enqueue` answers it)")]


class _Server(MCPServer[None]):
    """`MCPServer` whose tool failures are tool errors with the server's problem code: a tool
    raises `WorkspaceError` (the SDK's typed error, carrying the code) and this turns it, and
    arguments that do not fit the input schema, into `isError` results. A crash is an
    `internal` tool error; its traceback goes to the log (stderr), never into the result."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[None, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, _WithOpIds):
                return workspace_error(cause.cause, op_ids=list(cause.op_ids))
            if isinstance(cause, WorkspaceError):
                return workspace_error(cause)
            if isinstance(cause, ValidationError):
                return arguments_error(name, arguments, cause)
            if cause is None and name not in TOOL_NAMES:
                return tool_error("unknown_tool", f"no tool {name!r}: the tools are {TOOL_NAMES}")
            if cause is None:  # the SDK's own refusal of the call
                return tool_error("invalid_arguments", str(exc))
            _log.error("tool %s failed", name, exc_info=cause)
            return tool_error("internal", f"{name} failed unexpectedly; see the MCP server's log")


@dataclass(frozen=True, slots=True)
class _Tools(ScheduleTools):
    """The tools' bodies (the schedules' in `ScheduleTools`), over one client. Each raises
    `WorkspaceError` on a failure."""

    client: WorkspaceClient

    async def get_state(self, workspace_id: WorkspaceId, sub_doc: SubDoc) -> StateAnswer:
        """The sub-doc's head clock and state."""
        clock, state = await self.client.get_state(workspace_id, sub_doc)
        return StateAnswer(
            workspace_id=workspace_id,
            sub_doc=sub_doc,
            clock=clock,
            state=state.to_json(),
        )

    async def read_ops(
        self,
        workspace_id: WorkspaceId,
        sub_doc: SubDoc,
        since: Annotated[int, Field(ge=0, description="answer the ops committed after it")] = 0,
        limit: Annotated[int | None, Field(ge=1, le=_MAX_LIST, description="at most")] = None,
    ) -> OpsAnswer:
        """Committed ops of the sub-doc after clock `since`, in clock order, and the head clock.
        Page on with `since` = the last op's clock."""
        clock, ops = await self.client.read_ops(workspace_id, sub_doc, since=since, limit=limit)
        return OpsAnswer(
            workspace_id=workspace_id,
            sub_doc=sub_doc,
            clock=clock,
            ops=[
                CommittedOp(
                    clock=c.clock, op_id=c.op_id, op=c.op.model_dump(mode="json", exclude_none=True)
                )
                for c in ops
            ],
        )

    async def apply_ops(
        self,
        workspace_id: WorkspaceId,
        sub_doc: SubDoc,
        ops: Annotated[
            list[Op],
            Field(
                min_length=1,
                description="ops in order (`node.insert`, `node.update`, ...). An op without an "
                "`op_id` gets one, answered in `op_ids`: to retry, send the same ops with them. "
                "Give your own `op_id` (8-64 of A-Z a-z 0-9 _ -) to an op that must not apply "
                "twice even if this call's answer never reaches you",
            ),
        ],
        atomic: Annotated[
            bool, Field(description="all commit or none does (the others: `atomic_aborted`)")
        ] = False,
        if_clock: Annotated[
            int | None,
            Field(
                ge=0,
                description="compare-and-set: apply only if the sub-doc is still at this clock "
                "(the `clock` get_state answered); else nothing is applied and the error is "
                "`version_conflict` with the current `clock`: read again, recompute, call again "
                "with new op_ids",
            ),
        ] = None,
        enqueue: Annotated[
            list[EnqueueSpec] | None,
            Field(
                min_length=1,
                max_length=1000,
                description="stage runs to queue in the same transaction as the ops, only if "
                "they apply (docs/queue.md#start-work-with-the-change-that-needs-it); needs the "
                "`enqueue` scope. Retrying with the same op_ids enqueues nothing twice",
            ),
        ] = None,
    ) -> ApplyAnswer:
        """Apply ops to the sub-doc, in order. Each op is applied once: a call repeated with the
        `op_ids` of the first answer gets `duplicate: true`, not a second apply. A rejected op
        (`node_exists`, `node_not_found`, ...) is answered in its result with its code. With
        `if_clock`, a write computed from what you read never overwrites a change you did not
        see (docs/ops.md#conflicts)."""
        # Minted here, before anything is sent, so the answer names them whatever happens next
        # (an error answer included): the op_id is the op's identity for every retry.
        mint = self.client.mint_op_id
        minted = [op if op.op_id else op.model_copy(update={"op_id": mint()}) for op in ops]
        op_ids = [str(op.op_id) for op in minted]
        enqueued: list[EnqueueAnswer | None] | None = None
        try:
            if enqueue is None:
                outcomes = await self.client.apply_ops(
                    workspace_id, sub_doc, minted, atomic=atomic, if_clock=if_clock
                )
            else:
                done = await self.client.apply_ops_and_enqueue(
                    workspace_id,
                    sub_doc,
                    minted,
                    [
                        EnqueueItem(
                            spec.stage,
                            job_id=spec.job_id,
                            branch_path=spec.branch_path,
                            input=spec.input,
                            rerun=spec.rerun,
                        )
                        for spec in enqueue
                    ],
                    atomic=atomic,
                    if_clock=if_clock,
                )
                outcomes = done.results
                enqueued = [
                    None
                    if answer is None
                    else EnqueueAnswer(
                        request_id=answer.request_id,
                        status=answer.status,
                        coalesced=answer.coalesced,
                        input_differs=answer.input_differs,
                        replayed=False,
                    )
                    for answer in done.enqueued
                ]
        except WorkspaceError as exc:
            raise _WithOpIds(exc, op_ids) from exc
        results: list[OpOutcome] = []
        for op_id, outcome in zip(op_ids, outcomes, strict=True):
            if isinstance(outcome, OpRejectedError):
                results.append(
                    OpOutcome(
                        op_id=op_id, status="rejected", code=outcome.code, message=outcome.message
                    )
                )
            else:
                results.append(
                    OpOutcome(
                        op_id=op_id,
                        status="committed",
                        clock=outcome.clock,
                        duplicate=outcome.duplicate,
                    )
                )
        return ApplyAnswer(
            workspace_id=workspace_id,
            sub_doc=sub_doc,
            op_ids=op_ids,
            results=results,
            enqueued=enqueued,
        )

    async def enqueue(
        self,
        workspace_id: WorkspaceId,
        stage: Annotated[str, Field(description="the stage to run (e.g. `evaluate`)")],
        job_id: Annotated[
            str | None,
            Field(
                description="the job: with it the request id is deterministic, so enqueueing "
                "the same job, branch and stage again joins the same request"
            ),
        ] = None,
        branch_path: Annotated[str | None, Field(description="the branch of the job")] = None,
        input: Annotated[JsonValue, Field(description="the stage's input (JSON)")] = None,
        idempotency_key: Annotated[
            str | None,
            Field(description="makes a retried enqueue answer the first one's request"),
        ] = None,
        rerun: Annotated[bool, Field(description="run a finished request again")] = False,
        concurrency_key: Annotated[
            str | None,
            Field(description="requests sharing this key share its running slots"),
        ] = None,
        max_running_per_key: Annotated[
            int | None,
            Field(ge=1, description="start only while fewer of its key run (needs the key)"),
        ] = None,
    ) -> EnqueueAnswer:
        """Queue stage work; answers at once with the request's id (then `wait_request`)."""
        answer = await self.client.enqueue(
            workspace_id,
            stage=stage,
            job_id=job_id,
            branch_path=branch_path,
            input=input,
            idempotency_key=idempotency_key,
            rerun=rerun,
            concurrency_key=concurrency_key,
            max_running_per_key=max_running_per_key,
        )
        return EnqueueAnswer(
            request_id=answer.request_id,
            status=answer.status,
            coalesced=answer.coalesced,
            input_differs=answer.input_differs,
            replayed=answer.replayed,
        )

    async def get_request(self, workspace_id: WorkspaceId, request_id: RequestId) -> RequestAnswer:
        """The request as it stands: status, result (once done), error, attempts."""
        row = await self.client.get_request(workspace_id, request_id)
        return await self._answer(row)

    async def wait_request(
        self,
        workspace_id: WorkspaceId,
        request_id: RequestId,
        timeout_s: Annotated[
            float,
            Field(
                ge=0,
                le=MAX_WAIT_SECONDS,
                description="seconds to wait; the timeout ends the wait, never the work",
            ),
        ] = _DEFAULT_WAIT_SECONDS,
    ) -> WaitAnswer:
        """Wait until the request is done, poison or cancelled. A timeout ends only this wait:
        the request goes on, and `wait_request` or `get_request` later is safe."""
        outcome = await self.client.wait_request(workspace_id, request_id, timeout=timeout_s)
        row = outcome.request
        attempts = None if row is None else row.dequeue_count
        if outcome.status == "timeout":
            return WaitAnswer(
                request_id=request_id,
                status="timeout",
                request_status=None if row is None else row.status,
                note=f"the wait ended after {timeout_s:g} s; the request goes on: call "
                "wait_request or get_request again",
                attempts=attempts,
            )
        return WaitAnswer(
            request_id=request_id,
            status=outcome.status,
            request_status=None if row is None else row.status,
            result=outcome.result,
            error=outcome.error,
            attempts=attempts,
        )

    async def list_requests(
        self,
        workspace_id: WorkspaceId,
        status: Annotated[
            Literal["pending", "in_progress", "done", "poison", "cancelled"] | None,
            Field(description="only requests in this status"),
        ] = None,
        limit: Annotated[int, Field(ge=1, le=_MAX_LIST)] = 100,
    ) -> ListAnswer:
        """The workspace's requests, oldest first (by status)."""
        rows = await self.client.list_requests(
            status=status,
            workspace_id=workspace_id,
            limit=limit,
        )
        return ListAnswer(requests=[_json_object(row.raw) for row in rows])

    async def cancel_request(
        self, workspace_id: WorkspaceId, request_id: RequestId
    ) -> RequestAnswer:
        """Cancel a request: a pending one at once; an in-progress one is stopped at its
        holder's next heartbeat (writes already committed stay). Done and poison requests
        answer `not_cancellable`."""
        row = await self.client.cancel_request(workspace_id, request_id)
        return await self._answer(row)

    async def replay_request(
        self, workspace_id: WorkspaceId, request_id: RequestId
    ) -> RequestAnswer:
        """Put a poison request back in the queue, by hand (never automatic)."""
        row = await self.client.replay_request(workspace_id, request_id)
        return await self._answer(row)

    async def discard_request(
        self, workspace_id: WorkspaceId, request_id: RequestId
    ) -> RequestAnswer:
        """Delete a poison request for good instead of replaying it, by hand; answers the row
        as it was. Any other status answers `not_discardable`; a request already discarded,
        `not_found`."""
        row = await self.client.discard_request(workspace_id, request_id)
        return await self._answer(row)

    async def _answer(self, row: QueuedRequest) -> RequestAnswer:
        result: Any = row.result
        if row.status == "done" and row.blob_ref is not None:
            blob = await get_blob(self.client, row.workspace_id, row.blob_ref)
            try:
                result = json.loads(blob)
            except (ValueError, RecursionError) as exc:
                raise ProtocolError("bad_answer", f"blob is not JSON: {exc}") from None
        return RequestAnswer(
            request_id=row.request_id,
            workspace_id=row.workspace_id,
            stage=row.stage,
            status=row.status,
            attempts=row.dequeue_count,
            result=result,
            error=row.error,
            # The row's other members (timestamps, claimed_by, unclaimed_seconds, ...) once:
            # its result and error are the ones above.
            request={k: v for k, v in row.raw.items() if k not in ("result", "error")},
        )


class _WithOpIds(WorkspaceError):
    """An `apply_ops` failure that names the op_ids it minted, for the caller's retry."""

    def __init__(self, cause: WorkspaceError, op_ids: list[str]) -> None:
        super().__init__(cause.code, cause.message)
        self.cause = cause
        self.op_ids = op_ids


def _json_object(data: Mapping[str, Any]) -> dict[str, JsonValue]:
    return {str(key): value for key, value in data.items()}


def build_server(client: WorkspaceClient) -> tuple[MCPServer[None], ResourceFeeds]:
    """The MCP server's tools and resources over `client` (open, for the server's lifetime),
    and its resource feeds (close them when the server stops). Only the tools the client's
    token allows are offered; the instructions name the others and the scope each needs."""
    bus = InMemorySubscriptionBus()
    scopes = token_scopes(client.token)
    server = _Server(
        "cv-workspace",
        version=package_version(),
        instructions="Tools over a cv-workspace server: read and write sub-docs (ops are "
        "applied exactly once: retry apply_ops with the op_ids of its first answer), enqueue "
        "stage work and wait for its result. Resources cv://{workspace_id}/docs/{sub_doc} hold "
        "each sub-doc's state and notify subscribers when an op is committed to it."
        + hidden_tools_note(TOOL_NAMES, scopes),
        subscriptions=bus,
        log_level="WARNING",
    )
    tools = _Tools(client)
    for name in TOOL_NAMES:
        if not tool_allowed(name, scopes):
            continue  # named in the instructions (tests/mcp_server/test_tool_scopes.py)
        server.add_tool(
            getattr(tools, name),
            name=name,
            annotations=_ANNOTATIONS[name],
            structured_output=True,
        )

    @server.resource(
        DOC_URI,
        name="sub-doc",
        description="A sub-doc's head clock and state, as JSON; subscribe to be told when an "
        "op is committed to it.",
        mime_type="application/json",
    )
    async def read_doc(workspace_id: str, sub_doc: str) -> str:
        try:
            clock, state = await client.get_state(workspace_id, sub_doc)
        except WorkspaceError as exc:
            # A refusal (`forbidden_workspace`, `invalid_id`) is the caller's to fix: JSON-RPC's
            # invalid params, as the SDK answers an unknown resource; anything else is internal.
            final = ResourceNotFoundError if not exc.retryable else ResourceError
            raise final(f"{exc.code}: {exc.message}") from None
        body = {"workspace_id": workspace_id, "sub_doc": sub_doc, "clock": clock}
        return json.dumps({**body, "state": state.to_json()}, sort_keys=True)

    feeds = ResourceFeeds(client, bus)
    _serve_subscriptions(server, bus, feeds)
    return server, feeds


def _serve_subscriptions(
    server: MCPServer[None], bus: InMemorySubscriptionBus, feeds: ResourceFeeds
) -> None:
    """Start and stop the SDK subscriptions behind resource notifications: around each
    2026-07-28 listen stream, and on handshake-era `resources/subscribe` / `unsubscribe`
    (which `MCPServer` does not serve itself: registering them also advertises
    `resources.subscribe` to those clients)."""
    lowlevel = server._lowlevel_server  # the handlers' registry: no public seam for these
    listen = feeds.streams = ListenHandler(bus)

    async def on_listen(
        ctx: ServerRequestContext[Any, Any], params: SubscriptionsListenRequestParams
    ) -> SubscriptionsListenResult:
        # Acknowledged (by `listen`) once every sub-doc's feed knows its head: a commit after
        # the acknowledgment is told (test_a_committed_op_notifies_the_sub_docs_resource).
        release = await feeds.listen(list(params.notifications.resource_subscriptions or ()))
        try:
            return await listen(ctx, params)
        finally:
            release()

    async def on_subscribe(
        ctx: ServerRequestContext[Any, Any], params: SubscribeRequestParams
    ) -> EmptyResult:
        uri = str(params.uri)
        if parse_doc_uri(uri) is None:
            raise MCPError(INVALID_PARAMS, f"no resource {uri!r}: sub-docs are {DOC_URI}")
        await feeds.subscribe(ctx.session, uri)
        return EmptyResult()

    async def on_unsubscribe(
        ctx: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams
    ) -> EmptyResult:
        feeds.unsubscribe(ctx.session, str(params.uri))
        return EmptyResult()

    lowlevel.add_request_handler(
        "subscriptions/listen", SubscriptionsListenRequestParams, on_listen
    )
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, on_subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, on_unsubscribe)


async def serve_stdio(client: WorkspaceClient) -> None:
    """Serve MCP over this process's stdin/stdout until the agent host closes stdin, or the
    task is cancelled (SIGTERM)."""
    server, feeds = build_server(client)
    await run_stdio(server, feeds)


async def serve_http(
    client: WorkspaceClient, host: str, port: int, *, ready: Callable[[str], None]
) -> None:
    """Serve MCP over streamable HTTP at `http://host:port/mcp` until SIGTERM / SIGINT; `ready`
    is given that URL once the socket listens (`port` 0: a free port). `ListenFailed` when it
    cannot listen there."""
    server, feeds = build_server(client)
    await run_http(server, feeds, host, port, ready=ready)
