"""What the MCP tools answer (`cv-workspace mcp`, docs/mcp.md): the structured results, and the
one mapping from a failure to an MCP tool error. Pure: no I/O.

A tool error is a `CallToolResult` with `isError: true` whose one text content is the JSON
`{"error": {"code", "message", ...}}`, and which has no structured content: `code` is the
server's problem code (`forbidden_workspace`, `not_found`, ...) or the SDK's
(`connection_failed`, `still_pending`), never a Python exception's name, and never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel, Field, JsonValue, ValidationError

from cv_mutations import InvalidOp, parse_op
from cv_workspace_client.errors import StillPendingError, VersionConflictError, WorkspaceError

__all__ = [
    "ApplyAnswer",
    "EnqueueAnswer",
    "EnqueueSpec",
    "ListAnswer",
    "OpOutcome",
    "OpsAnswer",
    "RequestAnswer",
    "StateAnswer",
    "WaitAnswer",
    "arguments_error",
    "tool_error",
    "workspace_error",
]


class StateAnswer(BaseModel):
    """`get_state`: the sub-doc's head clock and its state (`{"nodes": {...}}`)."""

    workspace_id: str
    sub_doc: str
    clock: int
    state: dict[str, JsonValue]


class CommittedOp(BaseModel):
    clock: int
    op_id: str | None
    op: dict[str, JsonValue]


class OpsAnswer(BaseModel):
    """`read_ops`: committed ops after `since`, in clock order; `clock` is the head (when the
    last op's clock is below it, there is more: read again from there)."""

    workspace_id: str
    sub_doc: str
    clock: int
    ops: list[CommittedOp]


class OpOutcome(BaseModel):
    """One op of `apply_ops`: `committed` (at `clock`; `duplicate` when an earlier call with the
    same `op_id` had committed it) or `rejected` (with the reducer's `code`)."""

    op_id: str
    status: Literal["committed", "rejected"]
    clock: int | None = None
    duplicate: bool | None = None
    code: str | None = None
    message: str | None = None


class EnqueueSpec(BaseModel):
    """One stage run `apply_ops` queues with its commit (`enqueue`)."""

    stage: str = Field(description="the stage to run (e.g. `evaluate`)")
    job_id: str | None = Field(
        default=None, description="the job: with it the request id is deterministic"
    )
    branch_path: str | None = Field(default=None, description="the branch of the job")
    input: JsonValue = Field(default=None, description="the stage's input (JSON)")
    rerun: bool = Field(default=False, description="run a finished request again")


class ApplyAnswer(BaseModel):
    """`apply_ops`: one outcome per op, in the order given. Call again with the same ops and
    these `op_ids` to retry safely: each op is applied once, and a repeat answers `duplicate`."""

    workspace_id: str
    sub_doc: str
    op_ids: list[str]
    results: list[OpOutcome]
    #: With `enqueue`: one answer per item (null: not enqueued, the ops applied nothing).
    enqueued: list[EnqueueAnswer | None] | None = None


class EnqueueAnswer(BaseModel):
    """`enqueue`: the request's id and status. `coalesced`: an existing request absorbed the
    enqueue (same job, branch and stage); `input_differs`: and its stored input is not the one
    sent, so the stage runs (or ran) on the stored input — enqueue with `rerun` to run it on
    yours."""

    request_id: str
    status: str
    coalesced: bool
    input_differs: bool
    replayed: bool


class RequestAnswer(BaseModel):
    """`get_request` / `replay_request` / `cancel_request`: the request as it stands. `result`
    is the stage's result (fetched from the blob store when it was too large for the row);
    `attempts` the runs it took so far; `request` the rest of the row (`unclaimed_seconds`:
    how long it has waited for a worker — long, for a stage no worker serves)."""

    request_id: str
    workspace_id: str
    stage: str
    status: str
    attempts: int
    result: JsonValue = None
    error: JsonValue = None
    request: dict[str, JsonValue]


class WaitAnswer(BaseModel):
    """`wait_request`: `done`, `poison` or `cancelled` — or `timeout`, which ends only the wait:
    the request goes on (`request_status` says where it was), and waiting again is safe.
    `attempts`: the runs it took (`get_request` has the whole row)."""

    request_id: str
    status: Literal["done", "poison", "cancelled", "timeout"]
    request_status: str | None = None
    result: JsonValue = None
    error: JsonValue = None
    note: str | None = None
    attempts: int | None = None


class ListAnswer(BaseModel):
    """`list_requests`: at most `limit` requests, oldest first."""

    requests: list[dict[str, JsonValue]] = Field(default_factory=list)


def tool_error(code: str, message: str, **extra: JsonValue) -> CallToolResult:
    """An MCP tool error (`isError`) carrying `code` and `message` (and `extra` members) as the
    JSON `{"error": {...}}` of its text content. Every tool error of the server is built here.

    Never structured content: that is a successful result's, and clients check any of it
    against the tool's `outputSchema` (the TypeScript SDK's, so the MCP Inspector, on an error
    too). Text content is what every client reads (tests/outside/test_mcp_inspector.py,
    tests/mcp_server/test_tool_errors.py)."""
    error: dict[str, JsonValue] = {"code": code, "message": message, **extra}
    text = json.dumps({"error": error}, ensure_ascii=False, sort_keys=True)
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def workspace_error(exc: WorkspaceError, **extra: JsonValue) -> CallToolResult:
    """A tool error for an SDK error: the server's code and message.

    An op that got no final answer (`still_pending`) is reported under the code of what stopped
    it (`forbidden`, `unauthorized`, `connection_failed`...), with `pending: true`: it waits in
    the outbox under its op_id and is sent again (a token refused now may be replaced), so the
    caller retries with the same op_ids rather than new ones."""
    if isinstance(exc, StillPendingError):
        cause = exc.last_error
        code = cause.code if isinstance(cause, WorkspaceError) else exc.code
        return tool_error(code, exc.message, pending=True, **extra)
    if isinstance(exc, VersionConflictError) and exc.clock is not None:
        extra = {**extra, "clock": exc.clock}  # where to read again from
    return tool_error(exc.code, exc.message, **extra)


def arguments_error(
    tool: str, arguments: Mapping[str, Any], exc: ValidationError
) -> CallToolResult:
    """A tool error for arguments that do not fit the tool's input schema.

    An op that does not parse is reported with the op-log's own code (`unknown_op_type`,
    `invalid_id`, `invalid_field`) and its index, as the server would answer it; anything else
    as `invalid_arguments`, naming the fields (not their values: they are the caller's data)."""
    ops = arguments.get("ops")
    if tool == "apply_ops" and isinstance(ops, Sequence) and not isinstance(ops, str | bytes):
        for index, raw in enumerate(ops):
            try:
                parse_op(raw)
            except InvalidOp as invalid:
                return tool_error(invalid.code, f"ops[{index}]: {invalid.message}")
    problems = sorted(
        {
            f"{'.'.join(str(part) for part in error['loc']) or '(arguments)'}: {error['msg']}"
            for error in exc.errors()
        }
    )
    return tool_error("invalid_arguments", f"{tool}: " + "; ".join(problems))
