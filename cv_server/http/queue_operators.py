"""HTTP routes of the queue's operators: list requests by status and workspace, put a poison
request back by hand or discard it, cancel a request (see docs/queue.md)."""

from __future__ import annotations

import math

from aiohttp import web

from cv_mutations import is_valid_workspace_id
from cv_server.http.models import QueueRequest, RequestList
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.queue import NOT_FOUND_PROBLEMS, queue_problem, row_json, row_of, storable
from cv_server.http.security import authenticate
from cv_server.keys import METRICS, STORES
from cv_server.queue import STATUSES, QueueError

__all__ = ["routes"]

routes = web.RouteTableDef()


@routes.get("/v1/queue/requests")
@documented(
    Doc(
        "Operators: list requests, oldest first, by status and workspace (paged)",
        {200: RequestList},
        params=(
            Param("status", {"type": "string", "enum": list(STATUSES)}),
            Param("workspace", {"type": "string"}, "Required unless the token grants every one"),
            Param("limit", {"type": "integer", "minimum": 0, "maximum": 1000}),
            Param("after", {"type": "string"}, "The next_after of the previous page"),
        ),
        problems={
            400: ("invalid_field",),
            403: ("forbidden_workspace",),
            422: ("invalid_field", "invalid_id"),
        },
        tag="operators",
    )
)
async def list_requests(request: web.Request) -> web.Response:
    claims = authenticate(request)
    status = request.query.get("status")
    if status is not None and status not in STATUSES:
        raise Problem(422, "invalid_field", f"status must be one of {'|'.join(STATUSES)}")
    workspace_id = request.query.get("workspace")
    if workspace_id is None and "*" not in claims.workspaces:
        raise Problem(403, "forbidden_workspace", "name a workspace (?workspace=) you may touch")
    if workspace_id is not None:
        if not is_valid_workspace_id(workspace_id):
            raise Problem(422, "invalid_id", "bad workspace id")
        if not claims.allows(workspace_id):
            raise Problem(403, "forbidden_workspace", f"the token does not grant {workspace_id!r}")
    try:
        limit = min(int(request.query.get("limit", "100")), 1000)
    except ValueError:
        raise Problem(400, "invalid_field", "limit must be an integer") from None
    if limit < 0:  # the stores refuse it (SQLite: ValueError; PostgreSQL: LIMIT -1): was a 500
        raise Problem(422, "invalid_field", "limit must be an integer in 0..1000")
    queue = request.app[STORES].queue
    rows = await queue.list(
        status=status,
        workspace_id=workspace_id,
        limit=limit,
        after=_list_cursor(request.query.get("after")),
    )
    now = await queue.clock()
    # A full page may have more behind it: `?after=<next_after>` asks for the next one, so every
    # poison request can be listed and replayed by hand.
    last = rows[-1] if rows and len(rows) == limit else None
    next_after = None if last is None else f"{last.created_at!r},{last.request_id}"
    return web.json_response(
        {"requests": [row.to_json(now=now) for row in rows], "next_after": next_after}
    )


def _list_cursor(raw: str | None) -> tuple[float, str] | None:
    """The `?after=` of a listing: the `next_after` of the page before (`created_at,request_id`
    of its last row), opaque to clients."""
    if raw is None:
        return None
    created, _, request_id = raw.partition(",")
    try:
        created_at = float(created)
    except ValueError:
        created_at = math.nan
    if not math.isfinite(created_at) or not 0 < len(request_id) <= 256 or not storable(request_id):
        raise Problem(422, "invalid_field", "after must be the next_after of a listing page")
    return created_at, request_id


@routes.post("/v1/workspaces/{ws}/requests/{id}/replay")
@documented(
    Doc(
        "Operators: put a poison request back in the queue",
        {200: QueueRequest},
        problems={**NOT_FOUND_PROBLEMS, 409: ("invalid_transition",)},
        tag="operators",
    )
)
async def replay(request: web.Request) -> web.Response:
    row = await row_of(request)
    try:
        after = await request.app[STORES].queue.replay_poison(row.request_id, now=None)
    except QueueError as exc:
        raise queue_problem(exc) from None
    return web.json_response(await row_json(request, after))


@routes.post("/v1/workspaces/{ws}/requests/{id}/discard")
@documented(
    Doc(
        "Operators: delete a poison request (and its result blob) instead of replaying it",
        {200: QueueRequest},
        problems={**NOT_FOUND_PROBLEMS, 409: ("not_discardable",)},
        tag="operators",
    )
)
async def discard(request: web.Request) -> web.Response:
    """Delete a poison request for good; answer the row as it was (`status: poison`). Fenced as
    `replay` is: the token must grant the workspace, and the request must be of it. Only poison
    is discarded (409 `not_discardable` otherwise: a done or cancelled row goes by itself after
    `request_retention_seconds`, a live one must be cancelled first). A second discard answers
    404: the row is gone, and an enqueue of its id makes a new one. See docs/queue.md."""
    row = await row_of(request)
    try:
        before = await request.app[STORES].queue.discard_poison(row.request_id)
    except QueueError as exc:
        raise queue_problem(exc) from None
    request.app[METRICS].queue_discarded.inc()
    return web.json_response(await row_json(request, before))


@routes.post("/v1/workspaces/{ws}/requests/{id}/cancel")
@documented(
    Doc(
        "Cancel a request: at once when nobody holds it, else when its holder stops",
        {200: QueueRequest},
        problems={**NOT_FOUND_PROBLEMS, 409: ("not_cancellable",)},
        tag="operators",
    )
)
async def cancel(request: web.Request) -> web.Response:
    """Cancel a request: a pending one is `cancelled` at once; one in progress answers with
    `cancel_requested: true` and becomes `cancelled` once its holder stops (it hears of it at
    its next heartbeat) or its lease lapses. Cancelling twice is answered with the row as it
    stands; a done or poison request answers 409 `not_cancellable`. See docs/queue.md."""
    row = await row_of(request)
    try:
        after = await request.app[STORES].queue.cancel(row.request_id, now=None)
    except QueueError as exc:
        raise queue_problem(exc) from None
    return web.json_response(await row_json(request, after))
