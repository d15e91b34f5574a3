"""The claim holder's side of the work queue (docs/protocol.md, docs/queue.md): claim work (or
long-poll until there is some), keep the lease alive, and finish the request — `complete`,
`complete_many` or `fail` (a large result uploaded first, `upload_result`), each fenced by the
claim token, so a holder whose lease was reclaimed is told `LeaseLostError` and changes
nothing. `Worker` and its completer and heartbeat
(`worker.io`) drive these; the requester's verbs are in `_queue.requester`.

Retries (the rule is in `_queue.transport`): the fenced verbs are safe to repeat — a retried
`complete` is answered with the finished row. A claim is not retried: a lost answer leaves a row
leased to nobody, which the lease re-drives.

Report and claim: `complete`, `complete_many` and `fail` take a `claim_next` (`ClaimNext`), sent
with the report and committed in its transaction, and then answer a `ThenClaimed` (the report's
outcomes and the claimed rows) instead of their plain answer; a refused report (`lease_lost`) is
an outcome then, not a raise, since the claim went ahead. Only the first attempt carries the
claim: the retries of a report lost on the way send it alone (claiming nothing), so the claim is
never retried either (docs/queue.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, overload

from cv_mutations import Op
from cv_workspace_client._core.wire import parse_results
from cv_workspace_client._queue.channel import ChannelClosedError, ChannelHost, WorkerChannel
from cv_workspace_client._queue.transport import QueueHost, call, retried, ws_path
from cv_workspace_client.errors import (
    LeaseLostError,
    ProtocolError,
    WorkspaceError,
    error_from_problem,
)
from cv_workspace_client.models import Commit
from cv_workspace_client.queue_models import (
    Claim,
    ClaimNext,
    CompletionOutcome,
    QueuedRequest,
    ThenClaimed,
)

__all__ = [
    "Claim",
    "ClaimNext",
    "CompletionOutcome",
    "QueueHost",
    "QueuedRequest",
    "ThenClaimed",
    "claim",
    "complete",
    "complete_many",
    "fail",
    "heartbeat",
    "stage_write",
    "upload_result",
    "wait_for_work",
]


def _channel(host: QueueHost) -> WorkerChannel | None:
    """The worker channel open on `host`, if any: the verbs below go over it first, and over
    HTTP when it is not open or drops before the answer (`_queue.channel`)."""
    return host.open_channel() if isinstance(host, ChannelHost) else None


#: The header a result upload carries its claim token in (its body is the result itself).
CLAIM_TOKEN_HEADER = "Claim-Token"


async def claim(
    host: QueueHost, worker_classes: Sequence[str], worker_id: str, *, limit: int = 1
) -> list[Claim]:
    """`POST /v1/queue/claim` with a `limit`: up to `limit` requests, each under its own token
    (one commit for the batch), or none. Not retried (see the module docstring)."""
    body = {"worker_classes": list(worker_classes), "worker_id": worker_id, "limit": limit}
    status, answer, _ = await call(host, "POST", "/v1/queue/claim", body=body)
    if status == 204 or answer is None:
        return []
    try:
        rows = answer["requests"] if "requests" in answer else [answer["request"]]
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"claim answer: {exc!r}") from None
    return _claims(rows)


def _claims(rows: Any) -> list[Claim]:
    """Claimed rows as the claim route renders them (`requests`, or a report's `claimed`)."""
    try:
        return [Claim(str(row["claim_token"]), QueuedRequest.from_json(row)) for row in rows]
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"claim answer: {exc!r}") from None


def _claimed_along(answer: Any) -> list[Claim]:
    """The rows a report's `claim_next` claimed. An answer without `claimed` is a retry's (sent
    without the claim) or an older server's (which ignores `claim_next`): nothing claimed."""
    rows = answer.get("claimed") if isinstance(answer, dict) else None
    return [] if rows is None else _claims(rows)


def _refusal(error: Any) -> WorkspaceError:
    """A report's refusal given as an outcome (`{"code", "message"}`), as its typed error."""
    if not isinstance(error, dict):
        raise ProtocolError("bad_answer", f"report refusal: {error!r}")
    if error.get("code") == "lease_lost":
        return LeaseLostError(str(error.get("message", "")))
    return error_from_problem(409, error)


async def _report_then_claim(
    host: QueueHost, path: str, body: dict[str, Any], claim_next: ClaimNext
) -> Any:
    """POST a single report with `claim_next`; the decoded answer. A retry (the first answer
    lost or refused with a 5xx) goes without the claim; one it gets refused with
    `LeaseLostError` is answered as the refusal (`{"error": ...}`), as the first would be."""
    try:
        return await retried(
            host, "POST", path, body={**body, "claim_next": claim_next.to_json()}, retry_body=body
        )
    except LeaseLostError as exc:
        return {"error": {"code": exc.code, "message": exc.message}}


async def wait_for_work(
    host: QueueHost,
    worker_classes: Sequence[str],
    timeout: float,  # noqa: ASYNC109  (the long poll's own patience, sent to the server)
) -> bool:
    """`GET /v1/queue/pending`: True as soon as work of those classes is claimable (at once if
    some already is, else on the push of new work), False after `timeout` (the server caps it
    at 2 s)."""
    params = [("worker_classes", c) for c in worker_classes]
    params.append(("timeout", f"{timeout:.3f}"))
    status, _, _ = await call(host, "GET", "/v1/queue/pending", params=params)
    return status == 200


async def heartbeat(host: QueueHost, workspace_id: str, request_id: str, claim_token: str) -> float:
    """Extend the lease; return its new expiry. Raises `LeaseLostError` when the token is gone,
    `RequestCancelledError` when someone cancelled the request (stop, then `fail`)."""
    channel = _channel(host)
    if channel is not None:
        with contextlib.suppress(ChannelClosedError):
            return await channel.heartbeat(request_id, claim_token)
    path = ws_path(workspace_id, "requests", request_id, "heartbeat")
    answer = await retried(host, "POST", path, body={"claim_token": claim_token})
    return float(answer["lease_expires_at"])


async def stage_write(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    sub_doc: str,
    op: Op,
) -> Commit:
    """`POST .../requests/{id}/docs/{sub_doc}/ops`: apply `op` for the request the worker holds,
    inside the grant the request was enqueued under (docs/queue.md, "Whose grant a stage runs
    under"). Retried under the SDK's rule (the op_id makes a resend a duplicate). Raises
    `ForbiddenError` `forbidden_sub_doc` outside that grant, `LeaseLostError` once the claim is
    gone, `OpRejectedError` for a rejected op."""
    path = ws_path(workspace_id, "requests", request_id, "docs", sub_doc, "ops")
    body = {"ops": [op.model_dump(mode="json", exclude_none=True)]}
    answer = await retried(host, "POST", path, body=body, headers={CLAIM_TOKEN_HEADER: claim_token})
    results = answer.get("results") if isinstance(answer, Mapping) else None
    outcomes = parse_results([str(op.op_id)], results)
    if isinstance(outcomes, WorkspaceError):
        raise outcomes
    (outcome,) = outcomes
    if isinstance(outcome, WorkspaceError):
        raise outcome
    return outcome


async def upload_result(
    host: QueueHost, workspace_id: str, request_id: str, claim_token: str, encoded: bytes
) -> str:
    """`POST .../requests/{id}/result`: store a result too large for a completion's body (the
    bytes of its JSON, served back byte for byte) and return its `blob_ref`, to complete with.
    Fenced by `claim_token` (`LeaseLostError`); past the server's `max_result_bytes` it raises
    `InvalidRequestError` `result_too_large`. A retry after a lost answer stores a second copy
    nobody names, which the blob retention reaps."""
    path = ws_path(workspace_id, "requests", request_id, "result")
    answer = await retried(
        host, "POST", path, raw=encoded, headers={CLAIM_TOKEN_HEADER: claim_token}
    )
    try:
        return str(answer["blob_ref"])
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"upload answer: {exc!r}") from None


@overload
async def complete(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    *,
    result: Any = None,
    error: Any = None,
    blob_ref: str | None = None,
    cache: str | None = None,
    telemetry: Any = None,
    claim_next: None = None,
) -> str: ...


@overload
async def complete(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    *,
    result: Any = None,
    error: Any = None,
    blob_ref: str | None = None,
    cache: str | None = None,
    telemetry: Any = None,
    claim_next: ClaimNext,
) -> ThenClaimed: ...


async def complete(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    *,
    result: Any = None,
    error: Any = None,
    blob_ref: str | None = None,
    cache: str | None = None,
    telemetry: Any = None,
    claim_next: ClaimNext | None = None,
) -> str | ThenClaimed:
    """Mark the request done (fenced by `claim_token`) with `result`, or with the uploaded
    result `blob_ref` names (`upload_result`). Call only after the stage's writes committed
    (never ack before the work). Raises `LeaseLostError` if refused.

    With `claim_next`: the claim commits with the completion and the answer is a
    `ThenClaimed`, whose one outcome holds the `LeaseLostError` of a refused completion."""
    body: dict[str, Any] = {"claim_token": claim_token, "result": result}
    for name, value in (
        ("error", error),
        ("blob_ref", blob_ref),
        ("cache", cache),
        ("telemetry", telemetry),
    ):
        if value is not None:
            body[name] = value
    path = ws_path(workspace_id, "requests", request_id, "complete")
    if claim_next is None:
        answer = await retried(host, "POST", path, body=body)
        return str(answer["status"])
    answer = await _report_then_claim(host, path, body, claim_next)
    return ThenClaimed([_single_outcome(request_id, answer)], _claimed_along(answer))


def _single_outcome(request_id: str, answer: Any) -> CompletionOutcome:
    try:
        if "error" in answer:
            return CompletionOutcome(request_id, error=_refusal(answer["error"]))
        return CompletionOutcome(request_id, status=str(answer["status"]))
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"report answer: {exc!r}") from None


@overload
async def complete_many(
    host: QueueHost, completions: Sequence[Mapping[str, Any]], *, claim_next: None = None
) -> list[CompletionOutcome]: ...


@overload
async def complete_many(
    host: QueueHost, completions: Sequence[Mapping[str, Any]], *, claim_next: ClaimNext
) -> ThenClaimed: ...


async def complete_many(
    host: QueueHost,
    completions: Sequence[Mapping[str, Any]],
    *,
    claim_next: ClaimNext | None = None,
) -> list[CompletionOutcome] | ThenClaimed:
    """`POST /v1/queue/complete`: many completions in one commit, one outcome each, in order.
    Each item is `{"request_id", "claim_token", "result"? | "blob_ref"?, "error"?, "cache"?,
    "telemetry"?}`; results must be small (large ones are uploaded first, `upload_result`, and
    completed by their `blob_ref`). With `claim_next`, the claim commits with them and the
    answer is a `ThenClaimed`."""
    body = {"completions": [dict(c) for c in completions]}
    channel = _channel(host)
    if channel is not None:
        free = 0 if claim_next is None else claim_next.limit
        with contextlib.suppress(ChannelClosedError):
            results, claimed = await channel.complete_many(body["completions"], free=free)
            return results if claim_next is None else ThenClaimed(results, claimed)
    if claim_next is None:
        answer = await retried(host, "POST", "/v1/queue/complete", body=body)
    else:
        answer = await retried(
            host,
            "POST",
            "/v1/queue/complete",
            body={**body, "claim_next": claim_next.to_json()},
            retry_body=body,
        )
    outcomes: list[CompletionOutcome] = []
    try:
        for item in answer["results"]:
            error = item.get("error")
            if error is None:
                outcomes.append(CompletionOutcome(item["request_id"], status=item["status"]))
            else:
                outcomes.append(CompletionOutcome(item["request_id"], error=_refusal(error)))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError("bad_answer", f"complete answer: {exc!r}") from None
    if len(outcomes) != len(completions):
        raise ProtocolError("bad_answer", "one outcome per completion expected")
    if claim_next is None:
        return outcomes
    return ThenClaimed(outcomes, _claimed_along(answer))


@overload
async def fail(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    error: Any,
    *,
    claim_next: None = None,
) -> tuple[str, float | None]: ...


@overload
async def fail(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    error: Any,
    *,
    claim_next: ClaimNext,
) -> ThenClaimed: ...


async def fail(
    host: QueueHost,
    workspace_id: str,
    request_id: str,
    claim_token: str,
    error: Any,
    *,
    claim_next: ClaimNext | None = None,
) -> tuple[str, float | None] | ThenClaimed:
    """Record an unexpected error: `(status, available_at)` — pending again after the server's
    failure backoff, or `poison` at `max_dequeues`. Raises `LeaseLostError` if refused.

    With `claim_next`: the claim commits with the failure and the answer is a `ThenClaimed`
    (its `available_at` the failure's), whose one outcome holds a refusal's `LeaseLostError`."""
    channel = _channel(host)
    if channel is not None:
        free = 0 if claim_next is None else claim_next.limit
        with contextlib.suppress(ChannelClosedError):
            outcome, available_at, claimed = await channel.fail(
                request_id, claim_token, error, free=free
            )
            if claim_next is not None:
                return ThenClaimed([outcome], claimed, available_at)
            if outcome.error is not None:
                raise outcome.error
            return str(outcome.status), available_at
    path = ws_path(workspace_id, "requests", request_id, "fail")
    body = {"claim_token": claim_token, "error": error}
    if claim_next is None:
        answer = await retried(host, "POST", path, body=body)
        return str(answer["status"]), answer.get("available_at")
    answer = await _report_then_claim(host, path, body, claim_next)
    outcome = _single_outcome(request_id, answer)
    available_at = None if outcome.error is not None else answer.get("available_at")
    return ThenClaimed([outcome], _claimed_along(answer), available_at)
