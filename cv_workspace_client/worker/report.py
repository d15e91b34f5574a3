"""How the worker reports a run to the queue (docs/queue.md; docs/stages.md): complete it with its
result (uploading a big one to the blob store first) or with an error payload, fail it, or report it
cancelled — each fenced by the claim token, so a report refused with `lease_lost` changes
nothing. `Worker` decides which; `worker.outcome` says what is an answer.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any, Literal

from cv_workspace_client._queue import holder as api
from cv_workspace_client.errors import InvalidRequestError, WorkspaceError
from cv_workspace_client.stage import LeaseLostError
from cv_workspace_client.worker.io import ClaimAlong, Completer

if TYPE_CHECKING:
    from cv_workspace_client.worker.stats import WorkerStats

__all__ = ["Reporter"]

logger = logging.getLogger("cv_workspace_client.worker")


class Reporter:
    """The worker's reports, counted in its `stats` (a `WorkerStats`)."""

    def __init__(
        self,
        client: api.QueueHost,
        completer: Completer,
        stats: WorkerStats,
        *,
        batch_result_max_bytes: int,
        along: ClaimAlong | None = None,
    ) -> None:
        self._client = client
        self._along = along
        self._completer = completer
        self.stats = stats
        self._batch_result_max_bytes = batch_result_max_bytes

    async def success(
        self,
        claimed: api.Claim,
        kind: Literal["result", "error"],
        value: Any,
        cache: Literal["hit", "miss"] | None,
        telemetry: dict[str, Any] | None,
    ) -> Literal["result", "error"] | None:
        """Complete the request with `value`; return what it completed with ("error" for a
        result past the server's `max_result_bytes`, completed with `result_too_large`), or
        None if it reported a failure instead (the value has no JSON form). Raises what the
        completion raises."""
        row = claimed.request
        item: dict[str, Any] = {"request_id": row.request_id}
        item["claim_token"] = claimed.claim_token
        if kind == "error":
            item["error"] = value
        else:
            item["result"] = value
        if cache is not None:
            item["cache"] = cache
        if telemetry is not None:
            item["telemetry"] = telemetry
        text = ""
        try:
            if not isinstance(value, int | float | bool) and value is not None:
                text = json.dumps(value, separators=(",", ":"), allow_nan=False)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{value} is not JSON")
        except (TypeError, ValueError) as exc:
            await self.failure(claimed, {"code": "invalid_result", "message": f"not JSON: {exc}"})
            return None
        # ASCII (json.dumps escapes the rest): its length is its size in bytes.
        size = len(text)
        if kind == "result" and size > self._batch_result_max_bytes:
            # A big payload goes to the blob store, the completion names it. Uploaded
            # as its own body (up to the server's max_result_bytes), never inside a completion,
            # whose body the server bounds far lower.
            del item["result"]
            try:
                item["blob_ref"] = await api.upload_result(
                    self._client,
                    row.workspace_id,
                    row.request_id,
                    claimed.claim_token,
                    text.encode("ascii"),
                )
            except InvalidRequestError as exc:
                if exc.code != "result_too_large":
                    raise
                # An answer, not a failure: the same run makes the same result again.
                kind = "error"
                item["error"] = {
                    "code": "result_too_large",
                    "message": exc.message,
                    "details": {"bytes": size},
                }
        elif size > self._batch_result_max_bytes:  # a large error payload: alone
            await api.complete(
                self._client,
                row.workspace_id,
                row.request_id,
                claimed.claim_token,
                error=item.get("error"),
                cache=cache,
                telemetry=telemetry,
            )
            return kind
        await self._completer.complete(row.workspace_id, item)
        return kind

    async def refused_completion(self, claimed: api.Claim, exc: WorkspaceError) -> None:
        """The server refused the completion for good (a final 4xx): complete the request with
        that refusal as its error payload — once, never retried toward poison. If even that is
        refused, report a failure (its backoff and cutoff then apply)."""
        row = claimed.request
        error = {
            "code": "result_refused",
            "message": f"the server refused the completion: {exc.code}: {exc.message}"[:2000],
            "details": {"code": exc.code},
        }
        item = {"request_id": row.request_id, "claim_token": claimed.claim_token, "error": error}
        try:
            await self._completer.complete(row.workspace_id, item)
        except LeaseLostError:
            self.lease_lost(row, "its completion was refused")
            return
        except InvalidRequestError:
            await self.failure(claimed, error)
            return
        except WorkspaceError as unanswered:
            logger.warning("could not complete %s: %s", row.request_id, unanswered)
            return
        self.stats.expected_errors += 1

    async def failure(self, claimed: api.Claim, error: dict[str, Any]) -> None:
        """Report an unexpected error, with the worker's next claim if it wants one (`along`):
        a refused report still claims (docs/queue.md)."""
        row = claimed.request
        ask = None if self._along is None else self._along.ask()
        taken: list[api.Claim] = []
        try:
            if ask is None:
                status, _ = await api.fail(
                    self._client, row.workspace_id, row.request_id, claimed.claim_token, error
                )
            else:
                reported = await api.fail(
                    self._client,
                    row.workspace_id,
                    row.request_id,
                    claimed.claim_token,
                    error,
                    claim_next=ask,
                )
                taken = reported.claimed
                [outcome] = reported.outcomes
                if outcome.error is not None:
                    raise outcome.error
                status = str(outcome.status)
        except LeaseLostError:
            self.lease_lost(row, "its failure report was refused")
            return
        except WorkspaceError as exc:
            # The lease lapses and the row re-drives: the failure is retried all the same.
            logger.warning("could not report the failure of %s: %s", row.request_id, exc)
            return
        finally:
            if ask is not None and self._along is not None:
                self._along.settle(ask, taken)
        self.stats.failed += 1
        logger.info("request %s failed, now %s", row.request_id, status)

    async def cancelled(self, claimed: api.Claim) -> None:
        """Tell the server the stage stopped on a cancel: the holder's `fail`, which finishes a
        request whose cancel was requested as `cancelled` (never retried). Unreported (a lost
        answer, a server away), the lease lapses and the next claim parks it as cancelled."""
        row = claimed.request
        error = {"code": "cancelled", "message": "the stage stopped: the request was cancelled"}
        try:
            status, _ = await api.fail(
                self._client, row.workspace_id, row.request_id, claimed.claim_token, error
            )
        except LeaseLostError:
            self.lease_lost(row, "its cancellation report was refused")
            return
        except WorkspaceError as exc:
            logger.warning("could not report the cancellation of %s: %s", row.request_id, exc)
            return
        self.stats.cancelled += 1
        logger.info("request %s cancelled, now %s", row.request_id, status)

    def lease_lost(self, row: api.QueuedRequest, why: str) -> None:
        self.stats.leases_lost += 1
        logger.warning("request %s: lease lost (%s); completing nothing", row.request_id, why)
