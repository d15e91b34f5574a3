"""`evaluate`: one provider call per custom column of a job, each made once (docs/concepts.md,
docs/stages.md).

Input: `{"columns": [{"name": "fit", "prompt": "How well does ..."}, "seniority", ...],
"wait_seconds"?: 60}` — a column is an object with a `name` and a `prompt`, or a bare name (its
prompt is then `Evaluate this job for: <name>`). Names match `[A-Za-z0-9_.-]{1,64}` and are
unique. The request's `job_id` names the job's node in the `jobs` sub-doc (inserted, empty, if
missing).

Per column, under `compute_lock(job_id, "eval:<name>")`: pre-flight (field `eval:<name>` already
set?) → acquire → double-check → `provider.complete(prompt)` and a `node.update` setting
`eval:<name>` (op_id derived from the request and the field) → release. Columns run one after the
other. A column locked by someone else is waited for (`wait_seconds`, one lock TTL by default)
and read from the broadcast of their write.

Result: `{"job_id", "values": {name: answer}, "computed": [names computed by this run]}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from cv_workspace_client.compute import ComputeResult
from cv_workspace_client.stage import ExpectedError, StageContext
from cv_workspace_client.stages.jobs import (
    JOBS,
    ComputeLockedError,
    ensure_job_node,
    input_object,
    read_field,
    require_job_id,
    require_provider,
    wait_seconds,
    write_field,
)

__all__ = ["Column", "column_prompt", "evaluate", "make_evaluate", "parse_columns"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Fields a stage computes; left out of the job description a prompt carries.
_COMPUTED_PREFIXES = ("eval:", "commute_")


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    prompt: str

    @property
    def field(self) -> str:
        """The job node's field (and the lock's task) for this column."""
        return f"eval:{self.name}"


def parse_columns(options: dict[str, Any]) -> list[Column]:
    """The columns of an evaluate input; `ExpectedError("invalid_input")` when malformed."""
    raw = options.get("columns")
    if not isinstance(raw, list) or not raw:
        raise ExpectedError("invalid_input", "columns must be a non-empty list")
    columns: list[Column] = []
    for item in raw:
        if isinstance(item, str):
            name, prompt = item, f"Evaluate this job for: {item}"
        elif isinstance(item, dict) and isinstance(item.get("name"), str):
            name, given = item["name"], item.get("prompt")
            if not isinstance(given, str) or not given:
                raise ExpectedError("invalid_input", f"column {name!r}: prompt must be a string")
            prompt = given
        else:
            raise ExpectedError(
                "invalid_input", f"a column is a name or {{name, prompt}}: {item!r}"
            )
        if not _NAME.match(name):
            raise ExpectedError("invalid_input", f"column name {name!r} is not valid")
        columns.append(Column(name, prompt))
    names = [column.name for column in columns]
    if len(set(names)) != len(names):
        raise ExpectedError("invalid_input", "column names must be unique")
    return columns


def column_prompt(column: Column, job_id: str, job: dict[str, JsonValue]) -> str:
    """The provider prompt: the column's prompt, then the job (its own fields, not computed
    ones, as canonical JSON so the same job always gives the same prompt)."""
    described = {key: value for key, value in job.items() if not key.startswith(_COMPUTED_PREFIXES)}
    facts = json.dumps(described, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{column.prompt}\n\nJob {job_id}: {facts}"


#: How one cell is computed: `(ctx, job_id, task, check, compute, wait) -> ComputeResult`.
CellComputer = Callable[
    [
        StageContext,
        str,
        str,
        Callable[[], Awaitable[JsonValue | None]],
        Callable[[], Awaitable[JsonValue]],
        float,
    ],
    Awaitable[ComputeResult[JsonValue]],
]


async def _under_lock(
    ctx: StageContext,
    job_id: str,
    task: str,
    check: Callable[[], Awaitable[JsonValue | None]],
    compute: Callable[[], Awaitable[JsonValue]],
    wait: float,
) -> ComputeResult[JsonValue]:
    return await ctx.compute(job_id, task, check=check, compute=compute, sub_doc=JOBS, wait=wait)


async def _without_lock(
    ctx: StageContext,
    job_id: str,
    task: str,
    check: Callable[[], Awaitable[JsonValue | None]],
    compute: Callable[[], Awaitable[JsonValue]],
    wait: float,
) -> ComputeResult[JsonValue]:
    # The anti-pattern (docs/stages.md): a pre-flight check alone. Racing runs all see the cell
    # empty and all pay for it.
    value = await check()
    if value is not None:
        return ComputeResult("present", value)
    return ComputeResult("computed", await compute())


def make_evaluate(*, use_lock: bool = True) -> Callable[[StageContext], Awaitable[Any]]:
    """The evaluate handler. `use_lock=False` drops the compute lock (pre-flight check only):
    the anti-pattern the tests and the benchmark measure against; never deploy it."""
    computer: CellComputer = _under_lock if use_lock else _without_lock

    async def evaluate(ctx: StageContext) -> dict[str, Any]:
        options = input_object(ctx)
        columns = parse_columns(options)
        wait = wait_seconds(options)
        job_id = require_job_id(ctx)
        provider = require_provider(ctx)
        job = await ensure_job_node(ctx, job_id)

        values: dict[str, JsonValue] = {}
        computed: list[str] = []
        # One column at a time ("for each custom column: acquire, call, release"): a
        # stage has at most one paid call in flight, so a worker killed mid-stage wastes at most
        # one call, and its columns already written are found present by the re-drive.
        for column in columns:
            field = column.field

            async def check(field: str = field) -> JsonValue | None:
                return await read_field(ctx, job_id, field)

            async def compute(column: Column = column) -> JsonValue:
                answer = await provider.complete(column_prompt(column, job_id, job))
                return await write_field(ctx, job_id, column.field, answer.text)

            result = await computer(ctx, job_id, field, check, compute, wait)
            if result.status == "locked":
                raise ComputeLockedError(job_id, field)
            values[column.name] = result.value
            if result.status == "computed":
                computed.append(column.name)
        return {"job_id": job_id, "values": values, "computed": computed}

    return evaluate


#: The shipped handler: every column under its compute lock.
evaluate = make_evaluate()
