"""HTTP routes of the compute lock (layer 2, docs/stages.md), for workers.

`POST /v1/workspaces/{ws}/locks/acquire` `{"job_id", "task", "holder"?}` →
`{"acquired": true, "token", "expires_at", "expires_in", "ttl"}` or `{"acquired": false,
"locked": true, "holder", "expires_at", "expires_in", "ttl"}`; `POST .../locks/release`
`{"job_id", "task", "token"}` → `{"released": bool}`.
The TTL is the server's (`compute_lock_ttl_seconds`, 60 s), not the caller's: a lock that any
client could make eternal would turn one crashed worker into a stuck column.

`expires_at` is on the store's clock (`ComputeLockStore.clock`), which is not the worker's:
`expires_in` (seconds left, as of the answer) and `ttl` (the lock's lifetime) are durations, so a
worker can time its compute against the lock with its own clock, however far that one is off.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from aiohttp import web

from cv_server.http.bodies import read_body
from cv_server.http.inputs import check_ids, decode_json
from cv_server.http.models import (
    LockAcquireBody,
    LockAcquired,
    LockLocked,
    LockReleaseBody,
    LockReleased,
    parse_body,
)
from cv_server.http.openapi import Doc, documented
from cv_server.http.security import authorize
from cv_server.keys import CONFIG, METRICS, STORES
from cv_server.locks.store import Acquired

__all__ = ["routes"]

routes = web.RouteTableDef()

M = TypeVar("M", LockAcquireBody, LockReleaseBody)

log = logging.getLogger("cv_server.locks")


async def _body(request: web.Request, model: type[M]) -> tuple[str, M]:
    """The workspace and the body as `model` (its names: 1..256 chars without NUL, which
    PostgreSQL text cannot hold: the store raised, a 500 where SQLite answered)."""
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    authorize(request, workspace_id)
    return workspace_id, parse_body(model, decode_json(await read_body(request)))


@routes.post("/v1/workspaces/{ws}/locks/acquire")
@documented(
    Doc(
        "Take the compute lock of (job_id, task) for the server's TTL, or hear who holds it",
        {200: (LockAcquired, LockLocked)},
        body=LockAcquireBody,
        tag="locks",
    )
)
async def acquire(request: web.Request) -> web.Response:
    workspace_id, asked = await _body(request, LockAcquireBody)
    body = {"job_id": asked.job_id, "task": asked.task}
    holder = asked.holder
    ttl = request.app[CONFIG].compute_lock_ttl_seconds
    locks = request.app[STORES].locks
    now = await locks.clock()
    outcome = await locks.acquire(workspace_id, body["job_id"], body["task"], holder, ttl, now)
    timing = {"expires_at": outcome.expires_at, "expires_in": outcome.expires_at - now, "ttl": ttl}
    metrics = request.app[METRICS]
    fields = {"workspace": workspace_id, "job_id": body["job_id"], "task": body["task"]}
    if isinstance(outcome, Acquired):
        metrics.lock_acquired.inc()
        log.info(
            "lock acquired %s/%s",
            body["job_id"],
            body["task"],
            extra=_lock_fields("lock_acquired", fields, holder),
        )
        return web.json_response({"acquired": True, "token": outcome.token, **timing})
    metrics.lock_contended.inc()
    log.info(
        "lock contended %s/%s",
        body["job_id"],
        body["task"],
        extra=_lock_fields("lock_contended", fields, holder, outcome.holder),
    )
    return web.json_response(
        {"acquired": False, "locked": True, "holder": outcome.holder, **timing}
    )


@routes.post("/v1/workspaces/{ws}/locks/release")
@documented(
    Doc(
        "Release the lock that `token` acquired (false: it had expired)",
        {200: LockReleased},
        body=LockReleaseBody,
        tag="locks",
    )
)
async def release(request: web.Request) -> web.Response:
    workspace_id, asked = await _body(request, LockReleaseBody)
    body, token = {"job_id": asked.job_id, "task": asked.task}, asked.token
    locks = request.app[STORES].locks
    # The store's clock, as for acquire: release sweeps dead locks of other keys, and a server
    # whose own clock ran ahead would sweep live ones.
    released = await locks.release(
        workspace_id, body["job_id"], body["task"], token, await locks.clock()
    )
    if not released:
        request.app[METRICS].lock_expired.inc()
    fields = {"workspace": workspace_id, "job_id": body["job_id"], "task": body["task"]}
    log.info(
        "lock %s %s/%s",
        "released" if released else "expired before release",
        body["job_id"],
        body["task"],
        extra={"event": "lock_released" if released else "lock_expired", **fields},
    )
    return web.json_response({"released": released})


def _lock_fields(
    event: str, fields: dict[str, str], holder: str, held_by: str | None = None
) -> dict[str, object]:
    """A lock decision's log fields: the key, the holder the caller named and, when refused,
    the holder that has it."""
    extra: dict[str, object] = {"event": event, **fields, "holder": holder}
    if held_by is not None:
        extra["held_by"] = held_by
    return extra
