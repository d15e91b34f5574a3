"""The claim holder's side of the work queue (docs/protocol.md, docs/queue.md): claim work (or
long-poll until there is some), keep the lease alive, and finish the request — `complete`,
`complete_many` or `fail` (a large result uploaded first, `upload_result`), each fenced by the
claim token, so a holder whose lease was reclaimed is told `LeaseLostError` and changes
nothing. `Worker` and its completer and heartbeat
(`_worker_io`) drive these; the requester's verbs are in `_queue_api`.

Retries (the rule is in `_queue_http`): the fenced verbs are safe to repeat — a retried
`complete` is answered with the finished row. A claim is not retried: a lost answer leaves a row
leased to nobody, which the lease re-drives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cv_workspace_client._queue_http import QueueHost, call, retried, ws_path
from cv_workspace_client.errors import LeaseLostError, ProtocolError, error_from_problem
from cv_workspace_client.queue_models import Claim, CompletionOutcome, QueuedRequest

__all__ = [
    "Claim",
    "CompletionOutcome",
    "QueueHost",
    "QueuedRequest",
    "claim",
    "complete",
    "complete_many",
    "fail",
    "heartbeat",
    "upload_result",
    "wait_for_work",
]

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
        return [Claim(str(row["claim_token"]), QueuedRequest.from_json(row)) for row in rows]
    except (KeyError, TypeError) as exc:
        raise ProtocolError("bad_answer", f"claim answer: {exc!r}") from None


async def wait_for_work(
    host: QueueHost,
    worker_classes: Sequence[str],
    timeout: float,  # noqa: ASYNC109  (the long poll's own patience, sent to the server)
) -> bool:
    """`GET /v1/queue/pending`: True as soon as work of those classes becomes pending (a push),
    False after `timeout` (the server caps it at 2 s)."""
    params = [("worker_classes", c) for c in worker_classes]
    params.append(("timeout", f"{timeout:.3f}"))
    status, _, _ = await call(host, "GET", "/v1/queue/pending", params=params)
    return status == 200


async def heartbeat(host: QueueHost, workspace_id: str, request_id: str, claim_token: str) -> float:
    """Extend the lease; return its new expiry. Raises `LeaseLostError` when the token is gone,
    `RequestCancelledError` when someone cancelled the request (stop, then `fail`)."""
    path = ws_path(workspace_id, "requests", request_id, "heartbeat")
    answer = await retried(host, "POST", path, body={"claim_token": claim_token})
    return float(answer["lease_expires_at"])


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
) -> str:
    """Mark the request done (fenced by `claim_token`) with `result`, or with the uploaded
    result `blob_ref` names (`upload_result`). Call only after the stage's writes committed
    (never ack before the work). Raises `LeaseLostError` if refused."""
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
    answer = await retried(host, "POST", path, body=body)
    return str(answer["status"])


async def complete_many(
    host: QueueHost, completions: Sequence[Mapping[str, Any]]
) -> list[CompletionOutcome]:
    """`POST /v1/queue/complete`: many completions in one commit, one outcome each, in order.
    Each item is `{"request_id", "claim_token", "result"? | "blob_ref"?, "error"?, "cache"?,
    "telemetry"?}`; results must be small (large ones are uploaded first, `upload_result`, and
    completed by their `blob_ref`)."""
    body = {"completions": [dict(c) for c in completions]}
    answer = await retried(host, "POST", "/v1/queue/complete", body=body)
    outcomes: list[CompletionOutcome] = []
    try:
        for item in answer["results"]:
            error = item.get("error")
            if error is None:
                outcomes.append(CompletionOutcome(item["request_id"], status=item["status"]))
            elif error.get("code") == "lease_lost":
                outcomes.append(
                    CompletionOutcome(item["request_id"], error=LeaseLostError(error["message"]))
                )
            else:
                outcomes.append(
                    CompletionOutcome(item["request_id"], error=error_from_problem(409, error))
                )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError("bad_answer", f"complete answer: {exc!r}") from None
    if len(outcomes) != len(completions):
        raise ProtocolError("bad_answer", "one outcome per completion expected")
    return outcomes


async def fail(
    host: QueueHost, workspace_id: str, request_id: str, claim_token: str, error: Any
) -> tuple[str, float | None]:
    """Record an unexpected error: `(status, available_at)` — pending again after the server's
    failure backoff, or `poison` at `max_dequeues`. Raises `LeaseLostError` if refused."""
    path = ws_path(workspace_id, "requests", request_id, "fail")
    answer = await retried(host, "POST", path, body={"claim_token": claim_token, "error": error})
    return str(answer["status"]), answer.get("available_at")
