"""The scope middleware: each route's scope (`cv_server.http.routes.ROUTE_SCOPES`) and the
token's sub-doc grant, checked once before any handler runs (docs/operating.md, "Tokens and
scopes").

A request the token may not make is answered `403 missing_scope` (naming the scopes that
would do, in `required_scopes`) or, on a sub-doc route outside the token's grant,
`403 forbidden_sub_doc`; both before the rate limit, so a refused request spends nothing. A
route missing from the table is refused the same way (fail closed; `unscoped_routes` and
tests/server/http/test_scopes.py keep the table whole). The websocket is let through to its
handler, which refuses after the upgrade with a close code and, per frame, with error frames.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from cv_server.http.routes import CHANNEL_ROUTE, ROUTE_SCOPES, SOCKET_ROUTE
from cv_server.http.security import authenticate, check_sub_doc, missing_scope

__all__ = ["scope_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def scope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    match = request.match_info
    resource = match.route.resource
    if match.http_exception is not None or resource is None:
        return await handler(request)  # 404 / 405: nothing to grant
    method = "GET" if request.method == "HEAD" else request.method
    key = (method, resource.canonical)
    accepted = ROUTE_SCOPES.get(key)
    if (accepted is not None and not accepted) or key == SOCKET_ROUTE:
        return await handler(request)
    # The worker channel, a websocket, may carry its token as a subprotocol.
    claims = authenticate(request, allow_subprotocol=key == CHANNEL_ROUTE)
    if accepted is None or not claims.has_any_scope(accepted):
        raise missing_scope(accepted or frozenset())
    sub_doc = match.get("sub_doc")
    if sub_doc is not None:
        check_sub_doc(claims, sub_doc)
    return await handler(request)
