"""The values the queue verbs answer with (docs/queue.md): request rows, enqueue answers, wait
outcomes, claims. Pure data: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cv_workspace_client.errors import OpRejectedError, ProtocolError, WorkspaceError
from cv_workspace_client.models import Commit

__all__ = [
    "FINISHED_STATUSES",
    "STATUSES",
    "AppliedAndEnqueued",
    "Claim",
    "ClaimNext",
    "CompletionOutcome",
    "EnqueueItem",
    "EnqueuedRequest",
    "OutcomeStatus",
    "QueuedRequest",
    "RequestOutcome",
    "RequestStatus",
    "ThenClaimed",
]

RequestStatus = Literal["pending", "in_progress", "done", "poison", "cancelled"]
OutcomeStatus = Literal["done", "poison", "cancelled", "timeout"]

#: Every status a request row may have, in lifecycle order.
STATUSES: tuple[RequestStatus, ...] = ("pending", "in_progress", "done", "poison", "cancelled")
#: The statuses of a request that will not run again unless someone asks on purpose.
FINISHED_STATUSES: frozenset[str] = frozenset({"done", "poison", "cancelled"})


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One request row as the server shows it (`GET .../requests/{id}`). `raw` keeps the JSON as
    received, members this SDK does not know included.

    `cancel_requested`: someone cancelled it while a worker ran it (it turns `cancelled` once the
    worker stops). `unclaimed_seconds`: how long it has been claimable without any worker
    claiming it (None while a worker holds it, once finished, or when the answer did not say) —
    a figure that keeps growing points at a stage no worker serves."""

    request_id: str
    workspace_id: str
    stage: str
    status: RequestStatus
    job_id: str | None = None
    branch_path: str | None = None
    input: Any = None
    worker_class: str | None = None
    run: int = 1
    claimed_by: str | None = None
    lease_expires_at: float | None = None
    available_at: float | None = None
    dequeue_count: int = 0
    max_dequeues: int | None = None
    result: Any = None
    error: Any = None
    blob_ref: str | None = None
    cache: str | None = None
    created_at: float | None = None
    claimed_at: float | None = None
    finished_at: float | None = None
    telemetry: Any = None
    cancel_requested: bool = False
    unclaimed_seconds: float | None = None
    concurrency_key: str | None = None
    max_running_per_key: int | None = None
    #: The clock of the op-log commit that enqueued it (`apply_ops_and_enqueue`): the sub-doc is
    #: at least at this clock when its stage runs. None: enqueued on its own.
    caused_by_clock: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @classmethod
    def from_json(cls, data: Any) -> QueuedRequest:
        if not isinstance(data, dict):
            raise ProtocolError("bad_answer", "a request row must be a JSON object")
        try:
            return cls(
                request_id=str(data["request_id"]),
                workspace_id=str(data["workspace_id"]),
                stage=str(data["stage"]),
                status=data["status"],
                job_id=data.get("job_id"),
                branch_path=data.get("branch_path"),
                input=data.get("input"),
                worker_class=data.get("worker_class"),
                run=int(data.get("run", 1)),
                claimed_by=data.get("claimed_by"),
                lease_expires_at=data.get("lease_expires_at"),
                available_at=data.get("available_at"),
                dequeue_count=int(data.get("dequeue_count", 0)),
                max_dequeues=data.get("max_dequeues"),
                result=data.get("result"),
                error=data.get("error"),
                blob_ref=data.get("blob_ref"),
                cache=data.get("cache"),
                created_at=data.get("created_at"),
                claimed_at=data.get("claimed_at"),
                finished_at=data.get("finished_at"),
                telemetry=data.get("telemetry"),
                cancel_requested=bool(data.get("cancel_requested", False)),
                unclaimed_seconds=_seconds(data.get("unclaimed_seconds")),
                concurrency_key=data.get("concurrency_key"),
                max_running_per_key=data.get("max_running_per_key"),
                caused_by_clock=data.get("caused_by_clock"),
                raw=data,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError("bad_answer", f"request row: {exc!r}") from None


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"unclaimed_seconds must be a number: {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    """One request of a batched enqueue (`enqueue_many`): the arguments of a single `enqueue`,
    with the same defaults (a `job_id` makes the id deterministic unless `deterministic=False`)."""

    stage: str
    job_id: str | None = None
    branch_path: str | None = None
    input: Any = None
    deterministic: bool | None = None
    rerun: bool = False
    worker_class: str | None = None
    max_dequeues: int | None = None
    concurrency_key: str | None = None
    max_running_per_key: int | None = None

    def to_body(self) -> dict[str, Any]:
        """The item as the single enqueue's body: only the members that are set."""
        body: dict[str, Any] = {"stage": self.stage}
        for name, value in (
            ("job_id", self.job_id),
            ("branch_path", self.branch_path),
            ("input", self.input),
            ("deterministic", self.deterministic),
            ("worker_class", self.worker_class),
            ("max_dequeues", self.max_dequeues),
            ("concurrency_key", self.concurrency_key),
            ("max_running_per_key", self.max_running_per_key),
        ):
            if value is not None:
                body[name] = value
        if self.rerun:
            body["rerun"] = True
        return body


@dataclass(frozen=True, slots=True)
class EnqueuedRequest:
    """The answer to an enqueue: the request's id and status; `coalesced` when an existing row
    absorbed it (an identical live request, or a finished deterministic one); `input_differs`
    when that row's input is not the one sent — yours was not used: wait for it and enqueue
    again with `rerun=True` to run it on your input; `replayed` when the server answered from a
    stored Idempotency-Key response."""

    request_id: str
    status: RequestStatus
    coalesced: bool
    stream_url: str
    replayed: bool = False
    input_differs: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "status": self.status,
            "coalesced": self.coalesced,
            "input_differs": self.input_differs,
            "stream_url": self.stream_url,
            "replayed": self.replayed,
        }


@dataclass(frozen=True, slots=True)
class AppliedAndEnqueued:
    """The answer to `apply_ops_and_enqueue`: one outcome per op (a `Commit` or the op's
    `OpRejectedError`), and one answer per enqueue item, in order. An item is None when
    nothing was enqueued for it: the batch applied no op and no request has its id (docs/queue.md,
    "Start work with the change that needs it")."""

    results: list[Commit | OpRejectedError]
    enqueued: list[EnqueuedRequest | None]


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How a wait ended. `status` is `done`, `poison`, `cancelled` (someone cancelled it; writes
    its stage committed before it stopped stay committed), or `timeout` — the deadline passed
    and the work goes on: keep `request_id` and wait again or `get_request` later.

    `result` is the stage's result (fetched from the blob store when it was large); `error` the
    expected error payload (done) or the last unexpected error (poison). `request` is the row as
    last seen (None if the server never showed it).
    """

    request_id: str
    status: OutcomeStatus
    request: QueuedRequest | None = None
    result: Any = None
    error: Any = None

    @property
    def timed_out(self) -> bool:
        return self.status == "timeout"

    @property
    def ok(self) -> bool:
        """Done without an error payload."""
        return self.status == "done" and self.error is None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"request_id": self.request_id, "status": self.status}
        if self.status == "timeout":
            data["request_status"] = None if self.request is None else self.request.status
        else:
            data["result"] = self.result
            data["error"] = self.error
        if self.request is not None:
            data["request"] = self.request.raw
        return data


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed request and the token that fences every later verb on it."""

    claim_token: str
    request: QueuedRequest


@dataclass(frozen=True, slots=True)
class CompletionOutcome:
    """One item of a batched complete: the new status, or the error that refused it."""

    request_id: str
    status: str | None = None
    error: WorkspaceError | None = None


@dataclass(frozen=True, slots=True)
class ClaimNext:
    """A claim sent along with a report (`complete`, `complete_many`, `fail` with
    `claim_next=`): the body of `POST /v1/queue/claim`, committed in the report's transaction
    (docs/queue.md, "report and claim")."""

    worker_classes: Sequence[str]
    worker_id: str
    limit: int = 1

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("limit must be >= 1")

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_classes": list(self.worker_classes),
            "worker_id": self.worker_id,
            "limit": self.limit,
        }


@dataclass(frozen=True, slots=True)
class ThenClaimed:
    """A report and the claim sent with it: one outcome per report, in order (the new status,
    or the error that refused it — a refused report does not stop the claim), and the requests
    claimed. `available_at` is a `fail`'s: when the request is claimable again."""

    outcomes: list[CompletionOutcome]
    claimed: list[Claim]
    available_at: float | None = None
