"""Every route table of the HTTP edge, in the order the app adds them (`create_app`), and the
one table of the scope each route requires (`ROUTE_SCOPES`; docs/operating.md, "Tokens and
scopes", is rendered from it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from aiohttp import web

from cv_server.http import (
    dashboard,
    docs,
    listings,
    locks,
    queue,
    queue_operators,
    results,
    revocations,
    schedules,
    socket,
    stage_writes,
    worker_channel,
)

__all__ = [
    "CHANNEL_ROUTE",
    "PUBLIC",
    "ROUTE_SCOPES",
    "ROUTE_TABLES",
    "SOCKET_ROUTE",
    "render_scope_table",
    "unscoped_routes",
]

ROUTE_TABLES: Final[tuple[web.RouteTableDef, ...]] = (
    docs.routes,
    socket.routes,
    queue.routes,
    stage_writes.routes,
    results.routes,
    queue_operators.routes,
    locks.routes,
    listings.routes,
    dashboard.routes,
    revocations.routes,
    worker_channel.routes,
    schedules.routes,
)

#: A route anyone may call, without a token.
PUBLIC: Final[frozenset[str]] = frozenset()

_WS: Final = "/v1/workspaces/{ws}"
#: The websocket: its handshake needs a scope of some frame kind, and each frame its own
#: (`cv_server.http.socket.FRAME_SCOPES`), refused by an error frame, never the socket.
SOCKET_ROUTE: Final = ("GET", f"{_WS}/socket")
#: The worker channel: its token may come as a subprotocol too (`cv_server.http.worker_channel`).
CHANNEL_ROUTE: Final = ("GET", "/v1/queue/channel")

#: (method, route path) -> the scopes that may call it (any one of them). Every route is here:
#: `unscoped_routes` names one that is not, and the scope middleware (`cv_server.http.scoping`)
#: refuses it. The only place a route's scope is written (tests/server/http/test_scopes.py).
ROUTE_SCOPES: Final[Mapping[tuple[str, str], frozenset[str]]] = {
    # The op-log: sub-doc routes are also held to the token's sub-doc grant.
    ("POST", f"{_WS}/docs/{{sub_doc}}/ops"): frozenset({"write"}),
    ("GET", f"{_WS}/docs/{{sub_doc}}"): frozenset({"read"}),
    ("GET", f"{_WS}/docs/{{sub_doc}}/ops"): frozenset({"read"}),
    ("GET", f"{_WS}/docs"): frozenset({"read"}),  # lists only the granted sub-docs
    SOCKET_ROUTE: frozenset({"read", "write"}),
    # Enqueuers: their workspace's requests; operators too (the dashboard).
    ("POST", f"{_WS}/requests"): frozenset({"enqueue"}),
    ("POST", f"{_WS}/requests/batch"): frozenset({"enqueue"}),
    ("GET", f"{_WS}/requests/{{id}}"): frozenset({"enqueue", "operate"}),
    ("GET", f"{_WS}/requests/{{id}}/stream"): frozenset({"enqueue", "operate"}),
    ("POST", f"{_WS}/requests/{{id}}/cancel"): frozenset({"enqueue", "operate"}),
    ("GET", f"{_WS}/blobs/{{ref}}"): frozenset({"enqueue", "operate"}),
    # Schedules: enqueuers add and fire them (under their own grant); operators may also
    # read, pause, resume and delete them.
    ("POST", f"{_WS}/schedules"): frozenset({"enqueue"}),
    ("GET", f"{_WS}/schedules"): frozenset({"enqueue", "operate"}),
    ("GET", f"{_WS}/schedules/{{name}}"): frozenset({"enqueue", "operate"}),
    ("DELETE", f"{_WS}/schedules/{{name}}"): frozenset({"enqueue", "operate"}),
    ("POST", f"{_WS}/schedules/{{name}}/pause"): frozenset({"enqueue", "operate"}),
    ("POST", f"{_WS}/schedules/{{name}}/resume"): frozenset({"enqueue", "operate"}),
    ("POST", f"{_WS}/schedules/{{name}}/run"): frozenset({"enqueue"}),
    # Workers.
    ("POST", "/v1/queue/claim"): frozenset({"work"}),
    ("GET", "/v1/queue/pending"): frozenset({"work"}),
    CHANNEL_ROUTE: frozenset({"work"}),
    ("POST", "/v1/queue/complete"): frozenset({"work"}),
    ("POST", f"{_WS}/requests/{{id}}/heartbeat"): frozenset({"work"}),
    ("POST", f"{_WS}/requests/{{id}}/complete"): frozenset({"work"}),
    ("POST", f"{_WS}/requests/{{id}}/fail"): frozenset({"work"}),
    ("POST", f"{_WS}/requests/{{id}}/result"): frozenset({"work"}),
    # A stage's write, also held to the grant its request was enqueued under.
    ("POST", f"{_WS}/requests/{{id}}/docs/{{sub_doc}}/ops"): frozenset({"work"}),
    ("POST", f"{_WS}/locks/acquire"): frozenset({"work"}),
    ("POST", f"{_WS}/locks/release"): frozenset({"work"}),
    # Operators.
    ("GET", "/v1/queue/requests"): frozenset({"operate"}),
    ("POST", f"{_WS}/requests/{{id}}/replay"): frozenset({"operate"}),
    ("POST", f"{_WS}/requests/{{id}}/discard"): frozenset({"operate"}),
    ("GET", f"{_WS}/locks"): frozenset({"operate"}),
    ("POST", "/v1/tokens/{token_id}/revoke"): frozenset({"operate"}),  # and every workspace
    # The server itself: probes, metrics, this document, the dashboard's page.
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/dashboard"): PUBLIC,
    ("GET", "/dashboard/{name}"): PUBLIC,
}


def unscoped_routes(app: web.Application) -> list[str]:
    """Routes of `app` with no entry in `ROUTE_SCOPES` (HEAD, aiohttp's shadow of GET, aside)."""
    missing = set()
    for route in app.router.routes():
        resource = route.resource
        if resource is None or route.method in ("HEAD", "*"):
            continue
        if (route.method, resource.canonical) not in ROUTE_SCOPES:
            missing.add(f"{route.method} {resource.canonical}")
    return sorted(missing)


def render_scope_table() -> str:
    """`ROUTE_SCOPES` and the socket's frames as the Markdown table of docs/operating.md
    (between its `scopes:begin` / `scopes:end` markers; tests/server/http/test_scopes.py
    holds the page to it)."""
    lines = ["| route | scope (any one) |", "| --- | --- |"]
    for (method, path), scopes in sorted(ROUTE_SCOPES.items(), key=lambda kv: kv[0][::-1]):
        needed = ", ".join(f"`{s}`" for s in sorted(scopes)) or "none (public)"
        lines.append(f"| `{method} {path}` | {needed} |")
    for kind, scope in socket.FRAME_SCOPES.items():
        lines.append(f"| websocket frame `{kind}` | `{scope}` |")
    return "\n".join(lines) + "\n"
