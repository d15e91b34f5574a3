"""What the server tells operators about itself: one log line (and the HTTP metrics) per request
and websocket session, request ids, and the queue and op-log observers behind the metrics and
the queue's log lines (docs/observability.md).

Log lines carry their fields as `LogRecord` attributes (`extra=`): the JSON format writes each as
a member, the text format as `key=value` (`cv_mutations.logs`). No line carries a header,
a query string or a body: tokens travel in those, and must never reach a log.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from cv_server.keys import METRICS
from cv_server.metrics import Metrics
from cv_server.queue.model import RequestEvent
from cv_server.stores import Stores

__all__ = [
    "IDLE_POLLS",
    "REQUEST_ID",
    "REQUEST_ID_HEADER",
    "access_level",
    "echo_request_id",
    "observe_middleware",
    "request_id_of",
    "route_template",
    "valid_request_id",
    "watch_stores",
]

access_log = logging.getLogger("cv_server.access")
queue_log = logging.getLogger("cv_server.queue")

REQUEST_ID_HEADER: Final = "X-Request-ID"
REQUEST_ID: Final = web.RequestKey("request_id", str)

#: A caller's request id is kept when it is 1..128 of these characters (what tracing systems and
#: proxies send: uuids, hex trace ids, `abc`); anything else is replaced by a minted one, so a log
#: line never carries a caller's arbitrary bytes (a newline would forge a line, a token would
#: leak one).
_REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9._:@-]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The idle workers' polls: answered 204, they found no work. An idle worker sends one every
#: 2 s at most (two idle workers: ~117 lines a minute, two thirds of an idle server's terminal),
#: so these are DEBUG lines; the same routes answered with work, or refused, stay INFO
#: (`tests/observe/test_access_log.py`).
IDLE_POLLS: Final = frozenset({("GET", "/v1/queue/pending"), ("POST", "/v1/queue/claim")})


def access_level(method: str, route: str, status: int) -> int:
    """The level of a request's access line: DEBUG for an idle poll that found nothing, INFO
    for every other request (docs/observability.md)."""
    idle = status == 204 and (method, route) in IDLE_POLLS
    return logging.DEBUG if idle else logging.INFO


def valid_request_id(value: str | None) -> bool:
    return value is not None and _REQUEST_ID_RE.fullmatch(value) is not None


def request_id_of(request: web.Request) -> str:
    """The request's id: the caller's `X-Request-ID` when valid, else one minted for it."""
    found = request.get(REQUEST_ID)
    if found is None:
        given = request.headers.get(REQUEST_ID_HEADER)
        found = given if given is not None and valid_request_id(given) else secrets.token_hex(8)
        request[REQUEST_ID] = found
    return found


def route_template(request: web.Request) -> str:
    """The matched route's template (`/v1/workspaces/{ws}/docs/{sub_doc}`), never the raw path:
    ids in paths would give every workspace and request a label set of its own."""
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """On every response, streams and websocket upgrades included (before their headers go)."""
    response.headers[REQUEST_ID_HEADER] = request_id_of(request)


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: sees the final status (problem answers included) and the whole duration."""
    request_id = request_id_of(request)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # the problems middleware answers every error; not these
        status = exc.status
        raise
    finally:
        seconds = time.perf_counter() - started
        route = route_template(request)
        request.app[METRICS].record_request(route, status, seconds)
        level = access_level(request.method, route, status)
        if access_log.isEnabledFor(level):  # an idle poll's line costs nothing when not shown
            websocket = status == 101
            access_log.log(
                level,
                "%s %s %d %.1f ms",
                "websocket session" if websocket else request.method,
                route,
                status,
                seconds * 1000,
                extra={
                    "event": "ws_session" if websocket else "http_request",
                    "method": request.method,
                    "route": route,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                    "workspace": request.match_info.get("ws"),
                    "request_id": request_id,
                },
            )


# -- the stores ----------------------------------------------------------------------------------


def watch_stores(app: web.Application, stores: Stores) -> None:
    """Hang this app's metrics and queue log on `stores` (called once they are open)."""
    metrics = app[METRICS]
    stores.oplog.observe_commits(metrics.record_group_commit)
    stores.queue.add_observer(lambda event: _on_transition(metrics, event))
    statuses = ("pending", "in_progress", "done", "poison", "cancelled")

    async def read_queue_counts() -> None:
        metrics.set_queue_counts(await stores.queue.status_counts(), statuses)

    metrics.on_scrape(read_queue_counts)
    refused = metrics.storage_writes_refused
    counted = 0

    async def count_refusals() -> None:
        # The backend counts refusals (the SQLite writer thread among them); the counter
        # catches up to that count at each scrape, so it never runs ahead of it.
        nonlocal counted
        total = stores.faults.refusals
        if total > counted:
            refused.inc(total - counted)
            counted = total

    metrics.on_scrape(count_refusals)


def _on_transition(metrics: Metrics, event: RequestEvent) -> None:
    """One committed queue transition of this process: its counters and its log line."""
    row = event.row
    if row is None or event.kind is None:
        return
    kind = event.kind
    if event.lapsed:
        metrics.queue_lease_lapses.inc()
        log_transition("lease_lapsed", event)
    if event.status == "cancelled":  # by the cancel itself, or when its holder let go
        metrics.queue_cancelled.inc()
        log_transition("cancelled", event)
        return
    if kind == "cancelled":  # asked for while a worker holds it: it stops at its next beat
        log_transition("cancel_requested", event)
        return
    if kind == "enqueued":
        metrics.queue_enqueued.inc()
    elif kind == "claimed":
        metrics.queue_claimed.inc()
        if row.claimed_at is not None and not event.lapsed:
            # Claimable since `available_at` (enqueue, the end of a backoff, a replay). A lapsed
            # lease was claimable since it lapsed, which the claimed row no longer shows.
            metrics.queue_wait.observe(max(0.0, row.claimed_at - row.available_at))
    elif kind == "done":
        metrics.queue_done.inc()
        metrics.record_telemetry(row.stage, row.telemetry)
        if row.claimed_at is not None and row.finished_at is not None:
            metrics.stage_seconds.labels(row.stage).observe(
                max(0.0, row.finished_at - row.claimed_at)
            )
    elif kind == "failed":
        metrics.queue_failed.inc()
    elif kind == "replayed":
        metrics.queue_replayed.inc()
    if event.status == "poison" and kind in ("failed", "poisoned"):
        metrics.queue_poisoned.inc()
    log_transition(kind, event)
    if kind == "failed" and event.status == "poison":
        log_transition("poisoned", event)


def log_transition(kind: str, event: RequestEvent) -> None:
    row = event.row
    fields: dict[str, object] = {
        "event": f"queue_{kind}",
        "queue_request_id": event.request_id,
        "workspace": event.workspace_id,
        "status": event.status,
        "run": event.run,
    }
    if row is not None:
        fields.update(stage=row.stage, dequeue_count=row.dequeue_count)
        if row.claimed_by is not None and kind in ("claimed", "done", "failed"):
            fields["worker"] = row.claimed_by
        if kind in ("failed", "poisoned") and isinstance(row.error, dict):
            code = row.error.get("code")
            if isinstance(code, str):
                fields["error_code"] = code[:64]
    queue_log.info("queue %s %s", kind, event.request_id, extra=fields)


def log_coalesced(workspace_id: str, request_id: str, status: str, stage: str) -> None:
    """An enqueue absorbed by an existing request: no write, so no store event; logged here."""
    queue_log.info(
        "queue coalesced %s",
        request_id,
        extra={
            "event": "queue_coalesced",
            "queue_request_id": request_id,
            "workspace": workspace_id,
            "status": status,
            "stage": stage,
        },
    )
