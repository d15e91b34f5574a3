"""HTTP routes of the op-log (docs/protocol.md): apply ops, read state, read ops since a clock."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from cv_server.http.bodies import read_body
from cv_server.http.inputs import (
    MAX_CLOCK,
    check_ids,
    decode_json,
    latest_minted_at,
    parse_apply,
)
from cv_server.http.models import ApplyBody, ApplyResults, DocState, OpsPage
from cv_server.http.openapi import Doc, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.queue import apply_enqueue, apply_enqueue_answers, queue_problem
from cv_server.http.ratelimit import refusal
from cv_server.http.security import authenticated_token, authorize
from cv_server.keys import CONFIG, METRICS, RATE_LIMITS, STORES
from cv_server.oplog.pipeline import op_ids_to_look_up
from cv_server.publish import commit_and_publish, commit_enqueue_and_publish, conflict_of
from cv_server.queue import QueueError

__all__ = ["routes"]

routes = web.RouteTableDef()


@routes.post("/v1/workspaces/{ws}/docs/{sub_doc}/ops")
@documented(
    Doc(
        "Apply ops to a sub-doc, in order (each at most once: a repeated op_id is answered from "
        "its record)",
        {200: ApplyResults},
        body=ApplyBody,
        problems={
            403: ("missing_scope",),
            409: ("version_conflict", "request_id_conflict"),
            422: ("too_many_ops", "unknown_op_type", "invalid_id", "invalid_field"),
        },
        tag="op-log",
    )
)
async def post_ops(request: web.Request) -> web.Response:
    workspace_id, sub_doc = request.match_info["ws"], request.match_info["sub_doc"]
    check_ids(workspace_id, sub_doc)
    claims = authorize(request, workspace_id)
    config = request.app[CONFIG]
    body = decode_json(await read_body(request))
    apply = parse_apply(body, config.max_ops_per_request, latest_minted_at(config))
    enqueued: list[dict[str, object]] | None = None
    if apply.enqueue is None:
        outcomes = await asyncio.shield(
            commit_and_publish(
                request.app, workspace_id, sub_doc, apply.ops, apply.atomic, apply.if_clock
            )
        )
    else:
        # The ops and the requests commit in one transaction or not at all
        # (docs/queue.md#start-work-with-the-change-that-needs-it).
        asks = apply_enqueue(
            workspace_id,
            sub_doc,
            apply.enqueue,
            op_ids_to_look_up(apply.ops),
            config.max_dequeues,
            claims,
        )
        # The work an apply enqueues pays as a batch enqueue does: one token of the `enqueue`
        # bucket besides the `ops` one the middleware took (docs/queue.md).
        token, _ = authenticated_token(request)
        wait = request.app[RATE_LIMITS].take("enqueue", token)
        if wait > 0:
            request.app[METRICS].count_rate_limited("enqueue")
            raise refusal("enqueue", wait)
        try:
            done = await asyncio.shield(
                commit_enqueue_and_publish(
                    request.app,
                    workspace_id,
                    sub_doc,
                    apply.ops,
                    asks,
                    apply.atomic,
                    apply.if_clock,
                )
            )
        except QueueError as exc:
            raise queue_problem(exc) from None
        outcomes = done.outcomes
        enqueued = await apply_enqueue_answers(request, asks, done.enqueued)
    conflict = conflict_of(outcomes)
    if conflict is not None:
        # Nothing of the batch was applied (docs/ops.md#conflicts): the client reads the
        # sub-doc again from `clock` and retries with new op_ids.
        raise Problem(
            409,
            "version_conflict",
            conflict.message,
            clock=conflict.clock,
            results=[outcome.to_json() for outcome in outcomes],
        )
    answer: dict[str, object] = {"results": [outcome.to_json() for outcome in outcomes]}
    if enqueued is not None:
        answer["enqueued"] = enqueued
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


@routes.get("/v1/workspaces/{ws}/docs/{sub_doc}")
@documented(Doc("The sub-doc's state at its head clock", {200: DocState}, tag="op-log"))
async def get_doc(request: web.Request) -> web.Response:
    workspace_id, sub_doc = request.match_info["ws"], request.match_info["sub_doc"]
    check_ids(workspace_id, sub_doc)
    authorize(request, workspace_id)
    clock, state = await request.app[STORES].oplog.get_state(workspace_id, sub_doc)
    return web.json_response({"clock": clock, "state": state.to_json()})


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Problem(400, "invalid_field", f"{name} must be an integer") from None
    if not low <= value <= high:
        raise Problem(400, "invalid_field", f"{name} must be between {low} and {high}")
    return value


@routes.get("/v1/workspaces/{ws}/docs/{sub_doc}/ops")
@documented(
    Doc(
        "Committed ops after clock `since`, oldest first (catch-up)",
        {200: OpsPage},
        params=(
            Param("since", {"type": "integer", "minimum": 0}, "Ops with a clock above this"),
            Param("limit", {"type": "integer", "minimum": 1}, "At most this many (a page)"),
        ),
        problems={400: ("invalid_field",), 410: ("log_compacted",)},
        tag="op-log",
    )
)
async def get_ops(request: web.Request) -> web.Response:
    workspace_id, sub_doc = request.match_info["ws"], request.match_info["sub_doc"]
    check_ids(workspace_id, sub_doc)
    authorize(request, workspace_id)
    page = request.app[CONFIG].catchup_page
    since = _int_param(request, "since", 0, 0, MAX_CLOCK)
    limit = _int_param(request, "limit", page, 1, page)
    oplog = request.app[STORES].oplog
    head, entries = await oplog.read_since(workspace_id, sub_doc, since, limit)
    # The log is the gap-free range [horizon, head]: a first entry past `since + 1` (or none
    # below a head past `since`) means the ops after `since` were compacted.
    if (entries and entries[0].clock > since + 1) or (not entries and head > since):
        horizon = await oplog.horizon(workspace_id, sub_doc)
        state_url = request.path.removesuffix("/ops")
        raise Problem(
            410,
            "log_compacted",
            f"the ops after clock {since} were compacted; the log starts at clock {horizon}:"
            f" read the state at {state_url}, then the ops after its clock",
            horizon=horizon,
            clock=head,
            state_url=state_url,
        )
    return web.json_response({"clock": head, "ops": [entry.to_json() for entry in entries]})
