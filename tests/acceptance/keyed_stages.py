"""The stage of the concurrency-key acceptance test (`tests.acceptance.keyed_stages:STAGES`).

`acc_keyed` runs on input `{"key": ..., "sleep": seconds}` and appends `start <key>
<request_id> <time>` when it begins and `end <key> <request_id> <time>` when it is about to
return to the file named by `CV_ACC_TRAIL` (one per worker process, each line flushed and
synced): the test reads from these how many requests of each key ran at once, as the stages
themselves saw it. The times are this machine's wall clock, shared by every worker process.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from cv_workspace_client.stage import Stage, StageContext


def _trail(line: str) -> None:
    path = os.environ["CV_ACC_TRAIL"]
    with open(path, "a") as trail:
        trail.write(line + "\n")
        trail.flush()
        os.fsync(trail.fileno())


async def keyed(ctx: StageContext) -> Any:
    key = ctx.input["key"]
    _trail(f"start {key} {ctx.request.request_id} {time.time():.6f}")
    await asyncio.sleep(float(ctx.input["sleep"]))
    _trail(f"end {key} {ctx.request.request_id} {time.time():.6f}")
    return {"key": key}


STAGES = {"acc_keyed": Stage(keyed)}
