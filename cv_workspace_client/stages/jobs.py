"""What the example stages share: the `jobs` sub-doc, where each job is one node (node_id = job_id)
and each computed figure one field of it.

A stage reads a cell with `read_field` (the check of the compute lock) and writes it with one
`node.update` through `StageContext.apply_op`, keyed by the field name: the op_id derives from
(request_id, run, field), so a stage re-driven after a crash writes the same op_ids and the server
dedupes them (layer 3).
"""

from __future__ import annotations

import re
from typing import Any, Final

from pydantic import JsonValue

from cv_mutations import ROOT, NodeInsert, NodeUpdate
from cv_workspace_client.errors import OpRejectedError, WorkspaceError
from cv_workspace_client.providers import Provider
from cv_workspace_client.stage import ExpectedError, StageContext

__all__ = [
    "JOBS",
    "LOCK_WAIT_SECONDS",
    "ComputeLockedError",
    "ProviderMissingError",
    "ensure_job_node",
    "input_object",
    "job_fields",
    "read_field",
    "require_job_id",
    "require_provider",
    "wait_seconds",
    "write_field",
]

#: The sub-doc holding one node per job.
JOBS: Final = "jobs"

#: How long a stage waits for another holder's write before giving up on a cell: one compute-lock
#: TTL (60 s, docs/configuration.md). A live holder is done (or has given up) within its TTL —
#: `compute_once` bounds it — and a dead one's lock has lapsed by then, so the waiter's poll takes
#: the key over.
LOCK_WAIT_SECONDS: Final = 60.0

_NODE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class ComputeLockedError(WorkspaceError):
    """`compute_locked`: a cell stayed locked by someone else past the wait. Not an expected
    error: the stage fails and the queue re-drives it later (it then finds the value, or takes
    the lapsed lock over)."""

    def __init__(self, job_id: str, task: str) -> None:
        super().__init__("compute_locked", f"{job_id}/{task} is still being computed elsewhere")


class ProviderMissingError(WorkspaceError):
    """`provider_missing`: the worker was started without a provider. Not an expected error: a
    worker that has one can run the request, so it goes back to the queue."""

    def __init__(self, stage: str) -> None:
        super().__init__("provider_missing", f"stage {stage!r} needs a provider (--provider)")


def require_job_id(ctx: StageContext) -> str:
    """The request's job_id, checked to be a valid node id (an expected error otherwise)."""
    job_id = ctx.job_id
    if job_id is None:
        raise ExpectedError("invalid_input", f"stage {ctx.stage!r} needs a job_id")
    if not _NODE_ID.match(job_id):
        raise ExpectedError("invalid_input", f"job_id {job_id!r} is not a valid node id")
    return job_id


def require_provider(ctx: StageContext) -> Provider:
    if ctx.provider is None:
        raise ProviderMissingError(ctx.stage)
    return ctx.provider


async def job_fields(ctx: StageContext, job_id: str) -> dict[str, JsonValue] | None:
    """The job node's fields (a copy), or None when the node does not exist."""
    _, state = await ctx.client.get_state(ctx.workspace_id, JOBS)
    node = state.nodes.get(job_id)
    return None if node is None else dict(node.fields)


async def read_field(ctx: StageContext, job_id: str, field: str) -> JsonValue | None:
    """The value of one cell, or None if it is not set: the check of the compute lock."""
    fields = await job_fields(ctx, job_id)
    return None if fields is None else fields.get(field)


async def ensure_job_node(ctx: StageContext, job_id: str) -> dict[str, JsonValue]:
    """The job node's fields, inserting an empty node under the root when it is missing.

    The insert's op_id derives from the request (key `job-node`), so a re-drive dedupes; another
    request that inserted it first makes ours answer `node_exists`, which is just as good.
    """
    fields = await job_fields(ctx, job_id)
    if fields is not None:
        return fields
    try:
        await ctx.apply_op(JOBS, NodeInsert(node_id=job_id, parent_id=ROOT), key="job-node")
    except OpRejectedError as exc:
        if exc.code != "node_exists":
            raise
    return await job_fields(ctx, job_id) or {}


async def write_field(ctx: StageContext, job_id: str, field: str, value: JsonValue) -> JsonValue:
    """Write one cell (`node.update`, op_id derived from `field`); return the value that stands.

    `op_id_reuse` means an earlier attempt of this same run already wrote the cell with another
    value (a provider that does not answer the same twice): that committed write stands.
    """
    try:
        await ctx.apply_op(JOBS, NodeUpdate(node_id=job_id, set={field: value}), key=field)
    except OpRejectedError as exc:
        if exc.code != "op_id_reuse":
            raise
        current = await read_field(ctx, job_id, field)
        if current is None:
            raise
        return current
    return value


def input_object(ctx: StageContext) -> dict[str, Any]:
    """The request input as an object (None counts as empty)."""
    raw = ctx.input
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ExpectedError("invalid_input", "the input must be a JSON object")
    return raw


def wait_seconds(options: dict[str, Any]) -> float:
    """`wait_seconds` from the input (how long a locked cell is waited for), else one TTL."""
    value = options.get("wait_seconds", LOCK_WAIT_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 3600:
        raise ExpectedError("invalid_input", "wait_seconds must be a number of seconds (0..3600)")
    return float(value)
