"""HTTP routes of the compute lock (layer 2, DESIGN §8, seed 000), for workers.

`POST /v1/workspaces/{ws}/locks/acquire` `{"job_id", "task", "holder"?}` →
`{"acquired": true, "token", "expires_at"}` or `{"acquired": false, "locked": true, "holder",
"expires_at"}`; `POST .../locks/release` `{"job_id", "task", "token"}` → `{"released": bool}`.
The TTL is the server's (`compute_lock_ttl_seconds`, 60 s), not the caller's: a lock that any
client could make eternal would turn one crashed worker into a stuck column.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

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
    body = decode_json(await request.read())
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
    outcome = await request.app[STORES].locks.acquire(
        workspace_id, body["job_id"], body["task"], holder, ttl, time.time()
    )
    if isinstance(outcome, Acquired):
        return web.json_response(
            {"acquired": True, "token": outcome.token, "expires_at": outcome.expires_at}
        )
    return web.json_response(
        {
            "acquired": False,
            "locked": True,
            "holder": outcome.holder,
            "expires_at": outcome.expires_at,
        }
    )


@routes.post("/v1/workspaces/{ws}/locks/release")
async def release(request: web.Request) -> web.Response:
    workspace_id, body = await _body(request)
    token = body.get("token")
    if not isinstance(token, str) or not token or "\x00" in token:
        raise Problem(422, "invalid_field", "token is required (a string without NUL)")
    released = await request.app[STORES].locks.release(
        workspace_id, body["job_id"], body["task"], token, time.time()
    )
    return web.json_response({"released": released})
