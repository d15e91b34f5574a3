"""Storage faults as HTTP answers: `503 storage_unavailable` with `Retry-After` (docs/problems.md,
docs/operating.md "Storage faults")."""

from __future__ import annotations

import math

from aiohttp import web

from cv_server.http.problems import Problem
from cv_server.keys import CONFIG, STORES

__all__ = ["retry_after_seconds", "storage_problem"]


def retry_after_seconds(app: web.Application) -> int:
    """The `Retry-After` of a write refused for storage: `ServerConfig.sweep_seconds` (why, in
    `cv_server/config.py`), in whole seconds, at least 1."""
    return max(1, math.ceil(app[CONFIG].sweep_seconds))


def storage_problem(
    app: web.Application,
    exc: BaseException,
    *,
    what: str = "the write was refused and nothing of it was kept",
) -> Problem | None:
    """The 503 answer to `exc` if it is a storage fault of the app's backend, else None;
    `what` opens its detail."""
    stores = app.get(STORES)
    if stores is None:
        return None
    fault = stores.storage_fault(exc)
    if fault is None:
        return None
    seconds = retry_after_seconds(app)
    return Problem(
        503,
        "storage_unavailable",
        f"{what}: {fault}",
        headers={"Retry-After": str(seconds)},
        retry_after=seconds,
    )
