"""The no-op stage `bench.queue` runs in its `cv-worker` processes: it does nothing but say when it
ran (the drain rate is measured from these times, the same way as for huey)."""

from __future__ import annotations

import time

from cv_workspace_client.stage import StageContext


async def noop(ctx: StageContext) -> float:
    return time.time()


STAGES = {"noop": noop}
