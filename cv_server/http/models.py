"""The bodies of the HTTP API as pydantic models: what the routes parse requests with, and what
the OpenAPI document (`cv_server.http.openapi`, `GET /openapi.json`) is generated from.

Request models are strict (JSON types as sent: `"1"` is not an integer, `1` is not a boolean).
Response models describe the answers the routes build; the schemathesis test
(`tests/observe/test_openapi_live.py`) holds every answer of the live server to them.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from cv_mutations import Op
from cv_server.http.problems import Problem

__all__ = [
    "BATCH_ITEMS_MAX",
    "SCHEDULE_NAME_PATTERN",
    "AppliedOp",
    "ApplyBody",
    "ApplyEnqueueAnswer",
    "ApplyResults",
    "BatchCompleteBody",
    "BatchCompleteClaimed",
    "BatchCompleteResults",
    "BatchCompletion",
    "BatchEnqueueBody",
    "BatchEnqueueResults",
    "ClaimBody",
    "ClaimMany",
    "ClaimOne",
    "ClaimTokenBody",
    "ClaimedRequest",
    "CompleteAnswer",
    "CompleteBody",
    "CompleteClaimed",
    "CompletedItem",
    "DocList",
    "DocState",
    "EnqueueAnswer",
    "EnqueueBody",
    "ErrorInfo",
    "FailAnswer",
    "FailBody",
    "FailClaimed",
    "Health",
    "HeartbeatAnswer",
    "HeldLock",
    "LockAcquireBody",
    "LockAcquired",
    "LockList",
    "LockLocked",
    "LockReleaseBody",
    "LockReleased",
    "LogEntryOut",
    "NodeOut",
    "OpsPage",
    "Pending",
    "ProblemDetails",
    "QueueRequest",
    "Ready",
    "RefusedClaimed",
    "RefusedItem",
    "RejectedOp",
    "RequestGrant",
    "RequestList",
    "ScheduleAnswer",
    "ScheduleBody",
    "ScheduleList",
    "StateOut",
    "SubDocHeadOut",
    "TokenRevoked",
    "UploadAnswer",
    "parse_body",
]

M = TypeVar("M", bound=BaseModel)

#: Text a PostgreSQL column can hold (no NUL), 1..n characters.
_NO_NUL = r"^[^\x00]*$"
Name64 = Annotated[str, Field(min_length=1, max_length=64, pattern=_NO_NUL)]
Name256 = Annotated[str, Field(min_length=1, max_length=256, pattern=_NO_NUL)]
Token = Annotated[str, Field(min_length=1, pattern=_NO_NUL)]
RequestStatus = Literal["pending", "in_progress", "done", "poison", "cancelled"]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Closed(_Body):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


def parse_body(model: type[M], body: Any) -> M:
    """`body` (decoded JSON) as `model`: 400 `malformed_json` when it is not an object, 422
    `invalid_field` naming the first member that breaks its rule."""
    if not isinstance(body, dict):
        raise Problem(400, "malformed_json", "body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise Problem(422, "invalid_field", f"{where}: {first['msg']}") from None


# -- errors ---------------------------------------------------------------------------------------


class ProblemDetails(BaseModel):
    """RFC 9457 problem details, with the stable `code` clients branch on. Some problems add
    members of their own (`op_index`: which op of a batch; `version_conflict`: the sub-doc's
    `clock` and the batch's `results`)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    code: str


# -- health ---------------------------------------------------------------------------------------


class Health(_Answer):
    status: Literal["ok"]


class Ready(_Answer):
    status: Literal["ready"]


# -- op-log ---------------------------------------------------------------------------------------


class ApplyBody(_Closed):
    """Ops to apply to one sub-doc, in order; `atomic`: all or nothing."""

    model_config = ConfigDict(strict=False, extra="forbid", frozen=True)

    ops: Annotated[
        list[Op],
        Field(
            min_length=1,
            description="1 to the server's `max_ops_per_request` (1,000 by default) ops;"
            " more is 422 `too_many_ops`, none 422 `invalid_field`",
        ),
    ]
    atomic: bool = False
    if_clock: int | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="Compare-and-set: apply only if the sub-doc's clock is still exactly this;"
        " else nothing is applied and the answer is 409 `version_conflict` carrying the"
        " current `clock` (docs/ops.md#conflicts)",
    )
    enqueue: (
        Annotated[list[EnqueueBody], Field(min_length=1, max_length=BATCH_ITEMS_MAX)] | None
    ) = Field(
        default=None,
        description="Stage runs to queue in the same transaction as the ops, each as the"
        " enqueue route's body: only if the batch newly applies an op, each request naming"
        " the clock of its last applied op (`caused_by_clock`); needs the `enqueue` scope"
        " (docs/queue.md#start-work-with-the-change-that-needs-it)",
    )


class AppliedOp(_Answer):
    op_id: str | None
    clock: int | None = Field(
        description="The op's clock; null only with `duplicate: true` for a lane op decided"
        " before and no longer on record (docs/ops.md#exactly-once): never applied again"
    )
    duplicate: bool


class ErrorInfo(_Answer):
    code: str
    message: str
    expected_seq: int | None = Field(
        default=None, description="`seq_gap`: the seq the lane expects next"
    )
    clock: int | None = Field(
        default=None,
        description="`op_expired`, `version_conflict`: the sub-doc's head clock",
    )


class RejectedOp(_Answer):
    op_id: str | None
    error: ErrorInfo
    duplicate: bool


class ApplyResults(_Answer):
    """One result per op, in order; with `enqueue`, one answer per item too."""

    results: list[AppliedOp | RejectedOp]
    enqueued: list[ApplyEnqueueAnswer] | None = Field(
        default=None,
        description="With `enqueue`: one answer per item, in order, as the enqueue route's",
    )


class NodeOut(_Answer):
    parent: str | None
    children: list[str]
    fields: dict[str, JsonValue]


class StateOut(_Answer):
    nodes: dict[str, NodeOut]


class DocState(_Answer):
    clock: int
    state: StateOut


class LogEntryOut(_Answer):
    clock: int
    op_id: str | None
    committed_at: float | None = Field(
        default=None,
        description="When the op committed (Unix seconds); absent from servers before it was added",
    )
    op: dict[str, JsonValue]


class OpsPage(_Answer):
    clock: int = Field(description="The head clock of the sub-doc")
    ops: list[LogEntryOut]


# -- queue ----------------------------------------------------------------------------------------


class EnqueueBody(_Closed):
    """A stage run to queue. With `job_id` the request id is derived from (workspace, job,
    branch, stage), so the same enqueue coalesces instead of forking (`deterministic`)."""

    stage: Name64
    job_id: Name256 | None = None
    branch_path: Annotated[str, Field(min_length=1, max_length=1024, pattern=_NO_NUL)] | None = None
    input: Any = Field(default=None, description="Any JSON: the stage's input")
    worker_class: Name64 | None = None
    deterministic: bool | None = None
    max_dequeues: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    rerun: bool = False
    concurrency_key: Name256 | None = Field(
        default=None,
        description="Requests of the workspace sharing this key share its running slots"
        " (docs/queue.md, Concurrency keys)",
    )
    max_running_per_key: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = Field(
        default=None,
        description="Start this request only while fewer of its key run (needs concurrency_key;"
        " absent: unlimited)",
    )


class RequestGrant(_Answer):
    """The scopes and sub-doc grants (null: all) of the token that enqueued a request."""

    scopes: list[str]
    sub_docs: list[str] | None


class QueueRequest(_Answer):
    request_id: str
    workspace_id: str
    stage: str
    job_id: str | None
    branch_path: str | None
    input: JsonValue
    worker_class: str
    status: RequestStatus
    run: int
    claimed_by: str | None
    lease_expires_at: float | None
    available_at: float
    dequeue_count: int
    max_dequeues: int
    result: JsonValue
    error: JsonValue
    blob_ref: str | None
    cache: Literal["hit", "miss"] | None
    created_at: float
    claimed_at: float | None
    finished_at: float | None
    telemetry: JsonValue
    cancel_requested: bool = Field(description="A cancel is asked for; its holder stops soon")
    enqueue_grant: RequestGrant | None = Field(
        default=None,
        description="The grant of the token that enqueued it (null: every scope and sub-doc);"
        " a stage's writes for it stay inside it (docs/queue.md)",
    )
    caused_by_clock: int | None = Field(
        default=None,
        description="The clock of the op-log commit that enqueued it (an apply's `enqueue`):"
        " the sub-doc is at least at this clock when the stage runs; null: enqueued on its own"
        " (docs/queue.md#start-work-with-the-change-that-needs-it)",
    )
    unclaimed_seconds: float | None = Field(
        default=None, description="How long it has waited unclaimed (on some routes)"
    )
    concurrency_key: str | None = Field(
        default=None, description="Its concurrency key (null: none)"
    )
    max_running_per_key: int | None = Field(
        default=None, description="It starts only while fewer of its key run (null: no limit)"
    )


class ClaimedRequest(QueueRequest):
    claim_token: str


class EnqueueAnswer(_Answer):
    request_id: str
    status: RequestStatus
    coalesced: bool
    input_differs: bool = Field(
        description="Coalesced into a request whose input differs: the input sent was not used"
    )
    stream_url: str


class ApplyEnqueueAnswer(_Answer):
    """An apply's `enqueue` item, answered as the enqueue route answers it. An apply that newly
    applied no op (a resend of one that committed, a rejected batch) enqueued nothing: the item
    is answered from the request its id names (`coalesced: true`), or with `status: null`."""

    request_id: str
    status: RequestStatus | None = Field(description="null: not enqueued (nothing was applied)")
    coalesced: bool
    input_differs: bool = Field(
        description="Coalesced into a request whose input differs: the input sent was not used"
    )
    stream_url: str | None


class BatchEnqueueBody(_Closed):
    """Many stage runs to queue in one commit: each item has exactly the members of the single
    enqueue's body (`EnqueueBody`)."""

    requests: Annotated[list[EnqueueBody], Field(min_length=1, max_length=BATCH_ITEMS_MAX)]


class BatchEnqueueResults(_Answer):
    """One answer per item, in order, each as the single enqueue answers it."""

    results: list[EnqueueAnswer]


class SubDocHeadOut(_Answer):
    sub_doc: str
    clock: int = Field(description="The head clock: the last committed op's")
    committed_at: float = Field(description="When that op committed, epoch seconds")
    horizon: int = Field(
        description="The lowest clock still in the log (ops below it were compacted;"
        " docs/operating.md, Storage over time)"
    )


class DocList(_Answer):
    docs: list[SubDocHeadOut]
    next_after: str | None = Field(description="Pass as `?after=` for the next page")


class HeldLock(_Answer):
    job_id: str
    task: str
    holder: str
    acquired_at: float
    expires_at: float
    expires_in: float = Field(description="Seconds left, on the store's clock")


class LockList(_Answer):
    locks: list[HeldLock]
    ttl: float = Field(description="The server's compute-lock TTL, seconds")
    next_after: str | None = Field(description="Pass as `?after=` for the next page")


class RequestList(_Answer):
    requests: list[QueueRequest]
    next_after: str | None = Field(description="Pass as `?after=` for the next page")


class ClaimBody(_Body):
    worker_classes: Annotated[list[Name64], Field(min_length=1)]
    worker_id: Name256 | None = None
    limit: Annotated[int, Field(ge=1, le=1000)] | None = Field(
        default=None, description="Claim up to this many at once (one transaction)"
    )


class _ClaimsNext(_Body):
    """A report that may carry the worker's next claim (docs/queue.md, "report and claim")."""

    claim_next: ClaimBody | None = Field(
        default=None,
        description="Claim as `POST /v1/queue/claim` would, in the report's transaction"
        " (`limit` defaults to 1); the answer then lists the rows claimed as `claimed`",
    )


class ClaimOne(_Answer):
    request: ClaimedRequest


class ClaimMany(_Answer):
    requests: list[ClaimedRequest]


class ClaimTokenBody(_Body):
    claim_token: Token


class _Completion(ClaimTokenBody):
    # Payloads are any JSON, checked by the route for what the store can keep (nesting, 64-bit
    # integers), not walked here: a result may be large.
    result: Any = Field(default=None, description="Any JSON: the stage's answer")
    error: Any = Field(default=None, description="An expected error: an answer, final")
    cache: Literal["hit", "miss"] | None = None
    blob_ref: Name256 | None = Field(
        default=None, description="An uploaded result (`POST .../result`) instead of `result`"
    )
    telemetry: Any = Field(
        default=None,
        description="The run's figures (wall_s, cpu_s, rss_bytes, provider_calls, provider_s);"
        " fire-and-forget: telemetry the server cannot store is dropped, never refused",
    )


class CompleteBody(_Completion, _ClaimsNext):
    pass


class FailBody(ClaimTokenBody, _ClaimsNext):
    error: Any = Field(default=None, description="Any JSON: the unexpected error, kept on the row")


class BatchCompletion(_Completion):
    request_id: Token


#: Most items in one batch call: the completions of `POST /v1/queue/complete` and the enqueues
#: of `POST /v1/workspaces/{ws}/requests/batch` (docs/limits.md).
BATCH_ITEMS_MAX: Final = 1000


class BatchCompleteBody(_ClaimsNext):
    completions: Annotated[list[BatchCompletion], Field(min_length=1, max_length=BATCH_ITEMS_MAX)]


class CompletedItem(_Answer):
    request_id: str
    status: RequestStatus


class RefusedItem(_Answer):
    request_id: str
    error: ErrorInfo


class BatchCompleteResults(_Answer):
    results: list[CompletedItem | RefusedItem]


class CompleteAnswer(_Answer):
    status: RequestStatus


class FailAnswer(_Answer):
    status: RequestStatus
    available_at: float


class _ClaimedAlong(_Answer):
    claimed: list[ClaimedRequest] = Field(
        description="The rows `claim_next` claimed in the report's transaction (maybe none)"
    )


class CompleteClaimed(_ClaimedAlong):
    """`complete` with `claim_next`, the completion accepted."""

    status: RequestStatus


class FailClaimed(_ClaimedAlong):
    """`fail` with `claim_next`, the failure accepted."""

    status: RequestStatus
    available_at: float


class RefusedClaimed(_ClaimedAlong):
    """`complete` / `fail` with `claim_next`, the report refused (`lease_lost`, ...: nothing
    reported) while the claim went ahead."""

    error: ErrorInfo


class BatchCompleteClaimed(BatchCompleteResults):
    """`POST /v1/queue/complete` with `claim_next`."""

    claimed: list[ClaimedRequest]


class HeartbeatAnswer(_Answer):
    lease_expires_at: float | None


class UploadAnswer(_Answer):
    blob_ref: str
    bytes: int


class Pending(_Answer):
    pending: Literal[True]


# -- compute locks --------------------------------------------------------------------------------


class LockAcquireBody(_Body):
    job_id: Name256
    task: Name256
    holder: Name256 = "anonymous"


class LockReleaseBody(_Body):
    job_id: Name256
    task: Name256
    token: Token


class _LockTiming(_Answer):
    expires_at: float = Field(description="On the server's clock")
    expires_in: float = Field(description="Seconds left, as of the answer")
    ttl: float


class LockAcquired(_LockTiming):
    acquired: Literal[True]
    token: str


class LockLocked(_LockTiming):
    acquired: Literal[False]
    locked: Literal[True]
    holder: str | None


class LockReleased(_Answer):
    released: bool


# -- tokens ---------------------------------------------------------------------------------------


class TokenRevoked(_Answer):
    token_id: str
    revoked: Literal[True]
    newly: bool = Field(description="False when the token was revoked already")
    expires_at: int | None = Field(
        description="When the entry goes (the token expires anyway); null: never"
    )


#: A schedule's name: it is a path segment (`/schedules/{name}`).
SCHEDULE_NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"


class ScheduleBody(_Closed):
    """A schedule to add: exactly one of `cron` (five UTC fields) and `interval_seconds`."""

    name: Annotated[
        str, Field(pattern=SCHEDULE_NAME_PATTERN, description="Unique in the workspace")
    ]
    cron: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        default=None, description="Five fields, minute hour day month weekday, in UTC"
    )
    interval_seconds: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    enqueue: EnqueueBody = Field(description="What each firing enqueues (as the enqueue route)")
    missed: Literal["skip", "one", "all"] = Field(
        default="one", description="Due times missed while no scheduler ran: none, the latest, all"
    )
    overlap: Literal["skip", "queue"] = Field(
        default="skip", description="While the last firing's request is live: skip, or queue"
    )
    paused: bool = False


class ScheduleAnswer(_Answer):
    schedule_id: str
    workspace_id: str
    name: str
    cron: str | None
    interval_seconds: int | None
    enqueue: dict[str, JsonValue]
    missed: Literal["skip", "one", "all"]
    overlap: Literal["skip", "queue"]
    paused: bool
    enqueue_grant: RequestGrant | None = Field(
        description="The grant of the token that added it (null: every scope and sub-doc);"
        " each firing's request runs under it"
    )
    created_at: float
    next_fire_at: float | None = Field(description="The next due time (null while paused)")
    last_fired_at: float | None = Field(description="The due time of the latest firing")
    last_request_id: str | None = Field(description="The request the latest firing enqueued")
    skipped: int = Field(description="Due times it enqueued nothing for (overlap, missed runs)")


class ScheduleList(_Answer):
    schedules: list[ScheduleAnswer]
    next_after: str | None
