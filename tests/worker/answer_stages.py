"""Stages for the tests of what a stage's end means to the queue (imported by `cv-worker`
processes): a result of any size, and a write the server refuses for good."""

from __future__ import annotations

from typing import Any

from cv_mutations import NodeUpdate
from cv_workspace_client.stage import Stage, StageContext


async def big(ctx: StageContext) -> Any:
    """A string of `input` characters (its JSON is `input` + 2 bytes)."""
    return "x" * int(ctx.input)


async def refused_write(ctx: StageContext) -> Any:
    """Updates a node that does not exist: the server answers `node_not_found`, for good."""
    await ctx.apply_op("tree", NodeUpdate(node_id="missing", set={"a": 1}), key="touch-missing")
    return "unreachable"


STAGES = {"big": Stage(big), "refused_write": Stage(refused_write)}
