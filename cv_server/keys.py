"""Typed application state (`web.AppKey`), in one place so every module agrees on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from cv_server.config import ServerConfig

if TYPE_CHECKING:
    from cv_server.hub import Connection, Hub
    from cv_server.metrics import Metrics
    from cv_server.ratelimit import RateLimits
    from cv_server.revocation_follow import RevocationFollower
    from cv_server.revocations import RevokedTokens
    from cv_server.schedules.firing import Scheduler
    from cv_server.secret import TokenSecret
    from cv_server.stores import Stores
    from cv_server.waiters import Waiters, WorkSignals

__all__ = [
    "CONFIG",
    "CONNECTIONS",
    "HUB",
    "METRICS",
    "RATE_LIMITS",
    "REVOCATIONS",
    "REVOKED_TOKENS",
    "ROUTE_SCOPE_TABLE",
    "SCHEDULER",
    "STATE",
    "STORES",
    "TOKEN_SECRET",
    "WAITERS",
    "WORK_SIGNALS",
]


class ServerState:
    """Lifecycle flags readiness depends on."""

    def __init__(self) -> None:
        self.ready = False
        self.shutting_down = False
        #: The OpenAPI document of the app, built on first use (`GET /openapi.json`).
        self.openapi: dict[str, Any] | None = None


CONFIG = web.AppKey("config", ServerConfig)
STORES: web.AppKey[Stores] = web.AppKey("stores")
HUB: web.AppKey[Hub] = web.AppKey("hub")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
RATE_LIMITS: web.AppKey[RateLimits] = web.AppKey("rate_limits")
#: The secret tokens are checked with now (replaced on PostgreSQL by `cv-server rotate-secret`).
TOKEN_SECRET: web.AppKey[TokenSecret] = web.AppKey("token_secret")
STATE = web.AppKey("state", ServerState)
WAITERS: web.AppKey[Waiters] = web.AppKey("waiters")
WORK_SIGNALS: web.AppKey[WorkSignals] = web.AppKey("work_signals")
SCHEDULER: web.AppKey[Scheduler] = web.AppKey("scheduler")
CONNECTIONS: web.AppKey[set[Connection]] = web.AppKey("connections")
#: The token ids this server refuses (`cv_server.revocations.RevokedTokens`), kept current by
#: `REVOCATIONS` (`cv_server.revocation_follow.RevocationFollower`).
REVOKED_TOKENS: web.AppKey[RevokedTokens] = web.AppKey("revoked_tokens")
REVOCATIONS: web.AppKey[RevocationFollower] = web.AppKey("revocations")
#: The scope table of the app's routes (`cv_server.http.routes.ROUTE_SCOPES`), for the OpenAPI
#: document, which cannot import the routes it documents.
ROUTE_SCOPE_TABLE: web.AppKey[Mapping[tuple[str, str], frozenset[str]]] = web.AppKey(
    "route_scope_table"
)
