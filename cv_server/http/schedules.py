"""HTTP routes of schedules (docs/queue.md, "Schedules"): a scheduler that only enqueues.

`POST /v1/workspaces/{ws}/schedules` adds one (201), `GET .../schedules` lists them by name
(keyset-paged), `GET|DELETE .../schedules/{name}`, `POST .../schedules/{name}/pause|resume`,
and `POST .../schedules/{name}/run` enqueues a firing now (202, the enqueue's answer).

A schedule records the grant of the token that added it, and every firing's request runs under
it (docs/queue.md, "Whose grant a stage runs under"): a limited token cannot schedule more than
it could enqueue. Running one out of turn needs a token whose grant covers the schedule's.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Final

import orjson
from aiohttp import web

from cv_server.http.bodies import read_body
from cv_server.http.inputs import check_ids, decode_json
from cv_server.http.listings import MAX_PAGE, page_limit
from cv_server.http.models import (
    SCHEDULE_NAME_PATTERN,
    EnqueueAnswer,
    ScheduleAnswer,
    ScheduleBody,
    ScheduleList,
    parse_body,
)
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.security import authorize
from cv_server.keys import CONFIG, SCHEDULER, STORES
from cv_server.queue.model import EnqueueAsk
from cv_server.schedules.model import (
    Schedule,
    ScheduleSpec,
    check_spec,
    firing_request,
)
from cv_server.schedules.store import ScheduleExists, ScheduleNotFound
from cv_server.scopes import enqueue_grant, sub_doc_granted

__all__ = ["grant_covers", "routes"]

routes = web.RouteTableDef()

_NAME_RE: Final = re.compile(SCHEDULE_NAME_PATTERN)
_BASE: Final = "/v1/workspaces/{ws}/schedules"
_NOT_FOUND: Final = {404: ("schedule_not_found",)}


def grant_covers(caller: dict[str, Any] | None, stored: dict[str, Any] | None) -> bool:
    """Whether a token of grant `caller` may do all that grant `stored` allows (None: the full
    grant): every scope of it, on every sub-doc of it."""
    if caller is None:
        return True
    if stored is None or not set(stored["scopes"]) <= set(caller["scopes"]):
        return False
    mine = caller["sub_docs"]
    if mine is None:
        return True
    theirs = stored["sub_docs"]
    if theirs is None:
        return False
    granted = frozenset(mine)
    for grant in theirs:
        if grant.endswith("*"):
            prefix = grant[:-1]
            if not any(g.endswith("*") and prefix.startswith(g[:-1]) for g in granted):
                return False
        elif not sub_doc_granted(granted, grant):
            return False
    return True


def _name(request: web.Request) -> tuple[str, str]:
    workspace_id, name = request.match_info["ws"], request.match_info["name"]
    check_ids(workspace_id)
    if not _NAME_RE.fullmatch(name):
        raise _not_found(name)
    return workspace_id, name


def _not_found(name: str) -> Problem:
    return Problem(404, "schedule_not_found", f"no schedule {name!r}")


@routes.post(_BASE)
@documented(
    Doc(
        "Add a schedule: it fires by enqueueing its request at each due time (UTC)",
        {201: ScheduleAnswer},
        body=ScheduleBody,
        problems={409: ("schedule_exists",)},
        tag="schedules",
    )
)
async def add_schedule(request: web.Request) -> web.Response:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    claims = authorize(request, workspace_id)
    asked = parse_body(ScheduleBody, decode_json(await read_body(request)))
    if asked.enqueue.deterministic is not None or asked.enqueue.rerun:
        raise Problem(
            422,
            "invalid_field",
            "enqueue.deterministic and enqueue.rerun do not apply: each firing's id is the"
            " schedule's and its due time's",
        )
    enqueue = asked.enqueue.model_dump(exclude_none=True, exclude={"rerun"})
    enqueue["input"] = asked.enqueue.input
    try:  # what a firing stores in its request row must be storable (as an enqueue's input)
        orjson.dumps(enqueue["input"])
    except orjson.JSONEncodeError:
        raise Problem(
            422,
            "invalid_field",
            "enqueue.input is nested too deeply or holds an integer past 64 bits",
        ) from None
    spec = ScheduleSpec(
        workspace_id=workspace_id,
        name=asked.name,
        enqueue=enqueue,
        cron=asked.cron,
        interval_seconds=asked.interval_seconds,
        missed=asked.missed,
        overlap=asked.overlap,
        paused=asked.paused,
        enqueue_grant=enqueue_grant(claims.scopes, claims.sub_docs),
    )
    try:
        check_spec(spec)
    except ValueError as exc:
        raise Problem(422, "invalid_field", str(exc)) from None
    schedules = request.app[STORES].schedules
    try:
        added = await schedules.add(spec, "sch_" + secrets.token_hex(16), await schedules.clock())
    except ScheduleExists as exc:
        raise Problem(409, exc.code, str(exc)) from None
    request.app[SCHEDULER].wake()
    return web.json_response(added.to_json(), status=201)


@routes.get(_BASE)
@documented(
    Doc(
        "The workspace's schedules, by name",
        {200: ScheduleList},
        params=(
            Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}),
            Param("after", {"type": "string"}, "The next_after of the previous page"),
        ),
        tag="schedules",
    )
)
async def list_schedules(request: web.Request) -> web.Response:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    authorize(request, workspace_id)
    limit = page_limit(request)
    after = request.query.get("after")
    if after is not None and not _NAME_RE.fullmatch(after):
        raise Problem(422, "invalid_field", "after must be the next_after of a listing page")
    found = await request.app[STORES].schedules.list(workspace_id, after=after, limit=limit)
    next_after = found[-1].name if len(found) == limit else None
    return web.json_response({"schedules": [s.to_json() for s in found], "next_after": next_after})


async def _schedule(request: web.Request) -> tuple[str, str, Schedule]:
    workspace_id, name = _name(request)
    authorize(request, workspace_id)
    found = await request.app[STORES].schedules.get(workspace_id, name)
    if found is None:
        raise _not_found(name)
    return workspace_id, name, found


@routes.get(_BASE + "/{name}")
@documented(Doc("One schedule", {200: ScheduleAnswer}, problems=_NOT_FOUND, tag="schedules"))
async def get_schedule(request: web.Request) -> web.Response:
    _, _, found = await _schedule(request)
    return web.json_response(found.to_json())


@routes.delete(_BASE + "/{name}")
@documented(
    Doc(
        "Delete a schedule (the requests it enqueued stay queued)",
        {204: None},
        problems=_NOT_FOUND,
        tag="schedules",
    )
)
async def delete_schedule(request: web.Request) -> web.Response:
    workspace_id, name = _name(request)
    authorize(request, workspace_id)
    if not await request.app[STORES].schedules.delete(workspace_id, name):
        raise _not_found(name)
    return web.Response(status=204)


async def _set_paused(request: web.Request, paused: bool) -> web.Response:
    workspace_id, name = _name(request)
    authorize(request, workspace_id)
    schedules = request.app[STORES].schedules
    try:
        changed = await schedules.set_paused(workspace_id, name, paused, await schedules.clock())
    except ScheduleNotFound:
        raise _not_found(name) from None
    if not paused:
        request.app[SCHEDULER].wake()
    return web.json_response(changed.to_json())


@routes.post(_BASE + "/{name}/pause")
@documented(
    Doc(
        "Pause a schedule: it fires no more",
        {200: ScheduleAnswer},
        problems=_NOT_FOUND,
        tag="schedules",
    )
)
async def pause_schedule(request: web.Request) -> web.Response:
    return await _set_paused(request, True)


@routes.post(_BASE + "/{name}/resume")
@documented(
    Doc(
        "Resume a schedule: due next at its first due time from now (none caught up)",
        {200: ScheduleAnswer},
        problems=_NOT_FOUND,
        tag="schedules",
    )
)
async def resume_schedule(request: web.Request) -> web.Response:
    return await _set_paused(request, False)


@routes.post(_BASE + "/{name}/run")
@documented(
    Doc(
        "Fire a schedule now, out of turn: enqueue its request (its next due time unchanged)",
        {202: EnqueueAnswer},
        problems={**_NOT_FOUND, 403: ("grant_exceeded",)},
        tag="schedules",
    )
)
async def run_schedule(request: web.Request) -> web.Response:
    workspace_id, name = _name(request)
    claims = authorize(request, workspace_id)
    found = await request.app[STORES].schedules.get(workspace_id, name)
    if found is None:
        raise _not_found(name)
    # The firing runs under the schedule's grant: only a token that could have added it may.
    if not grant_covers(enqueue_grant(claims.scopes, claims.sub_docs), found.spec.enqueue_grant):
        raise Problem(403, "grant_exceeded", "the schedule's grant is wider than this token's")
    stores = request.app[STORES]
    now = await stores.schedules.clock()
    req = firing_request(found, now, max_dequeues=request.app[CONFIG].max_dequeues)
    (enqueued,) = await stores.queue.enqueue_many([EnqueueAsk(req)], now=None)
    await stores.schedules.record_firing(workspace_id, found.schedule_id, now, req.request_id)
    row = enqueued.row
    answer = {
        "request_id": row.request_id,
        "status": row.status,
        "coalesced": enqueued.coalesced,
        "input_differs": False,
        "stream_url": f"/v1/workspaces/{workspace_id}/requests/{row.request_id}/stream",
    }
    return web.json_response(answer, status=202)
