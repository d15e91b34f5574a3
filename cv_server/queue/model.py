"""The work queue's rows and state machine (layer 1, docs/queue.md). Pure: no I/O,
no clock, no randomness — `now`, tokens and ids are parameters, so every rule is testable alone
and every backend (SQLite, PostgreSQL) applies the very same rules.

Statuses: `pending → in_progress → done | poison | cancelled`.

    pending ──claim──▶ in_progress ──complete──▶ done   (a result, or an expected error: an answer)
       ▲  │               │  │
       │  │◀─fail(backoff)┘  └──fail / lease lapsed with dequeue_count ≥ max_dequeues──▶ poison
       │  │◀─────────────── lease lapsed: claimable again as it stands (that IS the retry) ─┘
       │  └──cancel──▶ cancelled ◀──holder stops (fail) / lease lapses── in_progress,
       │                                                                   cancel_requested
       └──replay_poison (by hand) / rerun (on purpose) ◀── poison / done / cancelled

Cancelling a pending request finishes it at once; cancelling one in progress only marks it
`cancel_requested` (its holder is running it: the row says so until the holder stops, learning
of it at its next heartbeat, or its lease lapses). Done and poison rows are not cancellable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from cv_server.config import ServerConfig
from cv_server.queue.errors import (
    InvalidTransition,
    LeaseLost,
    NotCancellable,
    NotDiscardable,
    QueueError,
    RequestCancelled,
    RequestIdConflict,
    RequestNotFound,
)

__all__ = [
    "CONCURRENCY_KEY_MAX",
    "FINISHED_STATUSES",
    "LIVE_STATUSES",
    "MAX_RUNNING_PER_KEY_MAX",
    "PURGED_STATUSES",
    "STATUSES",
    "BatchCompletion",
    "BatchEnqueue",
    "CacheOutcome",
    "ClaimAsk",
    "ClaimPlan",
    "Completion",
    "EnqueueAsk",
    "Enqueued",
    "Failure",
    "NewRequest",
    "ProcessRequest",
    "RequestEvent",
    "RequestStatus",
    "ThenClaimed",
    "Transition",
    "TransitionKind",
    "cancel",
    "caused_by",
    "check_cache",
    "check_concurrency",
    "check_lease",
    "claim",
    "complete",
    "complete_batch",
    "decide_enqueue",
    "deterministic_request_id",
    "discard_poison",
    "enqueue_batch",
    "fail",
    "fail_report",
    "fence",
    "heartbeat",
    "held_back_by_key",
    "input_differs",
    "is_claimable",
    "is_exhausted",
    "is_parked_on_lapse",
    "new_row",
    "park_lapsed",
    "poison_exhausted",
    "random_request_id",
    "replay_poison",
    "unclaimed_seconds",
]

RequestStatus = Literal["pending", "in_progress", "done", "poison", "cancelled"]
#: The verb behind a committed status change (`RequestEvent.kind`): `poisoned` is a claim parking
#: a row whose last allowed worker died; a `failed` may also leave the row poison; `cancelled`
#: is a cancel that took effect (at once, or when its holder or a claim let go of the row).
TransitionKind = Literal[
    "enqueued", "claimed", "done", "failed", "poisoned", "replayed", "cancelled"
]
CacheOutcome = Literal["hit", "miss"]

#: A request that may still run: an identical enqueue coalesces into it.
LIVE_STATUSES: Final[tuple[RequestStatus, ...]] = ("pending", "in_progress")
#: A request that will not run again unless someone asks on purpose (rerun, replay).
FINISHED_STATUSES: Final[tuple[RequestStatus, ...]] = ("done", "poison", "cancelled")
#: What the background pass deletes once `ServerConfig.request_retention_seconds` passed since the
#: row finished (docs/queue.md): a poison row stays until an operator replays or discards it.
PURGED_STATUSES: Final[tuple[RequestStatus, ...]] = ("done", "cancelled")
#: Every status, in lifecycle order (what the list route and the CLI accept).
STATUSES: Final[tuple[RequestStatus, ...]] = (*LIVE_STATUSES, *FINISHED_STATUSES)

#: Prefix and version of the deterministic id recipe; bump the version if the recipe ever changes
#: (a changed recipe would fork every request enqueued before the upgrade).
_DETERMINISTIC_RECIPE: Final = "cv-request/v1"
#: 160 bits of sha256 (40 hex chars): collision-free in practice, and the id stays short and
#: within the `[A-Za-z0-9_-]{1,64}` id alphabet (docs/concepts.md).
_ID_HEX_CHARS: Final = 40

_DEFAULT_MAX_DEQUEUES: Final = ServerConfig().max_dequeues


def deterministic_request_id(
    workspace_id: str,
    job_id: str | None,
    branch_path: str | None,
    stage: str,
    scope_key: str | None = None,
) -> str:
    """The id of "run `stage` on job `job_id` at `branch_path` in `workspace_id`"
    (docs/concepts.md).

    Recipe (stable; changing it would fork requests already queued):
    `"d_" + sha256(canonical JSON of ["cv-request/v1", workspace_id, job_id, branch_path, stage])`
    truncated to 40 hex chars, where canonical JSON is `json.dumps(..., separators=(",", ":"),
    ensure_ascii=False)` encoded as UTF-8. A JSON array, not a joined string, so no field can
    bleed into the next (`("a|b", "c")` and `("a", "b|c")` differ) and `None` differs from `""`.
    The input is deliberately not part of it: re-enqueueing the same stage must not fork.
    A `scope_key` (`cv_server.scopes.grant_scope_key` of a limited enqueuer's grant) is appended
    to the array: requests enqueued under different grants never coalesce, while a full grant's
    ids (no key) stay what they always were.
    """
    parts = [_DETERMINISTIC_RECIPE, workspace_id, job_id, branch_path, stage]
    if scope_key is not None:
        parts.append(scope_key)
    canonical = json.dumps(parts, separators=(",", ":"), ensure_ascii=False)
    return "d_" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_ID_HEX_CHARS]


def random_request_id(random_hex: str) -> str:
    """The id of a request that must not coalesce with anything: `"r_"` + 40 random hex chars.

    Pass `secrets.token_hex(20)`; randomness stays a parameter (STYLE: ids are injected).
    """
    if len(random_hex) != _ID_HEX_CHARS or any(c not in "0123456789abcdef" for c in random_hex):
        raise ValueError(f"random_hex must be {_ID_HEX_CHARS} lowercase hex chars")
    return "r_" + random_hex


def check_lease(seconds: float, what: str = "lease") -> None:
    """Refuse a lease (or backoff) that is negative, NaN or infinite: it would park a row forever
    or make it claimable in the past."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{what} must be a finite number of seconds >= 0: {seconds!r}")


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What an enqueuer asks for. `request_id` is `deterministic_request_id(...)` when the stage
    declares re-enqueue must not fork, else `random_request_id(...)`.

    `worker_class` defaults to the stage name, so a worker claims exactly the stages it can run.
    """

    workspace_id: str
    stage: str
    request_id: str
    input: Any = None
    job_id: str | None = None
    branch_path: str | None = None
    worker_class: str | None = None
    max_dequeues: int = _DEFAULT_MAX_DEQUEUES
    #: The enqueuer's grant (`cv_server.scopes.enqueue_grant`), from its verified token: what a
    #: stage run for it may touch. None: every scope and sub-doc.
    enqueue_grant: Any = None
    #: Requests of one workspace sharing a key share its running slots (docs/queue.md,
    #: "Concurrency keys"); None: no key.
    concurrency_key: str | None = None
    #: This request starts only while fewer than this many requests of its key run (None:
    #: unlimited). Each row carries its own limit: it is the one that row is held to.
    max_running_per_key: int | None = None
    #: The clock of the op-log commit that enqueued it (an apply's `enqueue`, docs/queue.md,
    #: "Start work with the change that needs it"): the sub-doc is at least at this clock when
    #: the stage runs. None: enqueued on its own. The store stamps it inside the commit.
    caused_by_clock: int | None = None

    def __post_init__(self) -> None:
        # A row that may be claimed zero times would be pending forever and never poisoned.
        if self.max_dequeues < 1:
            raise ValueError(f"max_dequeues must be >= 1: {self.max_dequeues!r}")
        check_concurrency(self.concurrency_key, self.max_running_per_key)


#: The longest concurrency key (characters), as the enqueue body bounds it.
CONCURRENCY_KEY_MAX: Final = 256
#: The largest `max_running_per_key` (the store's integer column).
MAX_RUNNING_PER_KEY_MAX: Final = 2**31 - 1


def check_concurrency(key: str | None, limit: int | None) -> None:
    """Refuse a concurrency key that is empty or longer than `CONCURRENCY_KEY_MAX`, and a limit
    below 1 or above the store's integer, or one without a key (it would limit nothing)."""
    if key is not None and not 1 <= len(key) <= CONCURRENCY_KEY_MAX:
        raise ValueError(f"concurrency_key must be 1..{CONCURRENCY_KEY_MAX} characters")
    if limit is not None:
        if key is None:
            raise ValueError("max_running_per_key needs a concurrency_key")
        if isinstance(limit, bool) or not 1 <= limit <= MAX_RUNNING_PER_KEY_MAX:
            raise ValueError(f"max_running_per_key must be 1..{MAX_RUNNING_PER_KEY_MAX}: {limit!r}")


def _copy_json(value: Any) -> Any:
    """A copy of a JSON value sharing no mutable container with it (scalars are immutable)."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_json(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class ProcessRequest:
    """One row of `workspace_process_requests`.

    `run` counts deliberate re-runs of the same request id (1 for the first): a stage derives its
    write op_ids from `(request_id, run, write key)`, so attempts of one run dedupe their writes,
    while a rerun on purpose writes again. `claim_token` stays on a finished row so that the
    holder's retried `complete`/`fail` is answered, not refused; it is never shown to enqueuers
    (`to_json()` leaves it out). `cancel_requested` is set when someone cancels the request
    while a holder runs it: the holder's next heartbeat is refused (`RequestCancelled`), and the
    row turns `cancelled` when the holder reports back or its lease lapses.
    """

    request_id: str
    workspace_id: str
    stage: str
    job_id: str | None
    branch_path: str | None
    input: Any
    worker_class: str
    status: RequestStatus
    run: int
    claim_token: str | None
    claimed_by: str | None
    lease_expires_at: float | None
    available_at: float
    dequeue_count: int
    max_dequeues: int
    result: Any
    error: Any
    blob_ref: str | None
    cache: CacheOutcome | None
    created_at: float
    claimed_at: float | None
    finished_at: float | None
    telemetry: Any
    cancel_requested: bool = False
    #: The enqueuer's grant (`NewRequest.enqueue_grant`); a stage's writes for this request are
    #: held to it as well as to the worker's token (docs/queue.md).
    enqueue_grant: Any = None
    #: `NewRequest.concurrency_key` and `NewRequest.max_running_per_key`.
    concurrency_key: str | None = None
    max_running_per_key: int | None = None
    #: `NewRequest.caused_by_clock`: the clock of the commit that enqueued it (None: on its own).
    caused_by_clock: int | None = None

    @property
    def is_live(self) -> bool:
        return self.status in LIVE_STATUSES

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def to_json(
        self, *, include_claim_token: bool = False, now: float | None = None
    ) -> dict[str, Any]:
        """The row as JSON. The claim token is a capability: only its holder may see it.

        Given `now` (on the store's clock), the row also says how long it has waited
        unclaimed (`unclaimed_seconds`, see `unclaimed_seconds`): a request for a stage no
        worker serves shows a figure that only grows."""
        # Field for field, as `dataclasses.asdict` gives, but ~6x cheaper: every field is a
        # scalar except the JSON values, which are copied so that no caller can mutate the row
        # through the returned dict (pinned by tests/server/test_queue_model_json.py).
        data: dict[str, Any] = {
            "request_id": self.request_id,
            "workspace_id": self.workspace_id,
            "stage": self.stage,
            "job_id": self.job_id,
            "branch_path": self.branch_path,
            "input": _copy_json(self.input),
            "worker_class": self.worker_class,
            "status": self.status,
            "run": self.run,
        }
        if include_claim_token:
            data["claim_token"] = self.claim_token
        data.update(
            claimed_by=self.claimed_by,
            lease_expires_at=self.lease_expires_at,
            available_at=self.available_at,
            dequeue_count=self.dequeue_count,
            max_dequeues=self.max_dequeues,
            result=_copy_json(self.result),
            error=_copy_json(self.error),
            blob_ref=self.blob_ref,
            cache=self.cache,
            created_at=self.created_at,
            claimed_at=self.claimed_at,
            finished_at=self.finished_at,
            telemetry=_copy_json(self.telemetry),
            cancel_requested=self.cancel_requested,
            enqueue_grant=_copy_json(self.enqueue_grant),
            concurrency_key=self.concurrency_key,
            max_running_per_key=self.max_running_per_key,
            caused_by_clock=self.caused_by_clock,
        )
        if now is not None:
            data["unclaimed_seconds"] = unclaimed_seconds(self, now)
        return data


@dataclass(frozen=True, slots=True)
class Completion:
    """One `complete` of a batch: the holder's token and what the run produced (a result, or an
    expected error payload; a large result as `blob_ref`; `cache` hit/miss; telemetry)."""

    request_id: str
    claim_token: str
    result: Any = None
    error: Any = None
    blob_ref: str | None = None
    cache: CacheOutcome | None = None
    telemetry: Any = None

    def __post_init__(self) -> None:
        check_cache(self.cache)


def check_cache(cache: object) -> None:
    """`cache` says whether a TTL cache answered the run (docs/queue.md): "hit", "miss" or None."""
    if cache not in (None, "hit", "miss"):
        raise ValueError(f"cache must be 'hit', 'miss' or None: {cache!r}")


class Enqueued(NamedTuple):
    """What `enqueue` answers: the row, and whether an existing one absorbed the request."""

    row: ProcessRequest
    coalesced: bool


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A committed change of a request's status, as listeners see it.

    Small on purpose (ids and status, never bodies): PostgreSQL carries it in a NOTIFY payload,
    and a waiter re-reads the row with `get` (notify, then SELECT the row).
    """

    workspace_id: str
    request_id: str
    status: RequestStatus
    run: int
    worker_class: str
    #: What made the change, for this process's observers (metrics, logs): never on the wire, so
    #: an event heard from another instance carries only the fields above (and `kind=None`).
    kind: TransitionKind | None = field(default=None, compare=False)
    #: The claim (or the parking as poison) found the previous holder's lease lapsed.
    lapsed: bool = field(default=False, compare=False)
    #: The row after the change (local events only).
    row: ProcessRequest | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, row: ProcessRequest, kind: TransitionKind | None = None, *, lapsed: bool = False
    ) -> RequestEvent:
        return cls(
            row.workspace_id,
            row.request_id,
            row.status,
            row.run,
            row.worker_class,
            kind,
            lapsed,
            row,
        )


class Transition(NamedTuple):
    """A verb's outcome: the row after it, and whether anything must be written."""

    row: ProcessRequest
    changed: bool


# -- enqueue ---------------------------------------------------------------------------------------


def new_row(req: NewRequest, now: float) -> ProcessRequest:
    """The first run of `req`: pending and claimable from `now`."""
    return ProcessRequest(
        request_id=req.request_id,
        workspace_id=req.workspace_id,
        stage=req.stage,
        job_id=req.job_id,
        branch_path=req.branch_path,
        input=req.input,
        worker_class=req.worker_class or req.stage,
        status="pending",
        run=1,
        claim_token=None,
        claimed_by=None,
        lease_expires_at=None,
        available_at=now,
        dequeue_count=0,
        max_dequeues=req.max_dequeues,
        result=None,
        error=None,
        blob_ref=None,
        cache=None,
        created_at=now,
        claimed_at=None,
        finished_at=None,
        telemetry=None,
        enqueue_grant=_copy_json(req.enqueue_grant),
        concurrency_key=req.concurrency_key,
        max_running_per_key=req.max_running_per_key,
        caused_by_clock=req.caused_by_clock,
    )


def decide_enqueue(
    existing: ProcessRequest | None, req: NewRequest, now: float, *, rerun: bool = False
) -> tuple[Enqueued, bool]:
    """Apply the enqueue rule; return the answer and whether the row must be written.

    - no row: a new pending row (run 1);
    - a live row (pending/in_progress): coalesce into it, whatever `rerun` says — re-opening work
      in flight would fork it;
    - a finished row (done/poison): return it as it stands (a plain re-enqueue of a deterministic
      request is answered by its result; a poison row is replayed only by hand, docs/queue.md),
      unless `rerun=True`, which re-opens it on purpose as the next run with the new input, at the
      back of the queue.
    """
    if existing is None:
        return Enqueued(new_row(req, now), coalesced=False), True
    if existing.workspace_id != req.workspace_id:
        raise RequestIdConflict(f"request id {req.request_id!r} belongs to another workspace")
    if existing.is_live or not rerun:
        return Enqueued(existing, coalesced=True), False
    reopened = dataclasses.replace(new_row(req, now), run=existing.run + 1)
    return Enqueued(reopened, coalesced=False), True


def input_differs(answer: Enqueued, req: NewRequest) -> bool:
    """True when `answer` coalesced `req` into a row whose stored input is not the one `req`
    sent: the caller's input was not used (the id leaves the input out, docs/concepts.md), which its
    answer must say. Compared as canonical JSON, type for type (`1`, `1.0` and `true` differ;
    the order of an object's members does not)."""
    return answer.coalesced and _canonical(answer.row.input) != _canonical(req.input)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class EnqueueAsk:
    """One enqueue of a batch (`QueueStore.enqueue_many`): the request and its `rerun` flag,
    the two arguments of a single `QueueStore.enqueue`."""

    request: NewRequest
    rerun: bool = False


def caused_by(batch: Iterable[EnqueueAsk], clock: int) -> list[EnqueueAsk]:
    """`batch` with each request's `caused_by_clock` set to `clock`: the enqueues of an op-log
    commit whose last applied op has that clock (`OpLogStore.append_enqueuing`)."""
    return [
        dataclasses.replace(ask, request=dataclasses.replace(ask.request, caused_by_clock=clock))
        for ask in batch
    ]


class BatchEnqueue(NamedTuple):
    """`enqueue_batch`'s outcome: one answer per item, in order, and what must be written."""

    outcomes: list[Enqueued]
    #: Rows absent before the batch, to insert, in the order their first item came.
    inserted: list[ProcessRequest]
    #: Finished rows a rerun re-opened, by request id: each one's state after the batch.
    rewritten: dict[str, ProcessRequest]
    #: One `enqueued` event per item that wrote its row, in batch order.
    events: list[RequestEvent]


def enqueue_batch(
    rows: Mapping[str, ProcessRequest], batch: Iterable[EnqueueAsk], now: float
) -> BatchEnqueue:
    """`decide_enqueue` for each item of `batch`, in order, over `rows` (the stored rows by id,
    each locked for the batch; an id without a row is absent). An item sees the row as the items
    before it left it: a duplicate of an earlier item coalesces into the row that item made, as a
    second single enqueue would. Raises `RequestIdConflict` (the whole batch is refused: the
    caller writes nothing) if an item names a request of another workspace.
    Pinned by `tests/contract/enqueue_many_contract.py` (both backends)."""
    current = dict(rows)
    outcomes: list[Enqueued] = []
    inserted: dict[str, ProcessRequest] = {}
    rewritten: dict[str, ProcessRequest] = {}
    events: list[RequestEvent] = []
    for item in batch:
        req = item.request
        answer, write = decide_enqueue(current.get(req.request_id), req, now, rerun=item.rerun)
        if write:
            row = answer.row
            current[row.request_id] = row
            # A row made by this batch is live, so no later item of it can re-open it.
            if req.request_id in rows:
                rewritten[row.request_id] = row
            else:
                inserted[row.request_id] = row
            events.append(RequestEvent.of(row, "enqueued"))
        outcomes.append(answer)
    return BatchEnqueue(outcomes, list(inserted.values()), rewritten, events)


# -- claim -----------------------------------------------------------------------------------------


def is_claimable(row: ProcessRequest, now: float) -> bool:
    """Pending and available, or in progress with a lapsed lease (its worker died: the lease IS
    the retry, docs/queue.md)."""
    if row.status == "pending":
        return row.available_at <= now
    if row.status == "in_progress":
        return row.lease_expires_at is not None and row.lease_expires_at < now
    return False


def unclaimed_seconds(row: ProcessRequest, now: float) -> float | None:
    """Seconds `row` has been claimable without any worker claiming it, at `now`: since it
    became available (a pending row) or since its lease lapsed (a row whose worker died); 0 for
    a pending row still in its failure backoff. None for a row a worker holds or that finished.
    """
    if row.status == "pending":
        since = row.available_at
    elif row.status == "in_progress" and row.lease_expires_at is not None:
        if row.lease_expires_at >= now:
            return None  # held, its lease alive
        since = row.lease_expires_at
    else:
        return None
    return max(0.0, now - since)


def is_exhausted(row: ProcessRequest) -> bool:
    """It was handed out `max_dequeues` times: never again (poison cutoff, docs/queue.md)."""
    return row.dequeue_count >= row.max_dequeues


def claim(
    row: ProcessRequest, *, claim_token: str, worker_id: str, lease: float, now: float
) -> ProcessRequest:
    """Hand `row` to `worker_id` until `now + lease` under a fresh `claim_token`.

    The caller has checked `is_claimable` and not `is_exhausted` (a lapsed exhausted row goes to
    `poison_exhausted` instead). The fresh token fences out the previous holder, if any.
    """
    check_lease(lease)
    if not is_claimable(row, now) or is_exhausted(row) or row.cancel_requested:
        raise InvalidTransition(f"request {row.request_id!r} is not claimable")
    return dataclasses.replace(
        row,
        status="in_progress",
        claim_token=claim_token,
        claimed_by=worker_id,
        claimed_at=now,
        lease_expires_at=now + lease,
        dequeue_count=row.dequeue_count + 1,
    )


def held_back_by_key(row: ProcessRequest, running: int) -> bool:
    """Whether a claim must leave `row` where it is because `running` requests of its key
    (in progress under a live lease, plus those the same claim took before it) already fill its
    `max_running_per_key` (docs/queue.md, "Concurrency keys"). A row without a limit never is."""
    return row.max_running_per_key is not None and running >= row.max_running_per_key


def is_parked_on_lapse(row: ProcessRequest) -> bool:
    """A claimable row that must not run again: dequeued `max_dequeues` times (to poison), or
    cancelled while its holder ran it (to cancelled). A claim parks it instead of claiming it."""
    return is_exhausted(row) or row.cancel_requested


def park_lapsed(row: ProcessRequest, now: float) -> ProcessRequest:
    """Park a lapsed row of `is_parked_on_lapse`: `cancelled` if a cancel was asked for (the
    holder died before it heard), else `poison` (`poison_exhausted`)."""
    if row.cancel_requested:
        return _cancelled(row, now)
    return poison_exhausted(row, now)


def poison_exhausted(row: ProcessRequest, now: float) -> ProcessRequest:
    """Park a row whose lease lapsed after its last allowed dequeue (its last worker died)."""
    error = row.error
    if error is None:
        error = {
            "code": "lease_lapsed",
            "message": f"the lease lapsed on dequeue {row.dequeue_count} of {row.max_dequeues}",
        }
    return dataclasses.replace(
        row, status="poison", lease_expires_at=None, error=error, finished_at=now
    )


# -- the holder's verbs (fenced by claim_token) -------------------------------------------------


def fence(row: ProcessRequest, claim_token: str) -> None:
    """Raise `LeaseLost` unless `claim_token` holds `row` right now.

    A lapsed lease that nobody re-claimed still holds: no one else can have run the request in
    between, since claiming replaces the token.
    """
    if row.status != "in_progress" or row.claim_token != claim_token:
        raise LeaseLost(f"claim token does not hold request {row.request_id!r}")


def heartbeat(row: ProcessRequest, claim_token: str, lease: float, now: float) -> ProcessRequest:
    """Extend the holder's lease to `now + lease`."""
    check_lease(lease)
    fence(row, claim_token)
    if row.cancel_requested:
        # Not extended: a holder that dies before it reports back leaves a lapsing lease, and
        # the next claim then parks the row as cancelled (`park_lapsed`).
        raise RequestCancelled(f"request {row.request_id!r} was cancelled: stop and report back")
    return dataclasses.replace(row, lease_expires_at=now + lease)


def complete(
    row: ProcessRequest,
    claim_token: str,
    result: Any,
    now: float,
    *,
    error: Any = None,
    blob_ref: str | None = None,
    cache: CacheOutcome | None = None,
    telemetry: Any = None,
) -> Transition:
    """Finish the run: `done` with its result — or with `error`, an expected error (bad input,
    forbidden, not found) that is an answer, never retried (docs/queue.md).

    A holder's retried `complete` (its first answer was lost on the way) finds the row already
    done under its own token and gets that row back unchanged.
    """
    if row.status == "done" and row.claim_token == claim_token:
        return Transition(row, changed=False)
    fence(row, claim_token)
    check_cache(cache)
    done = dataclasses.replace(
        row,
        status="done",
        lease_expires_at=None,
        result=result,
        error=error,
        blob_ref=blob_ref,
        cache=cache,
        telemetry=telemetry,
        finished_at=now,
    )
    return Transition(done, changed=True)


def fail(
    row: ProcessRequest, claim_token: str, error: Any, backoff: float, now: float
) -> Transition:
    """An unexpected error: back to pending, claimable from `now + backoff` — or `poison` once the
    row was dequeued `max_dequeues` times (parked, listed, replayed only by hand).

    The error is kept on the row for diagnosis (a DLQ stores the last error). A holder's
    retried `fail` finds its own token still on the row and gets the row back unchanged.
    """
    check_lease(backoff, "backoff")
    if row.status in ("pending", "poison", "cancelled") and row.claim_token == claim_token:
        return Transition(row, changed=False)
    fence(row, claim_token)
    if row.cancel_requested:  # the holder stopped on a cancel (or failed meanwhile): no retry
        return Transition(dataclasses.replace(_cancelled(row, now), error=error), changed=True)
    if is_exhausted(row):
        parked = dataclasses.replace(
            row, status="poison", lease_expires_at=None, error=error, finished_at=now
        )
        return Transition(parked, changed=True)
    retry = dataclasses.replace(
        row, status="pending", lease_expires_at=None, available_at=now + backoff, error=error
    )
    return Transition(retry, changed=True)


class BatchCompletion(NamedTuple):
    """`complete_batch`'s outcome: one answer per item, in order, and what must be written."""

    outcomes: list[ProcessRequest | QueueError]
    #: The rows to write, by request id: each one's state after the last item that changed it.
    changed: dict[str, ProcessRequest]
    #: One event per item that changed its row, in batch order.
    events: list[RequestEvent]


def complete_batch(
    rows: Mapping[str, ProcessRequest], batch: Iterable[Completion], now: float
) -> BatchCompletion:
    """`complete` for each item of `batch`, in order, over `rows` (the stored rows by id, each
    locked for the batch). An item that is refused (no such row, lost lease, bad cache) gets its
    error as its answer and writes nothing; the others go on. An item sees the row as the items
    before it left it, so a holder's duplicate in the same batch is answered unchanged.
    Pinned by `test_complete_many_answers_each_completion_on_its_own` (the queue contract suite,
    both backends)."""
    current = dict(rows)
    outcomes: list[ProcessRequest | QueueError] = []
    changed: dict[str, ProcessRequest] = {}
    events: list[RequestEvent] = []
    for item in batch:
        row = current.get(item.request_id)
        if row is None:
            outcomes.append(RequestNotFound(f"no request {item.request_id!r}"))
            continue
        try:
            done, did_change = complete(
                row,
                item.claim_token,
                item.result,
                now,
                error=item.error,
                blob_ref=item.blob_ref,
                cache=item.cache,
                telemetry=item.telemetry,
            )
        except QueueError as refused:  # nothing is written for this one
            outcomes.append(refused)
            continue
        if did_change:
            current[done.request_id] = changed[done.request_id] = done
            events.append(RequestEvent.of(done, "done"))
        outcomes.append(done)
    return BatchCompletion(outcomes, changed, events)


@dataclass(frozen=True, slots=True)
class ClaimAsk:
    """A worker's ask, sent with its report (`QueueStore.complete_then_claim`,
    `QueueStore.fail_then_claim`), to claim up to `limit` more requests in the same transaction:
    the arguments of `QueueStore.claim_many`, checked the same way (`store.claim_scope`)."""

    worker_classes: str | Sequence[str]
    worker_id: str
    lease: float
    limit: int = 1
    #: The workspaces the worker's token may touch (None: all).
    workspace_ids: Collection[str] | None = None


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """A claim checked and scoped (`store.plan_claim`): up to `len(tokens)` rows of `classes` in
    `workspaces` (None: all), each taken under its own fresh token, leased for `lease`."""

    classes: tuple[str, ...]
    workspaces: tuple[str, ...] | None
    worker_id: str
    lease: float
    tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """A `fail` sent with a claim (`QueueStore.fail_then_claim`): the holder's token, the
    unexpected error, and the backoff before the row may run again (checked here, before
    anything is written)."""

    request_id: str
    claim_token: str
    error: Any
    backoff: float

    def __post_init__(self) -> None:
        check_lease(self.backoff, "backoff")


def fail_report(
    row: ProcessRequest | None, failure: Failure, now: float
) -> tuple[ProcessRequest | QueueError, bool]:
    """`fail` as the report of a then-claim: the row after it and whether it changed, or the
    `QueueError` `fail` would raise (`RequestNotFound` for no row) and False — then nothing is
    failed and the claim still goes on (tests/contract/then_claim_contract.py)."""
    if row is None:
        return RequestNotFound(f"no request {failure.request_id!r}"), False
    try:
        after, changed = fail(row, failure.claim_token, failure.error, failure.backoff, now)
    except QueueError as refused:
        return refused, False
    return after, changed


class ThenClaimed(NamedTuple):
    """A report and a claim committed together: one outcome per report, in order (the finished
    row, or the `QueueError` its plain verb would raise), and the rows claimed after them."""

    outcomes: list[ProcessRequest | QueueError]
    claimed: list[ProcessRequest]


# -- operator --------------------------------------------------------------------------------------


def cancel(row: ProcessRequest, now: float) -> Transition:
    """Cancel `row` at `now`.

    - pending (or in progress under a lapsed lease: no live holder) → `cancelled` at once;
    - in progress under a live lease → `cancel_requested`, the row otherwise unchanged: its
      holder hears of it at its next heartbeat, stops, and reports back (`fail`), which
      finishes the row as `cancelled` (`park_lapsed` does it if the holder dies first);
    - already cancelled, or already `cancel_requested` → unchanged (cancelling twice is safe);
    - done or poison → `NotCancellable`.
    """
    if row.status == "cancelled":
        return Transition(row, changed=False)
    if row.status in ("done", "poison"):
        raise NotCancellable(f"request {row.request_id!r} is {row.status}: nothing to cancel")
    if row.status == "pending" or is_claimable(row, now):  # nobody holds it
        return Transition(_cancelled(row, now), changed=True)
    if row.cancel_requested:
        return Transition(row, changed=False)
    return Transition(dataclasses.replace(row, cancel_requested=True), changed=True)


def _cancelled(row: ProcessRequest, now: float) -> ProcessRequest:
    """`row` finished as cancelled. The claim token stays, as on every finished row, so the
    last holder's retried `fail` is answered rather than refused."""
    return dataclasses.replace(row, status="cancelled", lease_expires_at=None, finished_at=now)


def discard_poison(row: ProcessRequest) -> ProcessRequest:
    """Check that `row` may be discarded by hand (deleted, with its result blob): only a poison
    row may, since a live one has a worker or a queue place and a done or cancelled one is
    deleted by the background pass. Returns the row as it was."""
    if row.status != "poison":
        raise NotDiscardable(f"request {row.request_id!r} is {row.status}, not poison")
    return row


def replay_poison(row: ProcessRequest, now: float) -> ProcessRequest:
    """Put a poison row back in the queue by hand, with its dequeue budget reset (the fix is
    presumed deployed). The last error stays for reference until the row finishes."""
    if row.status != "poison":
        raise InvalidTransition(f"request {row.request_id!r} is {row.status}, not poison")
    return dataclasses.replace(
        row,
        status="pending",
        claim_token=None,
        claimed_by=None,
        lease_expires_at=None,
        available_at=now,
        dequeue_count=0,
        finished_at=None,
    )
