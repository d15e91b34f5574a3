"""The rate-limit middleware: the thin shell around `cv_server.ratelimit` (docs/reliability.md).

Each request's route class is found from its route (`ROUTE_CLASS_OF`); a limited class takes a
token from the bucket of the request's bearer token, or the request is answered
`429 rate_limited` with `Retry-After` (whole seconds) and `retry_after` (seconds, exact) in the
problem document, before its handler runs: a refused request has no effect. Refusals are counted
in `cv_rate_limited_total{route_class}`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from cv_server.http.problems import Problem, problem_response
from cv_server.http.security import authenticated_token
from cv_server.keys import METRICS, RATE_LIMITS
from cv_server.ratelimit import (
    RouteClass,
    retry_after_header,
)

__all__ = ["ROUTE_CLASS_OF", "rate_limit_middleware", "refusal"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_WS: Final = "/v1/workspaces/{ws}"
#: (method, route path) -> route class; a route not listed is never limited.
ROUTE_CLASS_OF: Final[dict[tuple[str, str], RouteClass]] = {
    ("POST", f"{_WS}/docs/{{sub_doc}}/ops"): "ops",
    ("POST", f"{_WS}/requests/{{id}}/docs/{{sub_doc}}/ops"): "ops",  # a stage's writes
    ("GET", f"{_WS}/docs/{{sub_doc}}"): "reads",
    ("GET", f"{_WS}/docs/{{sub_doc}}/ops"): "reads",
    ("GET", f"{_WS}/requests/{{id}}"): "reads",
    ("GET", f"{_WS}/requests/{{id}}/stream"): "reads",
    ("GET", f"{_WS}/blobs/{{ref}}"): "reads",
    ("GET", f"{_WS}/docs"): "reads",
    ("GET", f"{_WS}/locks"): "reads",
    ("POST", f"{_WS}/requests"): "enqueue",
    ("POST", f"{_WS}/requests/batch"): "enqueue",
    ("POST", f"{_WS}/schedules"): "enqueue",
    ("POST", f"{_WS}/schedules/{{name}}/run"): "enqueue",
    ("GET", f"{_WS}/schedules"): "reads",
    ("GET", f"{_WS}/schedules/{{name}}"): "reads",
    ("DELETE", f"{_WS}/schedules/{{name}}"): "queue",
    ("POST", f"{_WS}/schedules/{{name}}/pause"): "queue",
    ("POST", f"{_WS}/schedules/{{name}}/resume"): "queue",
    ("POST", "/v1/queue/claim"): "claim",
    ("GET", "/v1/queue/pending"): "claim",
    ("GET", "/v1/queue/requests"): "claim",
    ("POST", "/v1/queue/complete"): "queue",
    ("POST", "/v1/tokens/{token_id}/revoke"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/heartbeat"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/complete"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/fail"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/replay"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/discard"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/result"): "queue",
    ("POST", f"{_WS}/requests/{{id}}/cancel"): "queue",
    ("POST", f"{_WS}/locks/acquire"): "locks",
    ("POST", f"{_WS}/locks/release"): "locks",
    ("GET", f"{_WS}/socket"): "socket",
    # The worker channel's handshake; its frames pay the classes of the verbs they stand for
    # (`cv_server.http.worker_channel`).
    ("GET", "/v1/queue/channel"): "socket",
}


def refusal(route_class: RouteClass, wait: float) -> Problem:
    """The answer to a request of `route_class` whose bucket is empty for `wait` more seconds."""
    return Problem(
        429,
        "rate_limited",
        f"too many {route_class} requests for this token; retry in {wait:.3f} s",
        headers={"Retry-After": retry_after_header(wait)},
        retry_after=round(wait, 3),
        route_class=route_class,
    )


@web.middleware
async def rate_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    limits = request.app[RATE_LIMITS]
    if not limits.enabled:
        return await handler(request)
    route = request.match_info.route.resource
    cls = ROUTE_CLASS_OF.get((request.method, route.canonical)) if route is not None else None
    if cls is None:
        return await handler(request)
    allow_query = cls == "socket"
    try:
        token, _ = authenticated_token(
            request, allow_query=allow_query, allow_subprotocol=allow_query
        )
    except Problem:
        return await handler(request)  # its route answers 401; nothing to count it against
    wait = limits.take(cls, token)
    if wait > 0:
        request.app[METRICS].count_rate_limited(cls)
        return problem_response(refusal(cls, wait))
    return await handler(request)
