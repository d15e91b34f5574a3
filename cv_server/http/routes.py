"""Every route table of the HTTP edge, in the order the app adds them (`create_app`)."""

from __future__ import annotations

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
    socket,
)

__all__ = ["ROUTE_TABLES"]

ROUTE_TABLES: Final[tuple[web.RouteTableDef, ...]] = (
    docs.routes,
    socket.routes,
    queue.routes,
    results.routes,
    queue_operators.routes,
    locks.routes,
    listings.routes,
    dashboard.routes,
)
