"""`create_app(config)`: the aiohttp application factory (STYLE: aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from cv_server import observe
from cv_server.backends import open_stores
from cv_server.compaction import compact_forever
from cv_server.config import ServerConfig
from cv_server.http.models import Health, Ready
from cv_server.http.openapi import Doc, Media, build_document, documented, render_docs_page
from cv_server.http.problems import Problem, problem_response
from cv_server.http.ratelimit import rate_limit_middleware
from cv_server.http.routes import ROUTE_SCOPES, ROUTE_TABLES
from cv_server.http.scoping import scope_middleware
from cv_server.http.storage_faults import storage_problem
from cv_server.hub import Connection, Hub
from cv_server.keys import (
    CONFIG,
    CONNECTIONS,
    HUB,
    METRICS,
    RATE_LIMITS,
    REVOCATIONS,
    REVOKED_TOKENS,
    ROUTE_SCOPE_TABLE,
    SCHEDULER,
    STATE,
    STORES,
    TOKEN_SECRET,
    WAITERS,
    WORK_SIGNALS,
    ServerState,
)
from cv_server.metrics import CONTENT_TYPE, Metrics
from cv_server.ratelimit import RateLimits
from cv_server.reaper import reap_forever
from cv_server.revocation_follow import RevocationFollower
from cv_server.revocations import RevokedTokens
from cv_server.schedules.firing import Fired, Scheduler
from cv_server.secret import TokenSecret
from cv_server.stores import Stores
from cv_server.waiters import Waiters, WorkSignals

__all__ = ["create_app"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Where aiohttp's quote of a malformed request begins (`...: b'GET /x?token=... HTTP/1.1'`).
_QUOTED_INPUT = re.compile(r":?\s*(?:b'|b\"|bytearray\().*", re.DOTALL)
_TOKEN_LIKE = re.compile(r"(cvt1\.|token=|Bearer\s+)[^\s&'\"]*", re.IGNORECASE)


class _MalformedRequestLog(logging.Filter):
    """Rewrites aiohttp's report of a request it could not parse (`aiohttp.server`).

    aiohttp logs it at ERROR with a traceback whose message quotes the offending line: a
    `?token=` (how a browser reaches the socket) or an Authorization header with one stray
    byte put a valid bearer token, in full, in the server's log. It is the client's error, so
    one WARNING line naming what was wrong, without the quoted input and without a traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            what = _QUOTED_INPUT.sub("", exc.message.strip().partition("\n")[0]).rstrip(":. ")
            what = _TOKEN_LIKE.sub(r"\1<redacted>", what)
            record.msg, record.args = "%s: %s %s", (record.getMessage(), type(exc).__name__, what)
            record.exc_info, record.exc_text = None, None
            if record.levelno > logging.WARNING:  # BadHttpMethod is already DEBUG: left so
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_MALFORMED_REQUEST_LOG: Final = _MalformedRequestLog()


@web.middleware
async def problems_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as problem+json with a stable code; nothing takes the server down."""
    try:
        return await handler(request)
    except Problem as problem:
        return _problem(request, problem)
    except web.HTTPRequestEntityTooLarge as exc:
        return _problem(request, Problem(413, "body_too_large", exc.text or ""))
    except web.HTTPNotFound:
        return _problem(request, Problem(404, "not_found", f"no route for {request.path}"))
    except web.HTTPMethodNotAllowed:
        return _problem(request, Problem(405, "method_not_allowed", request.method))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (a plain GET on the socket route: "No WebSocket UPGRADE hdr")
        # went out as text/plain with no `code`; every error is problem+json (docs/protocol.md).
        code = "bad_request" if exc.status < 500 else "internal"
        return _problem(request, Problem(exc.status, code, exc.text or exc.reason))
    except Exception as exc:
        storage = storage_problem(request.app, exc)
        if storage is not None and not request.writer.output_size:
            log.warning("%s %s: %s", request.method, request.path, storage.detail)
            return _problem(request, storage)
        log.exception("unhandled error on %s %s", request.method, request.path)
        if request.writer.output_size:
            # A response (a websocket's 101) has gone out: an HTTP answer written now would land
            # inside the upgraded stream. aiohttp closes the connection instead.
            raise
        return _problem(request, Problem(500, "internal", "unexpected server error"))


def _problem(request: web.Request, problem: Problem) -> web.Response:
    return problem_response(problem, request.app[CONFIG].problem_type_base)


async def _stores_ctx(app: web.Application) -> AsyncIterator[None]:
    stores = await open_stores(app[CONFIG])
    app[STORES] = stores
    token_secret = TokenSecret(stores.secret)
    app[TOKEN_SECRET] = token_secret
    hub = Hub(stores.oplog)
    app[HUB] = hub
    if stores.follow_commits is not None:  # PostgreSQL: commits of the other instances
        await stores.follow_commits(hub.notify_head, hub.wake_all)
    # PostgreSQL: `cv-server rotate-secret` takes effect on every running instance. A secret
    # given in the config is not the database's, so a rotation there does not replace it.
    if stores.follow_secret is not None and app[CONFIG].token_secret is None:
        await stores.follow_secret(token_secret.replace)
    # Revoked tokens are read before the first request is served: a restart never forgets one.
    revocations = RevocationFollower(
        stores.revocations, app[REVOKED_TOKENS], poll_seconds=app[CONFIG].revocation_poll_seconds
    )
    await revocations.refresh()
    revocations.start()
    app[REVOCATIONS] = revocations
    if stores.follow_revocations is not None:  # PostgreSQL: told by NOTIFY, not the poll
        await stores.follow_revocations(revocations.wake)
    metrics = app[METRICS]
    metrics.gauge(
        "cv_ws_connections", "Open websockets (this process).", lambda: len(app[CONNECTIONS])
    )
    metrics.gauge(
        "cv_subscriptions",
        "Live sub-doc subscriptions (this process).",
        lambda: hub.subscriber_count,
    )
    observe.watch_stores(app, stores)
    config = app[CONFIG]
    waiters = Waiters(stores.queue, sweep_seconds=config.sweep_seconds)
    waiters.start()
    app[WAITERS] = waiters
    signals = WorkSignals(stores.queue)
    app[WORK_SIGNALS] = signals
    metrics.gauge(
        "cv_request_waiters",
        "Clients waiting on a request's outcome (streams, this process).",
        lambda: waiters.count,
    )
    scheduler = _scheduler(stores, config, metrics)
    scheduler.start()
    app[SCHEDULER] = scheduler
    reaper = asyncio.create_task(reap_forever(stores, config, metrics))
    compactor = asyncio.create_task(compact_forever(stores, config, metrics))
    app[STATE].ready = True
    log.info("stores open, serving", extra={"step": "ready"})
    yield
    app[STATE].ready = False
    log.info("stopping: closing request waiters and stores", extra={"step": "close_stores"})
    for task in (reaper, compactor):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await scheduler.close()
    await revocations.close()
    await waiters.close()
    signals.close()
    # In-flight commits finished before cleanup (the runner waited for handlers); now flush.
    await stores.close()
    log.info("stores closed", extra={"step": "stores_closed"})


def _scheduler(stores: Stores, config: ServerConfig, metrics: Metrics) -> Scheduler:
    """The loop that fires schedules (docs/queue.md, "Schedules"). An embedded server is the
    only process serving its file, so it is the scheduler at once, under one fixed owner; an
    instance on a shared database competes for the lease under an owner of its own."""
    sole = stores.follow_commits is None

    def on_fired(fired: Fired, now: float) -> None:
        for slot, enqueued in zip(fired.slots, fired.enqueued, strict=True):
            if not enqueued.coalesced:
                metrics.schedule_firings.inc()
                metrics.schedule_lateness.observe(max(0.0, now - slot))
        if fired.advanced:
            metrics.schedule_skips.labels("overlap").inc(fired.overlap_skipped)
            metrics.schedule_skips.labels("missed").inc(fired.missed_skipped)

    return Scheduler(
        stores.schedules,
        stores.queue,
        owner="embedded"
        if sole
        else f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}",
        lease_seconds=config.scheduler_lease_seconds,
        heartbeat_seconds=config.scheduler_heartbeat_seconds,
        recheck_seconds=config.sweep_seconds,
        catch_up_limit=config.schedule_catch_up_limit,
        max_dequeues=config.max_dequeues,
        on_fired=on_fired,
        sole_instance=sole,
    )


async def _on_shutdown(app: web.Application) -> None:
    """Stop accepting work and close every socket with 1001 (going away)."""
    app[STATE].shutting_down = True
    app[STATE].ready = False
    log.info(
        "shutting down: closing %d websockets",
        len(app[CONNECTIONS]),
        extra={"step": "close_sockets"},
    )
    app[WAITERS].release_all()  # request streams end now, not at their deadline
    app[WORK_SIGNALS].release_all()  # and idle workers' long polls, not at their 2 s ceiling
    connections = app[CONNECTIONS]
    closing = [conn.close(1001, b"server shutting down") for conn in list(connections)]
    tasks = [task for task in closing if task is not None]
    if tasks:  # the close handshake, bounded: a dead peer must not hold the shutdown up
        await asyncio.wait(tasks, timeout=5)


routes = web.RouteTableDef()


@routes.get("/healthz")
@documented(Doc("Liveness: the process serves", {200: Health}, auth=False, tag="operations"))
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
@documented(
    Doc(
        "Readiness: stores open and the database reachable (route traffic here)",
        {200: Ready},
        problems={503: ("unavailable", "storage_unavailable")},
        auth=False,
        tag="operations",
    )
)
async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.ready or state.shutting_down:
        raise Problem(503, "unavailable", "not ready")
    # A load balancer routes by this answer. While the database is unreachable every route
    # answers 5xx, so the instance is not ready (tests/acceptance/
    # test_postgres_connection_chaos.py); /healthz stays 200, since a restart would not bring the
    # database back. One cheap read; no timeout
    # of our own (none is configured): the prober's own timeout bounds a hung one, and on
    # PostgreSQL the statement_timeout guard does.
    try:
        await request.app[STORES].oplog.head("readyz", "readyz")
    except Exception:
        raise Problem(503, "unavailable", "the database is unreachable") from None
    await _check_writes(request.app)
    return web.json_response({"status": "ready"})


async def _check_writes(app: web.Application) -> None:
    """After a write was refused for storage, one probe write: while the storage still refuses
    it, 503 `storage_unavailable` (reads are served, writes are not; docs/operating.md, "Storage
    faults"); once it succeeds the fault is cleared and the instance is ready again. Without a
    refusal since the last success, nothing is written."""
    stores = app[STORES]
    if stores.faults.fault is None or stores.probe_write is None:
        return
    try:
        await stores.probe_write()
    except Exception as exc:
        problem = storage_problem(app, exc, what="reads are served, writes are refused")
        if problem is None:
            raise Problem(503, "unavailable", "the database is unreachable") from None
        raise problem from None
    stores.faults.wrote()


@routes.get("/metrics")
@documented(
    Doc(
        "Prometheus metrics (text exposition format 0.0.4; docs/observability.md)",
        {200: Media("text/plain")},
        auth=False,
        tag="operations",
    )
)
async def metrics(request: web.Request) -> web.Response:
    body = await request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _document(app: web.Application) -> dict[str, Any]:
    """Built once per app, on first use: the routes do not change once it serves."""
    document = app[STATE].openapi
    if document is None:
        document = app[STATE].openapi = build_document(app)
    return document


@routes.get("/openapi.json")
@documented(
    Doc(
        "This document: OpenAPI 3.1 of every route",
        {200: Media("application/json", {"type": "object"})},
        auth=False,
        tag="operations",
    )
)
async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(_document(request.app))


@routes.get("/docs")
@documented(
    Doc(
        "This document for people: plain HTML, no script, works offline",
        {200: Media("text/html")},
        auth=False,
        tag="operations",
    )
)
async def docs_page(request: web.Request) -> web.Response:
    return web.Response(text=render_docs_page(_document(request.app)), content_type="text/html")


def create_app(config: ServerConfig) -> web.Application:
    """Build the application. Stores open in `cleanup_ctx`, i.e. when the app starts."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        # Scopes before rate limits: a request its token may not make spends no bucket.
        middlewares=[
            observe.observe_middleware,
            problems_middleware,
            scope_middleware,
            rate_limit_middleware,
        ],
        # Bodies are decoded by `bodies.read_body`, which answers a bad or unknown coding with
        # its own code and holds the limit on the decoded size (docs/limits.md).
        handler_args={"auto_decompress": False},
    )
    server_log = logging.getLogger("aiohttp.server")
    if _MALFORMED_REQUEST_LOG not in server_log.filters:
        server_log.addFilter(_MALFORMED_REQUEST_LOG)
    app[CONFIG] = config
    app[STATE] = ServerState()
    app[METRICS] = Metrics()
    app[RATE_LIMITS] = RateLimits(config)
    app[REVOKED_TOKENS] = RevokedTokens()
    app[ROUTE_SCOPE_TABLE] = ROUTE_SCOPES
    connections: set[Connection] = set()
    app[CONNECTIONS] = connections
    app.cleanup_ctx.append(_stores_ctx)
    app.on_shutdown.append(_on_shutdown)
    app.on_response_prepare.append(observe.echo_request_id)
    app.add_routes(routes)
    for table in ROUTE_TABLES:
        app.add_routes(table)
    return app
