"""Stages run by the acceptance test's worker processes (`tests.acceptance.queue_stages:STAGES`).

`acc_work` leaves a trail in the file named by `CV_ACC_TRAIL` (one line per event, flushed), so the
test knows which request a worker holds when it kills or drains it: `start <request_id>
<claimed_at>` when the stage begins, `end <request_id>` once its write committed. It sleeps
`CV_ACC_SLEEP` seconds mid-stage (a window for the signal), then adds 1 to the shared counter
through `ctx.apply_op` — so a stage run twice would show as a counter past the request count,
unless the second write dedupes under the same derived op_id.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from cv_mutations import NodeIncrement
from cv_workspace_client.stage import ExpectedError, Stage, StageContext

COUNTER_DOC = "tree"
COUNTER_NODE = "counter"


def _trail(line: str) -> None:
    path = os.environ.get("CV_ACC_TRAIL")
    if path:
        with open(path, "a") as trail:
            trail.write(line + "\n")
            trail.flush()
            os.fsync(trail.fileno())


async def work(ctx: StageContext) -> Any:
    _trail(f"start {ctx.request.request_id} {ctx.request.claimed_at}")
    await asyncio.sleep(float(os.environ.get("CV_ACC_SLEEP", "0.01")))
    await ctx.apply_op(COUNTER_DOC, NodeIncrement(node_id=COUNTER_NODE, field="n"), key="count")
    _trail(f"end {ctx.request.request_id}")
    return {"n": ctx.input, "worker": ctx.worker_id}


async def always_fails(ctx: StageContext) -> Any:
    raise RuntimeError(f"broken on dequeue {ctx.request.dequeue_count}")


async def not_found(ctx: StageContext) -> Any:
    raise ExpectedError("not_found", f"no job {ctx.job_id}", {"job_id": ctx.job_id})


async def slow(ctx: StageContext) -> Any:
    await asyncio.sleep(float(ctx.input))
    return {"slept": ctx.input}


STAGES = {
    "acc_work": Stage(work),
    "acc_fail": Stage(always_fails),
    "acc_expected": Stage(not_found),
    "acc_slow": Stage(slow),
}
