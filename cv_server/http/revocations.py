"""The operators' revoke route (docs/operating.md, "Revoking a token"): `cv-server token
revoke ID` over HTTP, for a deployment whose operators hold no database access."""

from __future__ import annotations

from aiohttp import web

from cv_server.auth import ALL_WORKSPACES, token_id_expiry
from cv_server.http.models import TokenRevoked
from cv_server.http.openapi import Doc, documented
from cv_server.http.problems import Problem
from cv_server.http.security import authenticate
from cv_server.keys import REVOCATIONS, STORES

__all__ = ["routes"]

routes = web.RouteTableDef()


@routes.post("/v1/tokens/{token_id}/revoke")
@documented(
    Doc(
        "Operators: revoke a token by its id; refused on every instance from the next request",
        {200: TokenRevoked},
        description=(
            "Needs the `operate` scope and a token of every workspace (`--workspace '*'`): a"
            " token id names no workspace. Open websockets carrying the token close with 4001."
        ),
        problems={403: ("forbidden_workspace",), 422: ("invalid_id",)},
        tag="operators",
    )
)
async def revoke(request: web.Request) -> web.Response:
    claims = authenticate(request)
    if ALL_WORKSPACES not in claims.workspaces:
        raise Problem(403, "forbidden_workspace", "revoking needs a token of every workspace")
    token_id = request.match_info["token_id"]
    try:
        expires_at = token_id_expiry(token_id)
    except ValueError as exc:
        raise Problem(422, "invalid_id", str(exc)) from None
    newly = await request.app[STORES].revocations.revoke(token_id, expires_at)
    # This instance refuses it before answering; the others are told (NOTIFY) or poll.
    await request.app[REVOCATIONS].refresh()
    body = {"token_id": token_id, "revoked": True, "newly": newly, "expires_at": expires_at}
    return web.json_response(body)
