"""Operators' listings of one workspace (what the dashboard reads): its written sub-docs at their
heads, and its live compute locks. See `docs/dashboard.md`.

`GET /v1/workspaces/{ws}/docs?limit=&after=` → `{"docs": [{"sub_doc", "clock", "committed_at"}],
"next_after"}`; `GET /v1/workspaces/{ws}/locks?limit=&after=` → `{"locks": [{"job_id", "task",
"holder", "acquired_at", "expires_at", "expires_in"}], "ttl", "next_after"}`.

Both are keyset-paged: `limit` is 1..1000 (100 by default), and a full page carries `next_after`,
the opaque cursor that asks for the next one (`null` on a last page). A lock's release token is
never listed: it is its holder's capability, and a reader of the listing must not be able to
release a lock it does not hold.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final

import orjson
from aiohttp import web

from cv_mutations import is_valid_sub_doc
from cv_server.http.inputs import check_ids
from cv_server.http.models import DocList, LockList
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.security import authenticate, authorize
from cv_server.keys import CONFIG, STORES

__all__ = ["MAX_PAGE", "page_limit", "routes"]

routes = web.RouteTableDef()

#: The largest page of a listing: the queue listing's bound, so every operator listing pages alike.
MAX_PAGE: Final = 1000
_DEFAULT_PAGE: Final = 100
#: A compute lock's job_id and task are 1..256 characters (`http.locks`).
_MAX_KEY_PART: Final = 256


def page_limit(request: web.Request) -> int:
    """The `limit` query parameter of a listing: 1..MAX_PAGE, 100 when absent (422 otherwise)."""
    raw = request.query.get("limit")
    if raw is None:
        return _DEFAULT_PAGE
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise Problem(422, "invalid_field", f"limit must be an integer in 1..{MAX_PAGE}")
    return limit


#: What both listings take and may answer, as the API document states it.
_PAGING: Final = (
    Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}),
    Param("after", {"type": "string"}, "The next_after of the previous page"),
)
_LISTING_PROBLEMS: Final = {
    401: ("unauthorized",),
    403: ("forbidden_workspace",),
    422: ("invalid_field", "invalid_id"),
}


def _workspace(request: web.Request) -> str:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    authorize(request, workspace_id)
    return workspace_id


@routes.get("/v1/workspaces/{ws}/docs")
@documented(
    Doc(
        "A workspace's written sub-docs the token grants, at their head clocks (paged)",
        {200: DocList},
        params=_PAGING,
        problems=_LISTING_PROBLEMS,
        tag="operators",
    )
)
async def list_docs(request: web.Request) -> web.Response:
    workspace_id = _workspace(request)
    claims = authenticate(request)
    limit = page_limit(request)
    after = request.query.get("after")
    if after is not None and not is_valid_sub_doc(after):
        raise Problem(422, "invalid_field", "after must be the next_after of a listing page")
    docs = await request.app[STORES].oplog.list_sub_docs(workspace_id, after=after, limit=limit)
    next_after = docs[-1].sub_doc if len(docs) == limit else None
    # A token limited to some sub-docs sees only those (docs/operating.md, "Sub-doc grants"):
    # filtered after the page is read, so a page may hold fewer than `limit`, and `next_after`
    # still pages on through the workspace's sub-docs.
    shown = [doc for doc in docs if claims.allows_sub_doc(doc.sub_doc)]
    body = {"docs": [doc.to_json() for doc in shown], "next_after": next_after}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def encode_lock_cursor(job_id: str, task: str) -> str:
    """The `next_after` of a lock listing: the last key, opaque (base64url of a JSON pair)."""
    return base64.urlsafe_b64encode(orjson.dumps([job_id, task])).decode().rstrip("=")


def _lock_cursor(raw: str | None) -> tuple[str, str] | None:
    if raw is None:
        return None
    try:
        key = orjson.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error):
        key = None
    if (
        not isinstance(key, list)
        or len(key) != 2
        or not all(
            isinstance(part, str) and 0 < len(part) <= _MAX_KEY_PART and "\x00" not in part
            for part in key
        )
    ):
        raise Problem(422, "invalid_field", "after must be the next_after of a listing page")
    return key[0], key[1]


@routes.get("/v1/workspaces/{ws}/locks")
@documented(
    Doc(
        "Operators: a workspace's live compute locks, holder and time left (paged)",
        {200: LockList},
        params=_PAGING,
        problems=_LISTING_PROBLEMS,
        tag="operators",
    )
)
async def list_locks(request: web.Request) -> web.Response:
    workspace_id = _workspace(request)
    limit = page_limit(request)
    after = _lock_cursor(request.query.get("after"))
    locks = request.app[STORES].locks
    # The store's clock, as acquire and release judge expiry: what is listed as live is what an
    # acquirer would find held, and `expires_in` is a duration any reader's clock can use.
    now = await locks.clock()
    held = await locks.list_live(workspace_id, now, after=after, limit=limit)
    next_after = encode_lock_cursor(held[-1].job_id, held[-1].task) if len(held) == limit else None
    body = {
        "locks": [
            {
                "job_id": lock.job_id,
                "task": lock.task,
                "holder": lock.holder,
                "acquired_at": lock.acquired_at,
                "expires_at": lock.expires_at,
                "expires_in": lock.expires_at - now,
            }
            for lock in held
        ],
        "ttl": request.app[CONFIG].compute_lock_ttl_seconds,
        "next_after": next_after,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")
