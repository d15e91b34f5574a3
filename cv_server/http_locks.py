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

from typing import Any

from aiohttp import web

from cv_server.bodies import read_body
from cv_server.inputs import check_ids, decode_json
from cv_server.keys import CONFIG, STORES
from cv_server.locks.store import Acquired
from cv_server.problems import Problem
from cv_server.security import authorize

__all__ = ["routes"]

routes = web.RouteTableDef()


async def _body(request: web.Request) -> tuple[str, dict[str, Any]]:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    authorize(request, workspace_id)
    body = decode_json(await read_body(request))
    if not isinstance(body, dict):
        raise Problem(400, "malformed_json", "body must be a JSON object")
    # PostgreSQL text cannot hold NUL: the store raised, a 500 where SQLite answered (§11).
    for name in ("job_id", "task"):
        value = body.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= 256 or "\x00" in value:
            raise Problem(
                422, "invalid_field", f"{name} must be a string of 1..256 chars, without NUL"
            )
    return workspace_id, body


@routes.post("/v1/workspaces/{ws}/locks/acquire")
async def acquire(request: web.Request) -> web.Response:
    workspace_id, body = await _body(request)
    holder = body.get("holder", "anonymous")
    if not isinstance(holder, str) or not 0 < len(holder) <= 256 or "\x00" in holder:
        raise Problem(422, "invalid_field", "holder must be a string of 1..256 chars, without NUL")
    ttl = request.app[CONFIG].compute_lock_ttl_seconds
    locks = request.app[STORES].locks
    now = await locks.clock()
    outcome = await locks.acquire(workspace_id, body["job_id"], body["task"], holder, ttl, now)
    timing = {"expires_at": outcome.expires_at, "expires_in": outcome.expires_at - now, "ttl": ttl}
    if isinstance(outcome, Acquired):
        return web.json_response({"acquired": True, "token": outcome.token, **timing})
    return web.json_response(
        {"acquired": False, "locked": True, "holder": outcome.holder, **timing}
    )


@routes.post("/v1/workspaces/{ws}/locks/release")
async def release(request: web.Request) -> web.Response:
    workspace_id, body = await _body(request)
    token = body.get("token")
    if not isinstance(token, str) or not token or "\x00" in token:
        raise Problem(422, "invalid_field", "token is required (a string without NUL)")
    locks = request.app[STORES].locks
    # The store's clock, as for acquire: release sweeps dead locks of other keys, and a server
    # whose own clock ran ahead would sweep live ones.
    released = await locks.release(
        workspace_id, body["job_id"], body["task"], token, await locks.clock()
    )
    return web.json_response({"released": released})
