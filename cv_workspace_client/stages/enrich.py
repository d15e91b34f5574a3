"""`enrich`: one provider call per job for its commute figure, made once (docs/stages.md: "one Maps
call per commute calculation in enrich").

Input: `{"origin": "home address", "wait_seconds"?: 60}` (origin defaults to `home`). The job's
`location` field (if any) is the destination. Under `compute_lock(job_id, "enrich:commute")`:
pre-flight (`commute_minutes` set?) → acquire → double-check → ask the provider for the minutes
and write `commute_minutes` with a `node.update` (op_id derived from the request) → release.

Result: `{"job_id", "commute_minutes", "computed": bool}`. An answer without a number completes
the request with the expected error `provider_bad_answer` (paying again would not fix it).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import JsonValue

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

__all__ = ["COMMUTE_FIELD", "COMMUTE_TASK", "commute_prompt", "enrich", "parse_minutes"]

COMMUTE_FIELD = "commute_minutes"
COMMUTE_TASK = "enrich:commute"

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def commute_prompt(origin: str, job_id: str, location: str) -> str:
    return (
        f"Commute in minutes from {origin} to {location} (job {job_id}). "
        "Answer with a whole number of minutes."
    )


def parse_minutes(text: str) -> int | None:
    """The first number in the answer, rounded to whole minutes; None if there is none."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    minutes = round(float(match.group()))
    return minutes if minutes >= 0 else None


async def enrich(ctx: StageContext) -> dict[str, Any]:
    options = input_object(ctx)
    origin = options.get("origin", "home")
    if not isinstance(origin, str) or not 0 < len(origin) <= 512:
        raise ExpectedError("invalid_input", "origin must be a string of 1..512 chars")
    wait = wait_seconds(options)
    job_id = require_job_id(ctx)
    provider = require_provider(ctx)
    job = await ensure_job_node(ctx, job_id)
    location = job.get("location")
    destination = location if isinstance(location, str) and location else f"job {job_id}"

    async def check() -> JsonValue | None:
        return await read_field(ctx, job_id, COMMUTE_FIELD)

    async def compute() -> JsonValue:
        answer = await provider.complete(commute_prompt(origin, job_id, destination))
        minutes = parse_minutes(answer.text)
        if minutes is None:
            raise ExpectedError(
                "provider_bad_answer", f"no number of minutes in {answer.text[:200]!r}"
            )
        return await write_field(ctx, job_id, COMMUTE_FIELD, minutes)

    result = await ctx.compute(
        job_id, COMMUTE_TASK, check=check, compute=compute, sub_doc=JOBS, wait=wait
    )
    if result.status == "locked":
        raise ComputeLockedError(job_id, COMMUTE_TASK)
    return {
        "job_id": job_id,
        COMMUTE_FIELD: result.value,
        "computed": result.status == "computed",
    }
