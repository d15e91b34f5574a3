"""HTTP routes of results too large for a request row (the claim check of docs/queue.md): the claim
holder uploads one (`POST .../requests/{id}/result`), the requester downloads it
(`GET .../blobs/{ref}`), byte for byte.

The upload's body is the result's JSON itself, fenced by the claim token in its `Claim-Token`
header and bounded by `ServerConfig.max_result_bytes`, not by the `max_body_bytes` every other
body keeps: a result of several MB must complete on its first attempt. The completion then
names the stored blob (`blob_ref`, checked by `http.queue`). See docs/queue.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import orjson
from aiohttp import web

from cv_server.http.bodies import read_body
from cv_server.http.inputs import check_ids
from cv_server.http.models import UploadAnswer
from cv_server.http.openapi import Doc, Media, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.queue import (
    HOLDER_PROBLEMS,
    NOT_FOUND_PROBLEMS,
    queue_problem,
    row_of,
    storable,
)
from cv_server.http.security import authorize
from cv_server.keys import CONFIG, STORES
from cv_server.queue import QueueError
from cv_server.queue.model import fence

__all__ = ["CLAIM_TOKEN_HEADER", "routes"]

routes = web.RouteTableDef()


@routes.get("/v1/workspaces/{ws}/blobs/{ref}")
@documented(
    Doc(
        "A large result, by the `blob_ref` of its request",
        {200: Media("application/octet-stream", {"type": "string", "format": "binary"})},
        problems=NOT_FOUND_PROBLEMS,
        tag="queue",
    )
)
async def get_blob(request: web.Request) -> web.Response:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    authorize(request, workspace_id)
    ref = request.match_info["ref"]
    data = (
        await request.app[STORES].blobs.get(workspace_id, ref, time.time())
        if storable(ref)
        else None
    )
    if data is None:
        raise Problem(404, "not_found", "no such blob (or it expired)")
    return web.Response(body=data, content_type="application/octet-stream")


#: The header that carries the claim token of a result upload (its body is the result itself).
CLAIM_TOKEN_HEADER: Final = "Claim-Token"


def _too_large(limit: int) -> Problem:
    return Problem(
        413,
        "result_too_large",
        f"the result is larger than this server's max_result_bytes ({limit} bytes): complete "
        "the request with an error payload instead (see docs/queue.md)",
        max_result_bytes=limit,
    )


async def _read_result(request: web.Request, limit: int) -> bytes:
    """The upload's body, decoded (`read_body`), refused with 413 `result_too_large` as soon as
    it passes `limit` bytes, before or after decoding."""
    try:
        return await read_body(request, limit=limit)
    except Problem as problem:
        if problem.code == "body_too_large":
            raise _too_large(limit) from None
        raise


@routes.post("/v1/workspaces/{ws}/requests/{id}/result")
@documented(
    Doc(
        "Workers: upload a large result (the body is its JSON) to complete with by `blob_ref`",
        {201: UploadAnswer},
        body=Media("application/json", {}, "The result itself, any JSON"),
        params=(
            Param(
                "Claim-Token",
                {"type": "string", "minLength": 1, "maxLength": 256},
                "The holder's claim token",
                where="header",
                required=True,
            ),
        ),
        problems={**HOLDER_PROBLEMS, 413: ("result_too_large",)},
        tag="workers",
    )
)
async def upload_result(request: web.Request) -> web.Response:
    """Store a large result in the blob store for the claim holder to complete with: the body
    is the result's JSON, sent as is and served back byte for byte by `GET .../blobs/{ref}`;
    the claim token travels in the `Claim-Token` header. Answers 201 `{"blob_ref", "bytes"}`;
    409 `lease_lost` (nothing stored) unless the token holds the request; 413
    `result_too_large` past `max_result_bytes` (before or after decoding its Content-Encoding,
    as every body: docs/limits.md); 400 `malformed_json` if the body is not JSON."""
    row = await row_of(request)
    token = request.headers.get(CLAIM_TOKEN_HEADER, "")
    if not token or not token.isprintable() or len(token) > 256:
        raise Problem(422, "invalid_field", f"the {CLAIM_TOKEN_HEADER} header is required")
    try:  # before reading: a holder whose lease is gone must not make the server store a copy
        fence(row, token)
    except QueueError as exc:
        raise queue_problem(exc) from None
    stores, config = request.app[STORES], request.app[CONFIG]
    data = await _read_result(request, config.max_result_bytes)
    try:  # several MB: parsed off the event loop
        await asyncio.to_thread(orjson.loads, data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Problem(400, "malformed_json", f"the result is not JSON: {exc}") from None
    blob_ref = await stores.blobs.put(row.workspace_id, data, time.time())
    return web.json_response({"blob_ref": blob_ref, "bytes": len(data)}, status=201)
