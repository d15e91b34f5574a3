"""The requester's side of the work queue (docs/protocol.md, docs/queue.md): enqueue a stage, read a
request (and the blob of a large result), list requests for operators, replay a poison one, and
wait for an outcome over the SSE stream — and `QueueMethods`, the enqueue / wait / inspect verbs
`WorkspaceClient` mixes in.

Everything here needs only a *host* (`QueueHost`, see `_queue.transport`, whose transport and retry
rule these verbs use). `WorkspaceClient` is one; `QueueClient` is a light one for shells (the
`cv-workspace` command) that need no outbox and no websocket. The verbs of a worker holding a
claim are in `_queue.holder`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp

from cv_workspace_client._core.answers import answer_error
from cv_workspace_client._core.url import check_server_url
from cv_workspace_client._io.auth import TokenRefresher, bearer_of, with_token
from cv_workspace_client._io.http import exchange
from cv_workspace_client._io.retry import backoff_for, is_retryable, log_retry, retrying
from cv_workspace_client._queue.schedules import ScheduleMethods
from cv_workspace_client._queue.transport import QueueHost, call, config_of, retried, ws_path
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import (
    AuthError,
    ConnectionFailedError,
    ForbiddenError,
    ProtocolError,
    WorkspaceError,
    error_from_problem,
)
from cv_workspace_client.queue_models import (
    EnqueuedRequest,
    EnqueueItem,
    OutcomeStatus,
    QueuedRequest,
    RequestOutcome,
    RequestStatus,
)

__all__ = [
    "EnqueueItem",
    "EnqueuedRequest",
    "QueueClient",
    "QueueHost",
    "QueueMethods",
    "QueuedRequest",
    "RequestOutcome",
    "cancel",
    "discard",
    "enqueue",
    "enqueue_many",
    "get_blob",
    "get_request",
    "iter_requests",
    "list_requests",
    "list_requests_page",
    "replay",
    "stream_events",
    "wait_request",
]


# -- enqueuers and readers -------------------------------------------------------------------------


async def enqueue(
    host: QueueHost,
    workspace_id: str,
    body: Mapping[str, Any],
    *,
    idempotency_key: str | None = None,
) -> EnqueuedRequest:
    """`POST /v1/workspaces/{ws}/requests`. Retried only when a repeat cannot fork the work: the
    request id is deterministic (a repeat coalesces) or an Idempotency-Key travels with it."""
    deterministic = body.get("deterministic", body.get("job_id") is not None)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    path = ws_path(workspace_id, "requests")
    config = config_of(host)
    # A rerun re-opens a *finished* request: if the lost attempt's run finished before the
    # retry arrives, a repeat re-opens it once more (the stage runs twice). So a rerun is safe
    # to repeat only under an Idempotency-Key, deterministic id or not.
    safe = (bool(deterministic) and not body.get("rerun", False)) or idempotency_key is not None
    attempts = config.retry_attempts if safe else 1
    answer, replayed = await _post_enqueue(host, path, dict(body), headers, attempts)
    return _enqueued(answer, replayed)


async def get_request(host: QueueHost, workspace_id: str, request_id: str) -> QueuedRequest:
    """`GET .../requests/{id}`; `NotFoundError` if there is no such request."""
    answer = await retried(host, "GET", ws_path(workspace_id, "requests", request_id))
    return QueuedRequest.from_json(answer)


async def get_blob(host: QueueHost, workspace_id: str, ref: str) -> bytes:
    """The bytes of a large result (`blob_ref` on the row)."""

    async def once(auth: dict[str, str]) -> bytes:
        status, raw, headers = await exchange(
            host.session, "GET", host.url + ws_path(workspace_id, "blobs", ref), headers=auth
        )
        if status == 200:
            return raw
        raise answer_error(status, raw, headers)

    async for attempt in retrying(config_of(host)):
        with attempt:
            return await with_token(host, once)
    raise AssertionError("unreachable: retrying re-raises the last error")  # pragma: no cover


async def list_requests(
    host: QueueHost,
    *,
    status: RequestStatus | None = None,
    workspace_id: str | None = None,
    limit: int = 100,
) -> list[QueuedRequest]:
    """`GET /v1/queue/requests` (operators): the first `limit` requests, oldest first."""
    rows, _ = await list_requests_page(
        host, status=status, workspace_id=workspace_id, limit=limit, after=None
    )
    return rows


async def list_requests_page(
    host: QueueHost,
    *,
    status: RequestStatus | None,
    workspace_id: str | None,
    limit: int,
    after: str | None,
) -> tuple[list[QueuedRequest], str | None]:
    """One page of `GET /v1/queue/requests` after the cursor `after` (None: the first), and the
    cursor of the next page (None: this was the last)."""
    params = [("limit", str(limit))]
    if status is not None:
        params.append(("status", status))
    if workspace_id is not None:
        params.append(("workspace", workspace_id))
    if after is not None:
        params.append(("after", after))
    answer = await retried(host, "GET", "/v1/queue/requests", params=params)
    try:
        rows = [QueuedRequest.from_json(row) for row in answer["requests"]]
        cursor = answer.get("next_after")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError("bad_answer", f"list answer: {exc!r}") from None
    if cursor is not None and not isinstance(cursor, str):
        raise ProtocolError("bad_answer", "list answer: next_after is not a string")
    return rows, cursor


async def iter_requests(
    host: QueueHost,
    *,
    status: RequestStatus | None = None,
    workspace_id: str | None = None,
    page: int = 100,
) -> AsyncGenerator[QueuedRequest, None]:
    """Every matching request, oldest first, a page at a time: a request that matches
    throughout is yielded once even if others change status between pages (the cursor is the
    last row's position, not an offset)."""
    after: str | None = None
    while True:
        rows, after = await list_requests_page(
            host, status=status, workspace_id=workspace_id, limit=page, after=after
        )
        for row in rows:
            yield row
        if after is None or not rows:
            return


async def replay(host: QueueHost, workspace_id: str, request_id: str) -> QueuedRequest:
    """`POST .../replay`: a poison request back to pending, by hand (never automatic).
    Raises `InvalidRequestError` (`invalid_transition`) if it is not poison."""
    path = ws_path(workspace_id, "requests", request_id, "replay")
    _, answer, _ = await call(host, "POST", path, body={})
    return QueuedRequest.from_json(answer)


async def discard(host: QueueHost, workspace_id: str, request_id: str) -> QueuedRequest:
    """`POST .../discard`: delete a poison request for good (its result blob too), instead of
    replaying it; answers the row as it was. Not retried: a retry after a lost answer would
    find nothing (`NotFoundError`), which then means the first attempt deleted it.
    Raises `InvalidRequestError` (`not_discardable`) if it is not poison."""
    path = ws_path(workspace_id, "requests", request_id, "discard")
    _, answer, _ = await call(host, "POST", path, body={})
    return QueuedRequest.from_json(answer)


async def cancel(host: QueueHost, workspace_id: str, request_id: str) -> QueuedRequest:
    """`POST .../cancel`: a pending request is `cancelled` at once; one in progress comes back
    with `cancel_requested` and turns `cancelled` once its worker stops (at its next
    heartbeat). Retried like a read: cancelling twice changes nothing more. Raises
    `InvalidRequestError` (`not_cancellable`) if the request is done or poison."""
    path = ws_path(workspace_id, "requests", request_id, "cancel")
    answer = await retried(host, "POST", path, body={})
    return QueuedRequest.from_json(answer)


async def stream_events(
    host: QueueHost, workspace_id: str, request_id: str, patience: float
) -> AsyncGenerator[tuple[str, Any], None]:
    """The SSE stream of one request: `(event, data)` pairs — `queued`, then `done`,
    `cancelled` or `error` (and whatever events a newer server adds: the caller skips them).

    Ends when the server ends the stream (or the connection drops: the caller reconnects).
    """
    path = ws_path(workspace_id, "requests", request_id, "stream")
    # The server ends the stream at its deadline; the client timeout only catches a dead peer.
    limit = aiohttp.ClientTimeout(total=patience + 10.0)
    try:
        for refreshed in (False, True):
            auth = host.auth_headers()
            async with host.session.get(
                host.url + path,
                params={"timeout": f"{patience:.3f}"},
                headers={**auth, "Accept": "text/event-stream"},
                timeout=limit,
            ) as response:
                if response.status != 200:
                    raw = await response.read()
                    error = answer_error(response.status, raw, response.headers)
                    # As `with_token`, by hand: an async generator cannot be re-run by it.
                    refresher = host.token_refresher
                    if (
                        not refreshed
                        and isinstance(error, AuthError | ForbiddenError)
                        and refresher is not None
                        and await refresher.refreshed(bearer_of(auth))
                    ):
                        continue
                    raise error
                if refreshed and host.token_refresher is not None:
                    host.token_refresher.accepted(bearer_of(auth))
                async with contextlib.aclosing(_events(response)) as events:
                    async for item in events:
                        yield item
                return
    except WorkspaceError:
        raise
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ConnectionFailedError("connection_failed", f"{type(exc).__name__}: {exc}") from exc


async def _events(response: aiohttp.ClientResponse) -> AsyncGenerator[tuple[str, Any], None]:
    """The `(event, data)` pairs of an SSE response, as they arrive."""
    event, data_lines = "message", list[str]()
    async for line_bytes in response.content:
        line = line_bytes.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data_lines:
                try:
                    data = json.loads("\n".join(data_lines))
                except (ValueError, RecursionError) as exc:
                    raise ProtocolError("bad_answer", f"SSE data: {exc}") from None
                yield event, data
            event, data_lines = "message", list[str]()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].lstrip(" "))


#: A finished row's status → the outcome a wait answers with.
_OUTCOMES: Mapping[str, OutcomeStatus] = {
    "done": "done",
    "poison": "poison",
    "cancelled": "cancelled",
}


async def _outcome(host: QueueHost, row: QueuedRequest) -> RequestOutcome:
    """The outcome of a finished row. A status this SDK does not know is a `ProtocolError`, not
    a guess: mapping it to poison (as every status but done once was) misreports the request."""
    status = _OUTCOMES.get(row.status)
    if status is None:
        raise ProtocolError("bad_answer", f"{row.request_id}: unknown status {row.status!r}")
    result = row.result
    if row.status == "done" and row.blob_ref is not None:
        blob = await get_blob(host, row.workspace_id, row.blob_ref)
        try:
            result = json.loads(blob)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError("bad_answer", f"blob is not JSON: {exc}") from None
    return RequestOutcome(row.request_id, status, row, result, row.error)


def _settled(row: QueuedRequest) -> bool:
    """Neither pending nor in progress: finished, under a status known or not."""
    return row.status not in ("pending", "in_progress")


async def wait_request(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    timeout: float = 60.0,  # noqa: ASYNC109  (a deadline that ends the wait, not the work)
) -> RequestOutcome:
    """Wait up to `timeout` seconds for the request to finish, over the SSE stream.

    A dropped stream reconnects (the result lives on the row, so nothing is lost); a server
    deadline shorter than `timeout` is simply waited out again. `event: cancelled` ends the wait
    at once with the `cancelled` outcome. Events this SDK does not know are skipped; a stream
    that ends without a final event or the server's deadline (`error` `wait_timeout`) is
    followed by one read of the row — a finished row answers the wait, a live one waits again
    after a backoff, never in a tight loop. Past `timeout`, the answer is a `RequestOutcome` with
    status `timeout` — never an exception that would lose the request id.
    """
    if timeout <= 0:
        # No wait at all: one look at the row (a stream bounded by a deadline already past
        # could not even deliver the `done` of a request that finished long ago).
        row = await get_request(host, workspace_id, request_id)
        if _settled(row):
            return await _outcome(host, row)
        return RequestOutcome(request_id, "timeout", row)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    config = config_of(host)
    backoff = backoff_for(config)
    last: QueuedRequest | None = None
    failures = 0
    while True:
        remaining = deadline - loop.time()
        saw_event = False
        deadline_ended = False  # the server's own deadline ended it (`error` `wait_timeout`)
        finished: QueuedRequest | None = None
        try:
            # The stream's own HTTP timeout only catches a dead peer, 10 s past the deadline: on
            # a stalled link (no reset, no byte) the wait overran `timeout` by that much. Each
            # stream is bounded by the wait's own deadline. `aclosing` releases the connection
            # as soon as we leave, not when a finalizer gets round to it.
            async with (
                asyncio.timeout_at(deadline),
                contextlib.aclosing(
                    stream_events(host, workspace_id, request_id, max(0.0, remaining))
                ) as events,
            ):
                async for event, data in events:
                    saw_event = True
                    if event in ("done", "cancelled"):
                        finished = QueuedRequest.from_json(data)
                        break
                    if event == "queued":
                        last = QueuedRequest.from_json(data)
                    elif event == "error" and isinstance(data, dict):
                        # `TIMEOUT`: what older servers sent for the same deadline.
                        if data.get("code") not in ("wait_timeout", "TIMEOUT"):
                            raise error_from_problem(None, data)
                        deadline_ended = True
                    # Any other event is one this SDK does not know: skipped.
                if finished is None and saw_event and not deadline_ended:
                    # Events, but neither an outcome nor the server's deadline (a newer server's
                    # final event): the row says how it stands. Reconnecting at once instead
                    # would repeat the same stream in a tight loop until `timeout`.
                    row = await get_request(host, workspace_id, request_id)
                    if _settled(row):
                        finished = row
                    else:
                        last = row
                        failures += 1
            # Ended without an outcome: the server's deadline, or a dropped stream.
            if finished is None and not saw_event:
                failures += 1
            elif deadline_ended:
                failures = 0
        except TimeoutError:  # our bound, mid-stream (`stream_events` wraps its own timeouts)
            return RequestOutcome(request_id, "timeout", last)
        except WorkspaceError as exc:
            if not is_retryable(exc):
                raise
            failures += 1
        if finished is not None:  # outside the deadline: a known outcome is never a timeout
            return await _outcome(host, finished)
        remaining = deadline - loop.time()
        if remaining <= 0:
            return RequestOutcome(request_id, "timeout", last)
        if failures:
            await config.sleep(min(backoff(failures), remaining))


# -- batched enqueue -------------------------------------------------------------------------------


async def _post_enqueue(
    host: QueueHost,
    path: str,
    payload: dict[str, Any],
    headers: Mapping[str, str],
    attempts: int,
) -> tuple[Any, bool]:
    """POST an enqueue (single or batched) up to `attempts` times: retried on connection
    errors, timeouts, 5xx, 429, and while the first request with the key is still running
    (409 `idempotency_key_in_progress`). The answer, and whether the key replayed it."""
    config = config_of(host)
    for attempt in range(1, attempts + 1):
        try:
            _, answer, answer_headers = await call(
                host, "POST", path, body=payload, headers=dict(headers)
            )
            return answer, answer_headers.get("Idempotency-Replayed") == "true"
        except WorkspaceError as exc:
            in_progress = exc.code == "idempotency_key_in_progress"
            if attempt == attempts or not (is_retryable(exc) or in_progress):
                raise
            delay = backoff_for(config)(attempt)
            log_retry(exc, attempt, attempts, delay)
            await config.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _enqueued(answer: Any, replayed: bool) -> EnqueuedRequest:
    """One answer of an enqueue (single or batched) as `EnqueuedRequest`."""
    try:
        return EnqueuedRequest(
            request_id=str(answer["request_id"]),
            status=answer["status"],
            coalesced=bool(answer["coalesced"]),
            stream_url=str(answer["stream_url"]),
            replayed=replayed,
            # A server that predates the member coalesced without saying: False, as then.
            input_differs=bool(answer.get("input_differs", False)),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError("bad_answer", f"enqueue answer: {exc!r}") from None


async def enqueue_many(
    host: QueueHost,
    workspace_id: str,
    bodies: Sequence[Mapping[str, Any]],
    *,
    idempotency_key: str,
) -> list[EnqueuedRequest]:
    """`POST /v1/workspaces/{ws}/requests/batch` under `idempotency_key`: one answer per body,
    in order. Retried like `enqueue` under a key (connection errors, timeouts, 5xx, 429, and a
    key still in progress): a retry after a lost answer gets the first answer (`replayed`), and
    the ids are the ones the first attempt minted, so nothing is enqueued twice."""
    path = ws_path(workspace_id, "requests", "batch")
    config = config_of(host)
    payload = {"requests": [dict(body) for body in bodies]}
    headers = {"Idempotency-Key": idempotency_key}
    answer, replayed = await _post_enqueue(host, path, payload, headers, config.retry_attempts)
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != len(bodies):
        raise ProtocolError("bad_answer", "batch enqueue answer: not one result per request")
    return [_enqueued(result, replayed) for result in results]


# -- the verbs, for every client that talks to the queue -----------------------------------------


class QueueMethods(ScheduleMethods, abc.ABC):
    """The queue's verbs (and the schedules', `ScheduleMethods`) over the module's functions,
    for a client with a `url`, a `session` and `auth_headers()` (and optionally a `ClientConfig`
    as `config`, for the retry policy): the base of `WorkspaceClient` and of `QueueClient`,
    which provide those two."""

    url: str
    #: Fresh tokens on a refusal (`WorkspaceClient(token_provider=...)`); None: none.
    token_refresher: TokenRefresher | None = None

    @property
    @abc.abstractmethod
    def session(self) -> aiohttp.ClientSession:
        """The open HTTP session the verbs send with."""

    @abc.abstractmethod
    def auth_headers(self) -> dict[str, str]:
        """The `Authorization` header of the token in use (empty without one)."""

    async def enqueue(
        self,
        workspace_id: str,
        *,
        stage: str,
        job_id: str | None = None,
        branch_path: str | None = None,
        input: Any = None,
        deterministic: bool | None = None,
        rerun: bool = False,
        idempotency_key: str | None = None,
        worker_class: str | None = None,
        max_dequeues: int | None = None,
    ) -> EnqueuedRequest:
        """Queue `stage` for `workspace_id`; answer at once (202) with the request's id.

        With a `job_id`, the id is deterministic by default (hash of workspace, job, branch and
        stage): enqueueing it again coalesces into the live request, or returns the finished
        one — pass `rerun=True` to run a finished one again on purpose. `input_differs` on the
        answer says the request it coalesced into holds another input than `input`, which was
        not used. Without a `job_id`, each enqueue is
        a new request. Each call carries an `Idempotency-Key` (minted, or yours), so a retry
        after a lost answer can neither fork the work nor be mistaken for another's enqueue.
        """
        body: dict[str, Any] = {"stage": stage}
        for name, value in (
            ("job_id", job_id),
            ("branch_path", branch_path),
            ("input", input),
            ("deterministic", deterministic),
            ("worker_class", worker_class),
            ("max_dequeues", max_dequeues),
        ):
            if value is not None:
                body[name] = value
        if rerun:
            body["rerun"] = True
        if idempotency_key is None:
            # Every call gets one, deterministic id or not. Without a key a retry after a lost
            # answer forks the work (no job_id) or runs a rerun twice; and with a deterministic
            # id it was answered `coalesced: true` — into the request its own lost attempt had
            # made, so an app (and the stages demo's summary) counted its own enqueue as one
            # absorbed by another. Under the key the retry gets the first answer (`replayed`).
            idempotency_key = "auto-" + secrets.token_hex(16)
        return await enqueue(self, workspace_id, body, idempotency_key=idempotency_key)

    async def enqueue_many(
        self,
        workspace_id: str,
        requests: Sequence[EnqueueItem],
        *,
        idempotency_key: str | None = None,
    ) -> list[EnqueuedRequest]:
        """Queue many stages for `workspace_id` in one call and one commit; one answer per
        item, in order, each the one `enqueue` of it would get at that point (a duplicate
        within the batch coalesces into its first). At most 1,000 items (docs/limits.md): more
        is `InvalidRequestError` (`invalid_field`), as is any bad item — with `item_index`, and
        nothing enqueued. An empty list enqueues nothing and makes no call.

        The call carries an `Idempotency-Key` (minted, or yours) and is retried under it, so a
        retry after a lost answer enqueues nothing twice, random ids and reruns included.
        """
        if not requests:
            return []
        if idempotency_key is None:
            idempotency_key = "auto-" + secrets.token_hex(16)
        bodies = [item.to_body() for item in requests]
        return await enqueue_many(self, workspace_id, bodies, idempotency_key=idempotency_key)

    async def get_request(self, workspace_id: str, request_id: str) -> QueuedRequest:
        """The request as it stands (its result once done)."""
        return await get_request(self, workspace_id, request_id)

    async def wait_request(
        self,
        workspace_id: str,
        request_id: str,
        timeout: float = 60.0,  # noqa: ASYNC109  (ends the wait, never the work)
    ) -> RequestOutcome:
        """Wait for the request to finish (see `wait_request`); `timeout` → status `timeout`."""
        return await wait_request(self, workspace_id, request_id, timeout)

    async def list_requests(
        self,
        *,
        status: RequestStatus | None = None,
        workspace_id: str | None = None,
        limit: int = 100,
    ) -> list[QueuedRequest]:
        """Requests by status and workspace, oldest first (operators)."""
        return await list_requests(self, status=status, workspace_id=workspace_id, limit=limit)

    def iter_requests(
        self,
        *,
        status: RequestStatus | None = None,
        workspace_id: str | None = None,
        page: int = 100,
    ) -> AsyncGenerator[QueuedRequest, None]:
        """Every request by status and workspace, oldest first, fetched `page` at a time
        (operators: every poison request, however many)."""
        return iter_requests(self, status=status, workspace_id=workspace_id, page=page)

    async def replay_request(self, workspace_id: str, request_id: str) -> QueuedRequest:
        """Put a poison request back in the queue by hand."""
        return await replay(self, workspace_id, request_id)

    async def discard_request(self, workspace_id: str, request_id: str) -> QueuedRequest:
        """Delete a poison request for good (docs/queue.md, "How long a finished request is
        kept"); answers the row as it was. Raises `InvalidRequestError` (`not_discardable`)
        if it is not poison, `NotFoundError` if there is no such request."""
        return await discard(self, workspace_id, request_id)

    async def cancel_request(self, workspace_id: str, request_id: str) -> QueuedRequest:
        """Cancel a request: `cancelled` at once if pending; if a worker runs it, the row comes
        back with `cancel_requested` and turns `cancelled` once the worker stops (see
        `cancel`). Raises `InvalidRequestError` (`not_cancellable`) if it is done or poison."""
        return await cancel(self, workspace_id, request_id)


class QueueClient(QueueMethods):
    """A light queue-only client (no outbox, no websocket): `async with QueueClient(url, token)`.

    For shells and agents that only submit and inspect work (the `cv-workspace` command).
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        config: ClientConfig | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = check_server_url(url)
        self.token = token
        self.config = config or ClientConfig()
        #: A session passed in stays the caller's to close.
        self._session = session
        self._owns_session = session is None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the QueueClient is not open (use `async with`)")
        return self._session

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def __aenter__(self) -> QueueClient:
        if self._owns_session:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_seconds)
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
