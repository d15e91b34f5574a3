"""`GET /dashboard`: the operator dashboard, plain HTML, JS and CSS served from package data (no
build step, nothing loaded from another origin). See `docs/dashboard.md`.

The page itself is public, like any static file: it holds no data. Every data call it makes
carries the operator's bearer token (`Authorization` on HTTP, the `cv-bearer.` subprotocol on the
websocket), which the operator enters in the page or passes in the URL fragment (`#token=...`),
which browsers never send to a server. The strict Content-Security-Policy lets the page run its
own script and talk to this origin only: no inline script, no other host, no framing.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Final

from aiohttp import web

from cv_server.http.openapi import Doc, Media, documented
from cv_server.http.problems import Problem

__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "routes"]

routes = web.RouteTableDef()

#: The files of the page, by the name it is served under, with their content type.
ASSETS: Final = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}

CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Small files, and a new server version must not run yesterday's script against its API.
    "Cache-Control": "no-cache",
}


@functools.cache
def _asset(name: str) -> bytes:
    return resources.files("cv_server").joinpath("dashboard", name).read_bytes()


def _serve(name: str) -> web.Response:
    return web.Response(
        body=_asset(name), content_type=ASSETS[name], charset="utf-8", headers=_HEADERS
    )


@routes.get("/dashboard")
@documented(
    Doc(
        "The operator dashboard (the page; its data calls carry the token)",
        {200: Media("text/html")},
        auth=False,
        tag="operations",
    )
)
async def dashboard(request: web.Request) -> web.Response:
    return _serve("index.html")


@routes.get("/dashboard/{name}")
@documented(
    Doc(
        "A file of the dashboard page (script, style)",
        {200: Media("text/plain")},
        problems={404: ("not_found",)},
        auth=False,
        tag="operations",
    )
)
async def dashboard_asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise Problem(404, "not_found", f"no dashboard file {name!r}")
    return _serve(name)
