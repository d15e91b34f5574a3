"""Stages for the `cv-worker` command's tests (imported by the worker process)."""

from __future__ import annotations

from typing import Any

from cv_workspace_client.stage import ExpectedError, Stage, StageContext


async def double(ctx: StageContext) -> Any:
    if not isinstance(ctx.input, int):
        raise ExpectedError("bad_input", "input must be an integer")
    return ctx.input * 2


STAGES = {"double": Stage(double)}
NOT_A_DICT = [double]
