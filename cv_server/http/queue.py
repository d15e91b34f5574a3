"""HTTP routes of the work queue (layer 1, docs/protocol.md, docs/queue.md): enqueue, read and
stream a request, and the worker verbs (claim / heartbeat / complete / fail). The upload and
download of large results are in `http.results`, the operators' verbs (list, replay, cancel) in
`http.queue_operators`; both use this module's request helpers (`row_of`, `row_json`, ...).

A completion may name an uploaded result (`blob_ref`) instead of carrying it: it is checked to
be a blob of the request's workspace (docs/queue.md).

The queue verbs are given `now=None`: the store takes the time from its own clock
(`QueueStore.clock`), which on PostgreSQL is the database's, shared by every instance. This
server's wall clock may be off (an NTP step, a misconfigured host): judged on it, a live lease
looked lapsed (the stage ran twice) and backed-off or abandoned work was handed out late. The
times in the answers (`lease_expires_at`, `available_at`) are on the store's clock; workers use
only their differences (the lease granted = `lease_expires_at - claimed_at`).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import orjson
from aiohttp import web

from cv_server.auth import TokenClaims
from cv_server.http.answers import json_answer
from cv_server.http.bodies import read_body
from cv_server.http.inputs import check_ids, decode_json
from cv_server.http.models import (
    BATCH_ITEMS_MAX,
    BatchCompleteBody,
    BatchCompleteClaimed,
    BatchCompleteResults,
    BatchEnqueueBody,
    BatchEnqueueResults,
    ClaimBody,
    ClaimMany,
    ClaimOne,
    ClaimTokenBody,
    CompleteAnswer,
    CompleteBody,
    CompleteClaimed,
    EnqueueAnswer,
    EnqueueBody,
    FailAnswer,
    FailBody,
    FailClaimed,
    HeartbeatAnswer,
    Pending,
    QueueRequest,
    RefusedClaimed,
    parse_body,
)
from cv_server.http.openapi import Doc, Media, Param, documented
from cv_server.http.problems import Problem
from cv_server.http.security import authenticate, authorize, missing_scope
from cv_server.keys import CONFIG, METRICS, STORES, WAITERS, WORK_SIGNALS
from cv_server.observe import log_coalesced
from cv_server.queue import (
    ClaimAsk,
    Completion,
    EnqueueAsk,
    Enqueued,
    InProgress,
    KeyCompletion,
    Mismatch,
    NewRequest,
    Owned,
    ProcessRequest,
    QueueError,
    StoredAnswer,
    StoredResponse,
    deterministic_request_id,
    grant_scoped_key,
    random_request_id,
    request_fingerprint,
)
from cv_server.queue.model import fence, input_differs
from cv_server.scopes import enqueue_grant, grant_scope_key

__all__ = ["apply_enqueue", "apply_enqueue_answers", "apply_request_hex", "routes"]

T = TypeVar("T")

routes = web.RouteTableDef()

NOT_FOUND_PROBLEMS = {404: ("not_found",)}
HOLDER_PROBLEMS = {404: ("not_found",), 409: ("lease_lost", "cancelled")}
_TIMEOUT = Param("timeout", {"type": "number"}, "Seconds to wait at most (clamped)")

_ERROR_STATUS = {
    "not_found": 404,
    "lease_lost": 409,
    "invalid_transition": 409,
    "request_id_conflict": 409,
    "idempotency_key_lost": 409,
    "cancelled": 409,
    "not_cancellable": 409,
    "not_discardable": 409,
}


def queue_problem(exc: QueueError) -> Problem:
    return Problem(_ERROR_STATUS.get(exc.code, 409), exc.code, exc.message)


async def _json_body(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    raw = await read_body(request)
    body = decode_json(raw) if raw else {}
    if not isinstance(body, dict):
        raise Problem(400, "malformed_json", "body must be a JSON object")
    return raw, body


def storable(text: str) -> bool:
    """PostgreSQL text cannot hold NUL: such a string (stage, job_id, a claim token, a request
    id or blob ref in the path) made the store raise, a 500 where SQLite answered 4xx. Refused
    (or not found) the same way on both backends."""
    return "\x00" not in text


def _payload(body: dict[str, Any], name: str) -> Any:
    """The JSON member `name` (input, result, error, telemetry) a request row will keep; 422 if
    nested past what orjson writes (255 levels, as `inputs.parse_ops` for ops). A row holding a
    payload ~500 levels deep was stored but could not be read back (Python's recursion limit):
    its GET, stream and its workspace's listing answered 500 for good, and each claim of it
    committed but answered 500, losing every attempt until it turned poison.

    orjson also refuses an integer past 64 bits (`decode_json` reads one exactly, as ops do),
    and such a payload was refused as "nested too deeply", naming a nesting the client never
    sent: the answer says which of the two it is."""
    value = body.get(name)
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        reason = "holds an integer past 64 bits" if "64-bit" in str(exc) else "is nested too deeply"
        raise Problem(422, "invalid_field", f"{name} {reason}") from None
    return value


def _telemetry(body: dict[str, Any]) -> Any:
    """The worker's telemetry, or None when the route could not store it (nested too deeply, an
    integer past 64 bits): telemetry is fire-and-forget, so what is wrong with it never fails
    the completion it rides on (`tests/observe/test_metrics_workload.py` pins it)."""
    try:
        return _payload(body, "telemetry")
    except Problem:
        return None


def _patience(request: web.Request, ceiling: float) -> float:
    """The `?timeout=` seconds of a wait, within 0..`ceiling` (`ceiling` when absent).

    NaN is refused like any non-number: `float()` reads "nan", and min/max let it through as 0,
    so a client whose deadline arithmetic went wrong got an instant answer and polled in a
    tight loop instead of hearing about its bug. A negative or infinite wait is clamped.
    """
    raw = request.query.get("timeout")
    if raw is None:
        return ceiling
    try:
        timeout = float(raw)
    except ValueError:
        timeout = math.nan
    if math.isnan(timeout):
        raise Problem(400, "invalid_field", "timeout must be a number of seconds")
    return max(0.0, min(timeout, ceiling))


def _stream_url(row: ProcessRequest) -> str:
    return f"/v1/workspaces/{row.workspace_id}/requests/{row.request_id}/stream"


def _enqueue_answer(enqueued: Enqueued, req: NewRequest) -> dict[str, Any]:
    """`input_differs`: the enqueue coalesced into a request whose stored input differs from
    the one sent, which was therefore not used (see docs/queue.md); coalescing goes on."""
    row = enqueued.row
    return {
        "request_id": row.request_id,
        "status": row.status,
        "coalesced": enqueued.coalesced,
        "input_differs": input_differs(enqueued, req),
        "stream_url": _stream_url(row),
    }


def _new_request(
    workspace_id: str,
    body: dict[str, Any],
    max_dequeues: int,
    claims: TokenClaims,
    random_hex: str | None = None,
) -> tuple[NewRequest, bool]:
    """The request `body` asks for; `max_dequeues` is the server's setting, used unless the
    body names its own. The request records the grant of the verified `claims`, never of the
    body, and a limited grant is part of its deterministic id (docs/queue.md, "Whose grant a
    stage runs under"). `random_hex`: the 40 hex chars of a non-deterministic id (None: drawn
    now; an apply's `enqueue` derives them from its op_ids, `apply_enqueue`)."""
    grant = enqueue_grant(claims.scopes, claims.sub_docs)
    asked = parse_body(EnqueueBody, body)
    stage, job_id, branch_path = asked.stage, asked.job_id, asked.branch_path
    deterministic = job_id is not None if asked.deterministic is None else asked.deterministic
    rerun = asked.rerun
    # Where the stage declares it, re-enqueueing must not fork the work.
    request_id = (
        deterministic_request_id(workspace_id, job_id, branch_path, stage, grant_scope_key(grant))
        if deterministic
        else random_request_id(random_hex or secrets.token_hex(20))
    )
    # The poison cutoff is the server's `max_dequeues` (`--set max_dequeues=N`), not
    # `NewRequest`'s default, which is frozen to `ServerConfig()`'s value at import. A body's
    # own is bounded by the store's column (PostgreSQL integer; `EnqueueBody`): a larger count
    # reached the store and failed there, a 500 (clients retry a 500).
    if asked.max_dequeues is not None:
        max_dequeues = asked.max_dequeues
    try:
        req = NewRequest(
            workspace_id=workspace_id,
            stage=stage,
            request_id=request_id,
            input=_payload(body, "input"),
            job_id=job_id,
            branch_path=branch_path,
            worker_class=asked.worker_class,
            max_dequeues=max_dequeues,
            enqueue_grant=grant,
            concurrency_key=asked.concurrency_key,
            max_running_per_key=asked.max_running_per_key,
        )
    except ValueError as exc:
        raise Problem(422, "invalid_field", str(exc)) from None
    return req, rerun


#: The enqueue routes' optional header (`_once_per_key`), as the OpenAPI document shows it.
IDEMPOTENCY_KEY: Final = Param(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "Retry-safe: the same key and body replay the first answer (`Idempotency-Replayed: true`)"
    " for 24 h; 1..255 printable characters",
    where="header",
)


@routes.post("/v1/workspaces/{ws}/requests")
@documented(
    Doc(
        "Queue a stage run (or coalesce into the live request of the same id)",
        {202: EnqueueAnswer},
        body=EnqueueBody,
        params=(IDEMPOTENCY_KEY,),
        answer_headers={202: ("Idempotency-Replayed",)},
        problems={
            409: ("request_id_conflict", "idempotency_key_in_progress", "idempotency_key_lost"),
            422: ("idempotency_key_reuse",),
        },
        tag="queue",
    )
)
async def enqueue(request: web.Request) -> web.Response:
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    claims = authorize(request, workspace_id)
    raw, body = await _json_body(request)
    req, rerun = _new_request(workspace_id, body, request.app[CONFIG].max_dequeues, claims)
    queue = request.app[STORES].queue
    enqueued = await _once_per_key(
        request,
        workspace_id,
        claims,
        raw,
        lambda key: queue.enqueue(req, now=None, rerun=rerun, idempotency=key),
        lambda answer: StoredResponse(202, _enqueue_answer(answer, req)),
    )
    if isinstance(enqueued, web.Response):  # the key's stored answer
        return enqueued
    _count_coalesced(request, enqueued)
    return json_answer(_enqueue_answer(enqueued, req), status=202)


async def _once_per_key(
    request: web.Request,
    workspace_id: str,
    claims: TokenClaims,
    raw: bytes,
    write: Callable[[KeyCompletion[T] | None], Awaitable[T]],
    respond: Callable[[T], StoredResponse],
) -> T | web.Response:
    """`write` under the request's `Idempotency-Key`, if any (docs/queue.md): the value it
    committed, the key's answer completed in the same transaction; or, for a key already
    answered, that stored answer, replayed. A `QueueError` becomes its problem.

    The key is scoped to the workspace and to the grant of `claims` (`grant_scoped_key`): a
    token of another grant sending the same key and body gets its own answer, never this one."""
    stores = request.app[STORES]
    key = request.headers.get("Idempotency-Key")
    if key is None:
        try:
            return await write(None)
        except QueueError as exc:
            raise queue_problem(exc) from None

    # Printable text only: a header that is not UTF-8 reaches us with lone surrogates, which no
    # store can encode; it is refused as a 422, never a 500 that clients would retry.
    if not 0 < len(key) <= 255 or not key.isprintable():
        raise Problem(422, "invalid_field", "Idempotency-Key must be 1..255 printable chars")
    key = grant_scoped_key(key, grant_scope_key(enqueue_grant(claims.scopes, claims.sub_docs)))
    # Fingerprint of the raw bytes as received, scoped to the workspace.
    fingerprint = request_fingerprint("POST", request.path_qs, raw)
    # The key's 24 h retention (docs/configuration.md) is judged on this server's clock: a skew of
    # minutes moves a key's expiry by minutes out of a day, and whether its owner is alive is
    # decided by a lock, not by time (pg/idempotency.py). Not worth a round trip per enqueue.
    begun = await stores.idempotency.begin(workspace_id, key, fingerprint, time.time())
    if isinstance(begun, StoredAnswer):
        return json_answer(
            begun.body, status=begun.status_code, headers={"Idempotency-Replayed": "true"}
        )
    if isinstance(begun, InProgress):
        raise Problem(
            409,
            "idempotency_key_in_progress",
            "the first request with this key is still running",
            headers={"Retry-After": "1"},
        )
    if isinstance(begun, Mismatch):
        raise Problem(422, "idempotency_key_reuse", "the key was used for a different request")
    assert isinstance(begun, Owned)
    completion = KeyCompletion(workspace_id, key, fingerprint, respond)
    try:
        try:
            return await write(completion)
        except BaseException as exc:
            await stores.idempotency.abandon(workspace_id, key, time.time())
            if isinstance(exc, QueueError):
                raise queue_problem(exc) from None
            raise
    finally:
        # Only after the answer committed (or the key was abandoned): on PostgreSQL ownership is
        # a held connection and its advisory lock, and a retry that finds the lock free while
        # the key is still in progress takes it over as the key of a dead owner.
        await begun.release()


def _count_coalesced(request: web.Request, enqueued: Enqueued) -> None:
    """An enqueue that an existing request absorbed wrote nothing, so the store announced
    nothing: counted and logged here (the ones that wrote are counted by the store's observer)."""
    if enqueued.coalesced:
        row = enqueued.row
        request.app[METRICS].queue_coalesced.inc()
        log_coalesced(row.workspace_id, row.request_id, row.status, row.stage)


async def row_of(request: web.Request) -> ProcessRequest:
    """The request the route's path names (`{ws}`, `{id}`), once the token is checked to grant
    its workspace; 404 `not_found` if there is none there."""
    return (await _claims_and_row(request))[1]


async def _claims_and_row(request: web.Request) -> tuple[TokenClaims, ProcessRequest]:
    """`row_of`, and the token's claims (the scope of a `claim_next`)."""
    workspace_id, request_id = request.match_info["ws"], request.match_info["id"]
    check_ids(workspace_id)
    claims = authorize(request, workspace_id)
    row = (
        await request.app[STORES].queue.get(workspace_id, request_id)
        if storable(request_id)
        else None
    )
    if row is None:
        raise Problem(404, "not_found", f"no request {request_id!r} in {workspace_id!r}")
    return claims, row


async def row_json(request: web.Request, row: ProcessRequest) -> dict[str, Any]:
    """The row as a requester sees it, with how long it has waited unclaimed, judged on the
    store's clock (the one its times are on)."""
    return row.to_json(now=await request.app[STORES].queue.clock())


@routes.get("/v1/workspaces/{ws}/requests/{id}")
@documented(Doc("One queue request", {200: QueueRequest}, problems=NOT_FOUND_PROBLEMS, tag="queue"))
async def get_request(request: web.Request) -> web.Response:
    return json_answer(await row_json(request, await row_of(request)))


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@routes.get("/v1/workspaces/{ws}/requests/{id}/stream")
@documented(
    Doc(
        "Server-sent events: `queued`, then `done` (the row) or `error` at the deadline",
        {200: Media("text/event-stream", description="SSE: queued, then done or error")},
        params=(_TIMEOUT,),
        problems={**NOT_FOUND_PROBLEMS, 400: ("invalid_field",)},
        tag="queue",
    )
)
async def stream_request(request: web.Request) -> web.StreamResponse:
    """SSE: `queued` (if not finished), then the row once it finished — `done` (done or poison)
    or `cancelled` — or `error` `wait_timeout` at the deadline.

    The result lives on the row, so a dropped stream simply reconnects (or polls) without loss.
    """
    row = await row_of(request)
    config = request.app[CONFIG]
    timeout = _patience(request, config.waiter_deadline_seconds)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    def hung_up() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    if not row.is_finished:
        await response.write(_sse("queued", await row_json(request, row)))
        latest = await request.app[WAITERS].wait(
            row.workspace_id, row.request_id, timeout, abandoned=hung_up
        )
        if hung_up():  # nobody left to tell (and a write would raise); the row keeps the outcome
            return response
        row = latest or row
    if row.status == "cancelled":
        await response.write(_sse("cancelled", row.to_json()))
    elif row.is_finished:
        await response.write(_sse("done", row.to_json()))
    else:  # The deadline only ends the wait; the work goes on, the row keeps its result
        await response.write(
            _sse(
                "error",
                {"code": "wait_timeout", "request_id": row.request_id, "status": row.status},
            )
        )
    await response.write_eof()
    return response


# -- workers ---------------------------------------------------------------------------------------


@routes.post("/v1/queue/claim")
@documented(
    Doc(
        "Workers: take the oldest claimable request(s) of their classes, under a lease",
        {200: (ClaimOne, ClaimMany), 204: None},
        body=ClaimBody,
        tag="workers",
    )
)
async def claim(request: web.Request) -> web.Response:
    claims = authenticate(request)
    _, body = await _json_body(request)
    parsed = parse_body(ClaimBody, body)
    asked = _claim_ask(request, claims, parsed)
    queue = request.app[STORES].queue
    if parsed.limit is not None:  # batched: one transaction (one commit) for `limit` rows
        rows = await queue.claim_many(
            asked.worker_classes,
            asked.worker_id,
            asked.lease,
            now=None,
            limit=asked.limit,
            workspace_ids=asked.workspace_ids,
        )
        if not rows:
            return web.Response(status=204)
        return json_answer({"requests": _claimed_json(rows)})
    row = await queue.claim(
        asked.worker_classes,
        asked.worker_id,
        asked.lease,
        now=None,
        workspace_ids=asked.workspace_ids,
    )
    if row is None:
        return web.Response(status=204)
    return json_answer({"request": row.to_json(include_claim_token=True)})


def _claim_ask(request: web.Request, claims: TokenClaims, asked: ClaimBody) -> ClaimAsk:
    """What a claim body asks for, as the store takes it: the server's lease, the token's
    workspaces (None: all), `limit` 1 when the body names none. The claim route and every
    report's `claim_next` read a body through this one function, so the two cannot drift."""
    return ClaimAsk(
        worker_classes=asked.worker_classes,
        worker_id=asked.worker_id or "anonymous",
        lease=request.app[CONFIG].lease_seconds,
        limit=1 if asked.limit is None else asked.limit,
        workspace_ids=None if "*" in claims.workspaces else sorted(claims.workspaces),
    )


def _claimed_json(rows: list[ProcessRequest]) -> list[dict[str, Any]]:
    """Claimed rows as the claim route renders them (with their claim tokens)."""
    return [row.to_json(include_claim_token=True) for row in rows]


def _refused_json(exc: QueueError) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message}


@routes.post("/v1/queue/complete")
@documented(
    Doc(
        "Workers: complete many requests in one transaction (one outcome per item);"
        " `claim_next` claims in the same one",
        {200: (BatchCompleteResults, BatchCompleteClaimed)},
        body=BatchCompleteBody,
        problems={403: ("forbidden_workspace",)},
        tag="workers",
    )
)
async def complete_batch(request: web.Request) -> web.Response:
    """Complete many requests in one transaction: `{"completions": [{"request_id",
    "claim_token", "result"? | "blob_ref"?, "error"?, "cache"?, "telemetry"?}]}` → one outcome
    per item, in order (`{"request_id", "status"}` or `{"request_id", "error": {"code",
    "message"}}`). A `blob_ref` names an uploaded result (`POST .../result`). With
    `claim_next`, the answer adds `claimed`: the rows claimed in the same transaction."""
    claims = authenticate(request)
    _, body = await _json_body(request)
    items = body.get("completions")
    if not isinstance(items, list) or not 0 < len(items) <= BATCH_ITEMS_MAX:
        raise Problem(
            422, "invalid_field", f"completions must be a list of 1..{BATCH_ITEMS_MAX} items"
        )
    stores, config = request.app[STORES], request.app[CONFIG]
    asked = parse_body(BatchCompleteBody, body)  # payloads are checked one by one below
    claim_next = _next_ask(request, claims, asked.claim_next)
    completions: list[Completion] = []
    for item, parsed in zip(items, asked.completions, strict=True):
        result = _payload(item, "result")
        encoded = json.dumps(result, separators=(",", ":")).encode()
        blob_ref = item.get("blob_ref")
        if blob_ref is not None and not isinstance(blob_ref, str):
            raise Problem(422, "invalid_field", "blob_ref must be the reference of an upload")
        try:
            completions.append(
                Completion(
                    request_id=parsed.request_id,
                    claim_token=parsed.claim_token,
                    result=result,
                    error=_payload(item, "error"),
                    blob_ref=blob_ref,
                    cache=parsed.cache,
                    telemetry=_telemetry(item),
                )
            )
        except ValueError as exc:
            raise Problem(422, "invalid_field", str(exc)) from None
        if len(encoded) > config.blob_threshold_bytes:
            raise Problem(422, "invalid_field", "large results must use the single complete route")
    rows = await stores.queue.get_many([c.request_id for c in completions])
    for row in rows:  # every request of the batch must be in a workspace the token grants
        if not claims.allows(row.workspace_id):
            raise Problem(
                403, "forbidden_workspace", f"the token does not grant {row.workspace_id!r}"
            )
    workspaces = {row.request_id: row.workspace_id for row in rows}
    for completion, item in zip(completions, items, strict=True):
        if completion.blob_ref is not None and completion.request_id in workspaces:
            await _uploaded(request, workspaces[completion.request_id], item)
    claimed: list[ProcessRequest] | None = None
    if claim_next is None:
        outcomes = await stores.queue.complete_many(completions, now=None)
    else:
        outcomes, claimed = await stores.queue.complete_then_claim(
            completions, now=None, claim_next=claim_next
        )
    answers: list[dict[str, Any]] = []
    for completion, outcome in zip(completions, outcomes, strict=True):
        if isinstance(outcome, QueueError):
            answers.append({"request_id": completion.request_id, "error": _refused_json(outcome)})
        else:
            answers.append({"request_id": completion.request_id, "status": outcome.status})
    if claimed is None:
        return json_answer({"results": answers})
    return json_answer({"results": answers, "claimed": _claimed_json(claimed)})


def _next_ask(
    request: web.Request, claims: TokenClaims, asked: ClaimBody | None
) -> ClaimAsk | None:
    """A report's `claim_next`, as the claim route reads its body (`_claim_ask`). Parsed with
    the report's body, before anything is written: a bad one is refused (422) whole."""
    return None if asked is None else _claim_ask(request, claims, asked)


@routes.get("/v1/queue/pending")
@documented(
    Doc(
        "Workers: long poll until work of their classes is claimable (200, at once if some"
        " already is) or the timeout (204)",
        {200: Pending, 204: None},
        params=(
            Param(
                "worker_classes",
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 64},
                    "minItems": 1,
                },
                "Repeatable",
                required=True,
            ),
            _TIMEOUT,
        ),
        problems={400: ("invalid_field",), 422: ("invalid_field",)},
        tag="workers",
    )
)
async def wait_for_work(request: web.Request) -> web.Response:
    """Long poll for idle workers: 200 as soon as work of `worker_classes` (repeatable query
    parameter) is claimable in a workspace the token grants — at once if some already is
    (pending, or under a lapsed lease), else when some becomes pending — and 204 after
    `timeout` seconds (at most the 2 s ceiling of the idle poll, docs/queue.md)."""
    claims = authenticate(request)
    named = request.query.getall("worker_classes", [])
    if not named:
        raise Problem(422, "invalid_field", "name at least one worker_classes")
    # Read as a claim's are (1..64 characters, no NUL): they reach the store.
    classes = frozenset(parse_body(ClaimBody, {"worker_classes": named}).worker_classes)
    patience = _patience(request, 2.0)
    workspaces = None if "*" in claims.workspaces else frozenset(claims.workspaces)
    queue = request.app[STORES].queue

    def pending_now() -> Awaitable[bool]:
        return queue.has_claimable(tuple(classes), None, workspace_ids=workspaces)

    woken = await request.app[WORK_SIGNALS].wait(
        classes, workspaces, patience, pending_now=pending_now
    )
    return json_answer({"pending": True}) if woken else web.Response(status=204)


@routes.post("/v1/workspaces/{ws}/requests/{id}/heartbeat")
@documented(
    Doc(
        "Workers: extend the lease",
        {200: HeartbeatAnswer},
        body=ClaimTokenBody,
        problems=HOLDER_PROBLEMS,
        tag="workers",
    )
)
async def heartbeat(request: web.Request) -> web.Response:
    row = await row_of(request)
    _, body = await _json_body(request)
    config = request.app[CONFIG]
    token = parse_body(ClaimTokenBody, body).claim_token
    try:
        row = await request.app[STORES].queue.heartbeat(
            row.request_id, token, config.lease_seconds, now=None
        )
    except QueueError as exc:
        raise queue_problem(exc) from None
    return json_answer({"lease_expires_at": row.lease_expires_at})


async def _uploaded(request: web.Request, workspace_id: str, item: dict[str, Any]) -> str | None:
    """The `blob_ref` a completion names (an uploaded result), checked to be a blob of the
    request's workspace; None when it names none. A completion naming a blob carries no
    inline result."""
    blob_ref = item.get("blob_ref")
    if blob_ref is None:
        return None
    if not isinstance(blob_ref, str) or not 0 < len(blob_ref) <= 256 or not storable(blob_ref):
        raise Problem(422, "invalid_field", "blob_ref must be the reference of an upload")
    if item.get("result") is not None:
        raise Problem(422, "invalid_field", "a completion names a blob_ref or a result, not both")
    size = await request.app[STORES].blobs.size(workspace_id, blob_ref, time.time())
    if size is None:
        raise Problem(422, "invalid_field", f"blob_ref {blob_ref!r} names no blob (or it expired)")
    return blob_ref


@routes.post("/v1/workspaces/{ws}/requests/{id}/complete")
@documented(
    Doc(
        "Workers: the run's answer (a result, or an expected error); only after its writes."
        " `claim_next` claims in the same transaction",
        {200: (CompleteAnswer, CompleteClaimed, RefusedClaimed)},
        body=CompleteBody,
        problems=HOLDER_PROBLEMS,
        tag="workers",
    )
)
async def complete(request: web.Request) -> web.Response:
    """The holder's completion. With `claim_next` it and the claim commit together and the
    answer adds `claimed`; a refused completion (`lease_lost`, ...) is then answered 200 with
    its `error` next to `claimed`, since the claim went ahead (docs/queue.md;
    `tests/server/http/test_queue_claim_next.py` pins both)."""
    claims, row = await _claims_and_row(request)
    _, body = await _json_body(request)
    asked = parse_body(CompleteBody, body)
    claim_next = _next_ask(request, claims, asked.claim_next)
    token, cache = asked.claim_token, asked.cache
    result, error = _payload(body, "result"), _payload(body, "error")
    telemetry = _telemetry(body)
    stores, config = request.app[STORES], request.app[CONFIG]
    blob_ref = await _uploaded(request, row.workspace_id, body)
    encoded = json.dumps(result, separators=(",", ":")).encode()
    if blob_ref is None and len(encoded) > config.blob_threshold_bytes:  # Claim check
        # Answer a retried or refused completion before storing its payload: a holder retrying
        # after a lost answer stored every attempt's copy, and a holder whose lease was lost
        # stored one the row would never name; each stayed for the whole blob retention (24 h).
        # The store fences again below (the row may change meanwhile); this only saves the put.
        # With `claim_next` the store still answers it (its claim goes ahead): no put either.
        retried = row.status == "done" and row.claim_token == token
        if retried and claim_next is None:
            return json_answer({"status": row.status})
        try:
            if not retried:
                fence(row, token)
        except QueueError as exc:
            if claim_next is None:
                raise queue_problem(exc) from None
            result = None
        else:
            if not retried:
                blob_ref = await stores.blobs.put(row.workspace_id, encoded, time.time())
            result = None
    completion = Completion(
        request_id=row.request_id,
        claim_token=token,
        result=result,
        error=error,
        blob_ref=blob_ref,
        cache=cache,
        telemetry=telemetry,
    )
    if claim_next is not None:
        (outcome,), claimed = await stores.queue.complete_then_claim(
            [completion], now=None, claim_next=claim_next
        )
        return _then_claimed(outcome, claimed, {"status"})
    try:
        done = await stores.queue.complete(
            row.request_id,
            token,
            result,
            now=None,
            error=error,
            blob_ref=blob_ref,
            cache=cache,
            telemetry=telemetry,
        )
    except QueueError as exc:
        raise queue_problem(exc) from None
    return json_answer({"status": done.status})


def _then_claimed(
    outcome: ProcessRequest | QueueError, claimed: list[ProcessRequest], members: set[str]
) -> web.Response:
    """A single report's answer with `claim_next`: its usual `members` of the row (or the
    refusal its plain route would raise, as `error`), and the rows claimed along."""
    answer: dict[str, Any]
    if isinstance(outcome, QueueError):
        answer = {"error": _refused_json(outcome)}
    else:
        answer = {"status": outcome.status}
        if "available_at" in members:
            answer["available_at"] = outcome.available_at
    answer["claimed"] = _claimed_json(claimed)
    return json_answer(answer)


@routes.post("/v1/workspaces/{ws}/requests/{id}/fail")
@documented(
    Doc(
        "Workers: an unexpected error; pending again after the backoff, or poison."
        " `claim_next` claims in the same transaction",
        {200: (FailAnswer, FailClaimed, RefusedClaimed)},
        body=FailBody,
        problems=HOLDER_PROBLEMS,
        tag="workers",
    )
)
async def fail(request: web.Request) -> web.Response:
    """The holder's failure report; `claim_next` as on `complete`."""
    claims, row = await _claims_and_row(request)
    _, body = await _json_body(request)
    config = request.app[CONFIG]
    asked = parse_body(FailBody, body)
    claim_next = _next_ask(request, claims, asked.claim_next)
    token, error = asked.claim_token, _payload(body, "error")
    if claim_next is not None:
        (outcome,), claimed = await request.app[STORES].queue.fail_then_claim(
            row.request_id,
            token,
            error,
            config.failure_backoff_seconds,
            now=None,
            claim_next=claim_next,
        )
        return _then_claimed(outcome, claimed, {"status", "available_at"})
    try:
        after = await request.app[STORES].queue.fail(
            row.request_id,
            token,
            error,
            config.failure_backoff_seconds,
            now=None,
        )
    except QueueError as exc:
        raise queue_problem(exc) from None
    return json_answer({"status": after.status, "available_at": after.available_at})


# -- batched enqueue -------------------------------------------------------------------------------


def _asks(
    workspace_id: str,
    items: list[Any],
    member: str,
    max_dequeues: int,
    claims: TokenClaims,
    random_hex: Callable[[int], str | None] = lambda _index: None,
) -> list[EnqueueAsk]:
    """Each of `items` read as the single route reads its body (`_new_request`); a bad item
    refuses them all: 422 with the item's own code and `item_index`."""
    batch: list[EnqueueAsk] = []
    for index, item in enumerate(items):
        try:
            if not isinstance(item, dict):
                raise Problem(422, "invalid_field", "an item must be a JSON object")
            req, rerun = _new_request(workspace_id, item, max_dequeues, claims, random_hex(index))
        except Problem as exc:
            raise Problem(
                exc.status, exc.code, f"{member}[{index}]: {exc.detail}", item_index=index
            ) from None
        batch.append(EnqueueAsk(req, rerun))
    return batch


def _batch_of(
    workspace_id: str, body: dict[str, Any], max_dequeues: int, claims: TokenClaims
) -> list[EnqueueAsk]:
    """The enqueues `{"requests": [...]}` asks for, each item read as the single route reads its
    body (`_new_request`). A bad item refuses the whole call: 422 with the item's own code and
    `item_index`, and nothing is enqueued (pinned by
    `tests/server/http/test_queue_enqueue_many.py`)."""
    items = body.get("requests")
    if set(body) != {"requests"} or not isinstance(items, list):
        raise Problem(422, "invalid_field", 'the body is {"requests": [...]}')
    if not 0 < len(items) <= BATCH_ITEMS_MAX:
        raise Problem(422, "invalid_field", f"requests must be a list of 1..{BATCH_ITEMS_MAX}")
    return _asks(workspace_id, items, "requests", max_dequeues, claims)


def _batch_answer(answers: list[Enqueued], batch: list[EnqueueAsk]) -> dict[str, Any]:
    return {
        "results": [
            _enqueue_answer(answer, item.request)
            for answer, item in zip(answers, batch, strict=True)
        ]
    }


@routes.post("/v1/workspaces/{ws}/requests/batch")
@documented(
    Doc(
        "Queue many stage runs in one commit: one answer per item, in order, as the single route",
        {202: BatchEnqueueResults},
        body=BatchEnqueueBody,
        params=(IDEMPOTENCY_KEY,),
        answer_headers={202: ("Idempotency-Replayed",)},
        problems={
            409: ("request_id_conflict", "idempotency_key_in_progress", "idempotency_key_lost"),
            422: ("invalid_field", "idempotency_key_reuse"),
        },
        tag="queue",
    )
)
async def enqueue_batch(request: web.Request) -> web.Response:
    """`{"requests": [item, ...]}`, each item the single enqueue's body → `{"results":
    [answer, ...]}`, each the single route's answer; all in one transaction (docs/queue.md)."""
    workspace_id = request.match_info["ws"]
    check_ids(workspace_id)
    claims = authorize(request, workspace_id)
    raw, body = await _json_body(request)
    batch = _batch_of(workspace_id, body, request.app[CONFIG].max_dequeues, claims)
    queue = request.app[STORES].queue
    answers = await _once_per_key(
        request,
        workspace_id,
        claims,
        raw,
        lambda key: queue.enqueue_many(batch, now=None, idempotency=key),
        lambda done: StoredResponse(202, _batch_answer(done, batch)),
    )
    if isinstance(answers, web.Response):  # the key's stored answer
        return answers
    for enqueued in answers:
        _count_coalesced(request, enqueued)
    return json_answer(_batch_answer(answers, batch), status=202)


# -- enqueue with the commit (an apply's `enqueue`) --------------------------------------------


def apply_enqueue(
    workspace_id: str,
    sub_doc: str,
    items: object,
    op_ids: list[str],
    max_dequeues: int,
    claims: TokenClaims,
) -> list[EnqueueAsk]:
    """The enqueues an apply's `"enqueue": [item, ...]` asks for (docs/queue.md, "Start work
    with the change that needs it"), each item read as the single enqueue's body, at most
    `BATCH_ITEMS_MAX` as the batch route. Needs the `enqueue` scope besides `write`.

    An item that would get a random id (no `job_id`, or `deterministic: false`) gets one derived
    from the apply instead (`apply_request_hex`): the resend of an apply that committed names
    the same requests, so it can be answered with them. Raises `Problem` (nothing applied)."""
    if "enqueue" not in claims.scopes:
        raise missing_scope(frozenset({"enqueue"}))
    if not isinstance(items, list) or not 0 < len(items) <= BATCH_ITEMS_MAX:
        raise Problem(
            422, "invalid_field", f'"enqueue" must be a list of 1..{BATCH_ITEMS_MAX} requests'
        )
    grant_key = grant_scope_key(enqueue_grant(claims.scopes, claims.sub_docs))

    def derived(index: int) -> str | None:
        if not op_ids:  # no op_id: nothing dedupes the resend either
            return None
        return apply_request_hex(workspace_id, sub_doc, op_ids, index, grant_key)

    return _asks(workspace_id, items, "enqueue", max_dequeues, claims, derived)


def apply_request_hex(
    workspace_id: str, sub_doc: str, op_ids: list[str], index: int, grant_key: str | None
) -> str:
    """The 40 hex chars of the id of item `index` of an apply's `enqueue` that asks for no
    deterministic id: sha256 of the canonical JSON of `["cv-apply-enqueue/v1", workspace_id,
    sub_doc, op_ids, index, grant_key]`. An op_id names one op of one sub-doc for good (a
    reuse is refused), so no other apply derives the same id."""
    text = json.dumps(
        ["cv-apply-enqueue/v1", workspace_id, sub_doc, op_ids, index, grant_key],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:40]


async def apply_enqueue_answers(
    request: web.Request, batch: list[EnqueueAsk], enqueued: list[Enqueued] | None
) -> list[dict[str, Any]]:
    """One answer per item of an apply's `enqueue`, as the enqueue route answers it. When the
    apply newly applied no op (`enqueued` is None: a resend of an apply that committed, or a
    batch rejected), nothing was enqueued now: each item is answered from the request its id
    names if there is one (`coalesced: true`), else with `status: null` (not enqueued)."""
    if enqueued is not None:
        for answer in enqueued:
            _count_coalesced(request, answer)
        return [
            _enqueue_answer(answer, item.request)
            for answer, item in zip(enqueued, batch, strict=True)
        ]
    ids = [item.request.request_id for item in batch]
    rows = {row.request_id: row for row in await request.app[STORES].queue.get_many(ids)}
    answers: list[dict[str, Any]] = []
    for item in batch:
        row = rows.get(item.request.request_id)
        if row is None or row.workspace_id != item.request.workspace_id:
            answers.append(
                {
                    "request_id": item.request.request_id,
                    "status": None,
                    "coalesced": False,
                    "input_differs": False,
                    "stream_url": None,
                }
            )
        else:
            answers.append(_enqueue_answer(Enqueued(row, True), item.request))
    return answers
