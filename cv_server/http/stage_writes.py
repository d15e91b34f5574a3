"""A stage's writes for the request it holds (docs/queue.md, "Whose grant a stage runs under").

`POST /v1/workspaces/{ws}/requests/{id}/docs/{sub_doc}/ops` applies ops as the op-log route
does, for the worker whose `Claim-Token` holds the request, and only inside the grant recorded
on the request at enqueue: a token limited to `notes*` cannot have a worker write `jobs` for
it. The worker's own token is checked too (scope `work`, its workspaces, its sub-doc grant, by
the scope middleware): the write is allowed where both grants allow it
(tests/worker/test_enqueue_grant.py).
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from cv_server.http.bodies import read_body
from cv_server.http.inputs import check_ids, decode_json, latest_minted_at, parse_apply_body
from cv_server.http.models import ApplyBody, ApplyResults
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.queue import queue_problem, row_of
from cv_server.keys import CONFIG
from cv_server.publish import commit_and_publish
from cv_server.queue import QueueError
from cv_server.queue.model import fence
from cv_server.scopes import grant_allows_sub_doc

__all__ = ["CLAIM_TOKEN", "routes"]

routes = web.RouteTableDef()

#: The holder's claim token, which proves the worker holds the request it writes for.
CLAIM_TOKEN = Param(
    "Claim-Token",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "The claim token the worker got with the request (it must hold the request now)",
    where="header",
)


@routes.post("/v1/workspaces/{ws}/requests/{id}/docs/{sub_doc}/ops")
@documented(
    Doc(
        "A stage's write for the request it holds: ops applied to a sub-doc as by the op-log"
        " route, inside the grant the request was enqueued under",
        {200: ApplyResults},
        body=ApplyBody,
        params=(CLAIM_TOKEN,),
        problems={
            403: ("forbidden_sub_doc",),
            404: ("not_found",),
            409: ("lease_lost",),
            422: ("too_many_ops", "unknown_op_type", "invalid_id"),
        },
        tag="queue",
    )
)
async def post_stage_ops(request: web.Request) -> web.Response:
    sub_doc = request.match_info["sub_doc"]
    check_ids(request.match_info["ws"], sub_doc)
    row = await row_of(request)  # the workspace's grant first: 403 before anything about the call
    claim_token = request.headers.get("Claim-Token", "")
    if not claim_token:
        raise Problem(422, "invalid_field", "the Claim-Token header is required")
    try:
        fence(row, claim_token)
    except QueueError as exc:
        raise queue_problem(exc) from None
    if not grant_allows_sub_doc(row.enqueue_grant, sub_doc):
        # The code the enqueuer itself would get for this sub-doc.
        raise Problem(
            403,
            "forbidden_sub_doc",
            f"request {row.request_id!r} was enqueued by a token that does not grant sub-doc"
            f" {sub_doc!r}",
            sub_doc=sub_doc,
        )
    config = request.app[CONFIG]
    body = decode_json(await read_body(request))
    ops, atomic = parse_apply_body(body, config.max_ops_per_request, latest_minted_at(config))
    outcomes = await asyncio.shield(
        commit_and_publish(request.app, row.workspace_id, sub_doc, ops, atomic)
    )
    answer = orjson.dumps({"results": [outcome.to_json() for outcome in outcomes]})
    return web.Response(body=answer, content_type="application/json")
