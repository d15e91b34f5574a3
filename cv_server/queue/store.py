"""The work-queue storage seam (layer 1, docs/queue.md): domain verbs every backend implements.

Every backend passes the same contract suite (`tests/contract/queue_contract.py`). The rules live
in `cv_server.queue.model` (pure); a backend reads the row, applies the rule and writes the result
in one transaction, or does the same in one SQL statement.

Time is a parameter everywhere (`now`, epoch seconds) and so are the lease and the backoff:
callers pass `ServerConfig.lease_seconds` (120 s) and `failure_backoff_seconds` (30 s).
Which clock `now` should come from is the store's to say (`clock`): with several server instances
on one PostgreSQL database, each instance's own wall clock would judge the same lease differently
(one running ahead hands a live request to a second worker, one running behind hands out a
backed-off or abandoned request late), so there it is the database's. A verb given `now=None`
reads the store's clock itself, as part of its write: on PostgreSQL inside the statement, so the
shared clock costs no extra round trip.
"""

from __future__ import annotations

import abc
import builtins
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cv_server.queue.errors import QueueError
from cv_server.queue.idempotency import KeyCompletion
from cv_server.queue.model import (
    CacheOutcome,
    ClaimAsk,
    ClaimPlan,
    Completion,
    EnqueueAsk,
    Enqueued,
    Failure,
    NewRequest,
    ProcessRequest,
    RequestEvent,
    RequestStatus,
    ThenClaimed,
    check_lease,
)

__all__ = [
    "Purged",
    "QueueListener",
    "QueueStore",
    "check_purge_limit",
    "claim_scope",
    "normalize_classes",
    "plan_claim",
]

logger = logging.getLogger(__name__)

#: Called once per committed status change, on the event loop, after the commit.
QueueListener = Callable[[RequestEvent], None]


@dataclass(frozen=True, slots=True)
class Purged:
    """What one `purge_finished` batch deleted: request rows, and the result blobs they named."""

    requests: int
    blobs: int


def check_purge_limit(limit: int) -> None:
    """A purge batch is bounded: `limit` must be at least 1 (every backend checks the same way)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1: {limit!r}")


class QueueStore(abc.ABC):
    """The durable queue of stage-level work of every workspace.

    Rules every implementation keeps (docs/queue.md):
    - one `request_id` names one row: an identical live request coalesces, a finished one answers
      a plain re-enqueue (`rerun=True` re-opens it on purpose);
    - `claim` / `claim_many` hand each claimable row to exactly one caller, even under concurrent
      claimers on several connections or processes; never a row dequeued `max_dequeues` times;
    - `heartbeat`, `complete` and `fail` are fenced by the `claim_token` of the latest claim: any
      other token raises `LeaseLost` and writes nothing;
    - `cancel` finishes a pending request at once and marks one in progress `cancel_requested`:
      its holder's heartbeat is then refused with `RequestCancelled`, its `fail` finishes the
      row as `cancelled`, and a claim that finds its lease lapsed parks it as `cancelled`;
    - every committed status change (enqueue, claim, done, back to pending, poison, cancelled,
      replay) is announced to listeners after its commit, never before, so a listener that
      reads the row sees the change. A caller cancelled mid-verb does not stop the write nor
      its announcement.
    """

    def __init__(self, *, new_token: Callable[[], str]) -> None:
        # The seam draws no randomness: each backend passes its token minter
        # (`cv_server.tokens.new_claim_token` by default; tests/contract/test_queue_sqlite.py).
        self._new_token = new_token
        self._listeners: builtins.list[QueueListener] = []
        self._observers: builtins.list[QueueListener] = []

    # -- notifications ----------------------------------------------------------------------------

    def add_listener(self, listener: QueueListener) -> Callable[[], None]:
        """Call `listener(event)` after each committed status change; returns the unsubscriber.

        A listener must be quick and must not raise (an error is logged and swallowed: a waiter's
        bug must never break the queue). Waiters use it to wake on `done`/`poison`, workers to
        wake on `pending`; both keep a periodic sweep (docs/queue.md) for a missed announcement.
        On PostgreSQL the announcement also arrives from other instances (NOTIFY on commit).
        """
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def add_observer(self, observer: QueueListener) -> Callable[[], None]:
        """Call `observer(event)` after each status change *this process* committed (never one
        heard from another instance), with `event.kind` and `event.row` set: for this process's
        metrics and logs, which must count each transition once in the deployment. Same rules
        as listeners: quick, and an error is logged and swallowed. Returns the unsubscriber."""
        self._observers.append(observer)

        def remove() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return remove

    def _committed(self, events: Sequence[RequestEvent]) -> None:
        """Backends call this after the commit (of this process) that made `events` true."""
        self._announce(events)
        for event in events:
            for observer in tuple(self._observers):
                try:
                    observer(event)
                except Exception:
                    logger.exception("queue observer failed on %s", event)

    def announce_committed(self, events: Sequence[RequestEvent]) -> None:
        """Announce `events` that another store's transaction wrote into this queue and has
        committed (`OpLogStore.append_enqueuing`: the op-log commit that enqueues). Call after
        that commit, never before, exactly once, as this store's own verbs do."""
        self._committed(events)

    def _announce(self, events: Iterable[RequestEvent]) -> None:
        """Backends call this after the commit that made `events` true."""
        for event in events:
            for listener in tuple(self._listeners):
                try:
                    listener(event)
                except Exception:
                    logger.exception("queue listener failed on %s", event)

    # -- time -------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def clock(self) -> float:
        """The time now (epoch seconds) on the clock every user of this store shares; a verb
        given `now=None` reads the same clock, as part of its write. This process's wall clock
        is right for a store only one process opens (embedded SQLite); a store several server
        instances share needs one clock for all of them (PostgreSQL: the database's)."""

    # -- enqueuers --------------------------------------------------------------------------------

    @abc.abstractmethod
    async def enqueue(
        self,
        req: NewRequest,
        now: float | None,
        *,
        rerun: bool = False,
        idempotency: KeyCompletion[Enqueued] | None = None,
    ) -> Enqueued:
        """Add `req` (or coalesce into the row it names); return `(row, coalesced)`.

        With `idempotency`, the key it names (owned by the caller through
        `IdempotencyStore.begin`) is completed with `idempotency.respond(answer)` in the same
        transaction as the enqueue (the stored response and its effect commit together).
        Raises `RequestIdConflict` if the id names a request of another workspace.
        """

    @abc.abstractmethod
    async def enqueue_many(
        self,
        requests: Sequence[EnqueueAsk],
        now: float | None,
        *,
        idempotency: KeyCompletion[builtins.list[Enqueued]] | None = None,
    ) -> builtins.list[Enqueued]:
        """`enqueue` each of `requests` in one transaction (one commit): one answer per item, in
        order, each the one a single `enqueue` of it would give at that point
        (`model.enqueue_batch`): an item sees the rows as the items before it left them, so a
        duplicate within the batch coalesces. Each new or re-opened row is announced after the
        commit, as `enqueue` announces it.

        All or nothing: if any item is refused (`RequestIdConflict`) or the write fails, nothing
        is written and nothing announced. With `idempotency`, the key is completed with
        `idempotency.respond(answers)` in the same transaction. An empty batch writes nothing.
        """

    @abc.abstractmethod
    async def get(self, workspace_id: str, request_id: str) -> ProcessRequest | None:
        """The request, or None — also when it belongs to another workspace."""

    @abc.abstractmethod
    async def get_many(self, request_ids: Collection[str]) -> builtins.list[ProcessRequest]:
        """The requests among `request_ids` that exist, in no particular order (the waiters'
        periodic sweep re-reads all its rows at once). Not workspace-scoped: server-internal."""

    @abc.abstractmethod
    async def list(
        self,
        *,
        status: RequestStatus | None = None,
        workspace_id: str | None = None,
        limit: int = 100,
        after: tuple[float, str] | None = None,
    ) -> builtins.list[ProcessRequest]:
        """At most `limit` requests, oldest first, filtered by status and workspace (operators).

        Oldest first is by `created_at`, then enqueue order. `after` = `(created_at,
        request_id)` of the last row of the previous page: the page starts right after that
        row's place, where the row stood when it was listed. The place is kept by its enqueue
        order, which nothing changes, not by its current `created_at` (a rerun moves it), so a
        row that matches the filter throughout is listed exactly once, whatever changes meanwhile.
        """

    @abc.abstractmethod
    async def status_counts(self) -> dict[RequestStatus, int]:
        """How many requests are in each status (of every workspace; a status without any is
        absent). For the `cv_queue_requests` gauges, read at each scrape: one grouped count."""

    @abc.abstractmethod
    async def held_by_key(self, now: float | None) -> int:
        """How many pending requests, available by `now` (None: the store's clock), their
        concurrency key holds back (docs/queue.md, "Concurrency keys"): as many of the key run
        as the request's `max_running_per_key` allows. For the `cv_queue_held_by_key` gauge,
        read at each scrape; a figure that stays high says a key's limit, not the workers,
        paces its work."""

    # -- workers ----------------------------------------------------------------------------------

    async def claim(
        self,
        worker_classes: str | Sequence[str],
        worker_id: str,
        lease: float,
        now: float | None,
        *,
        workspace_ids: Collection[str] | None = None,
    ) -> ProcessRequest | None:
        """Take the oldest claimable request of `worker_classes`, or None if there is none.

        Claimable: pending with `available_at <= now`, or in progress with `lease_expires_at <
        now`; "oldest" is by when it became claimable. The row comes back in progress under a
        fresh `claim_token`, leased until `now + lease`, `dequeue_count` + 1. A lapsed row already
        dequeued `max_dequeues` times turns to poison instead. `workspace_ids` restricts the claim
        to the workspaces the worker's token may touch (None: all). A row whose concurrency key
        already runs its `max_running_per_key` is passed over, never waited for
        (docs/queue.md, "Concurrency keys").
        """
        rows = await self.claim_many(
            worker_classes, worker_id, lease, now, limit=1, workspace_ids=workspace_ids
        )
        return rows[0] if rows else None

    async def claim_many(
        self,
        worker_classes: str | Sequence[str],
        worker_id: str,
        lease: float,
        now: float | None,
        *,
        limit: int,
        workspace_ids: Collection[str] | None = None,
    ) -> builtins.list[ProcessRequest]:
        """Take up to `limit` claimable requests at once, oldest first, each under its own fresh
        claim token (a worker runs them concurrently and may lose one lease without the others).
        Same rules as `claim`; one transaction, so a batch costs one commit. Raises `ValueError`
        if `limit < 1`."""
        ask = ClaimAsk(worker_classes, worker_id, lease, limit, workspace_ids)
        plan = plan_claim(ask, self._new_token)
        return [] if plan is None else await self._claim(plan, now)

    async def has_claimable(
        self,
        worker_classes: str | Sequence[str],
        now: float | None,
        *,
        workspace_ids: Collection[str] | None = None,
    ) -> bool:
        """Whether a `claim` of `worker_classes` at `now` (None: the store's clock) would find
        a row, without claiming it: a pending request available by `now`, or one in progress
        under a lapsed lease (which a claim re-drives, or parks if it may not run again), in
        `workspace_ids` (None: all).

        For the idle workers' long poll (`GET /v1/queue/pending`, docs/protocol.md), which asks
        it on every poll: one read that stops at the first row found, each status probed on its
        partial index, never a walk of the backlog. A hint, not a reservation: another worker
        may claim the row first, so the caller must still claim and take 204 in stride.
        """
        classes = normalize_classes(worker_classes)
        workspaces = None if workspace_ids is None else tuple(dict.fromkeys(workspace_ids))
        if not classes or workspaces == ():
            return False
        return await self._has_claimable(classes, workspaces, now)

    @abc.abstractmethod
    async def _has_claimable(
        self, classes: tuple[str, ...], workspaces: tuple[str, ...] | None, now: float | None
    ) -> bool:
        """`has_claimable` for a non-empty scope: distinct classes, distinct workspaces (None:
        all), in one read."""

    @abc.abstractmethod
    async def _claim(self, plan: ClaimPlan, now: float | None) -> builtins.list[ProcessRequest]:
        """`claim_many` as `plan` says, in one transaction."""

    @abc.abstractmethod
    async def heartbeat(
        self, request_id: str, claim_token: str, lease: float, now: float | None
    ) -> ProcessRequest:
        """Extend the lease to `now + lease`; return the row.

        Raises `LeaseLost` if `claim_token` no longer holds the request: stop the stage's writes.
        Raises `RequestCancelled` (the lease not extended) if someone cancelled it: stop the
        stage and report back with `fail`. Raises `RequestNotFound` for an unknown id.
        """

    async def complete(
        self,
        request_id: str,
        claim_token: str,
        result: Any,
        now: float | None,
        *,
        error: Any = None,
        blob_ref: str | None = None,
        cache: CacheOutcome | None = None,
        telemetry: Any = None,
    ) -> ProcessRequest:
        """Mark the request done with `result` (or the expected error `error`); return the row.

        Call only after the stage's writes committed (never ack before the work).
        Raises `LeaseLost` / `RequestNotFound` like `heartbeat`; a retry by the same holder after
        success returns the finished row unchanged.
        """
        completion = Completion(request_id, claim_token, result, error, blob_ref, cache, telemetry)
        (outcome,) = await self.complete_many([completion], now)
        if isinstance(outcome, QueueError):
            raise outcome
        return outcome

    @abc.abstractmethod
    async def complete_many(
        self, completions: Sequence[Completion], now: float | None
    ) -> builtins.list[ProcessRequest | QueueError]:
        """Complete a batch in one transaction (one commit); one outcome per completion, in order:
        the finished row, or the `LeaseLost` / `RequestNotFound` that `complete` would raise. A
        refused completion changes nothing and does not stop the others."""

    @abc.abstractmethod
    async def fail(
        self, request_id: str, claim_token: str, error: Any, backoff: float, now: float | None
    ) -> ProcessRequest:
        """Record an unexpected error: the row is pending again from `now + backoff`, or poison
        if it was dequeued `max_dequeues` times — or `cancelled` if a cancel was requested
        meanwhile (the holder's report after it stopped on `RequestCancelled`). Raises
        `LeaseLost` / `RequestNotFound` like `heartbeat`."""

    async def complete_then_claim(
        self, completions: Sequence[Completion], now: float | None, *, claim_next: ClaimAsk
    ) -> ThenClaimed:
        """`complete_many(completions)` then `claim_many` as `claim_next` asks, in one
        transaction (one commit): a busy worker reports and takes its next request in one trip.

        The outcomes are those `complete_many` answers; a refused completion (`LeaseLost`,
        `RequestNotFound`) writes nothing and stops neither the other completions nor the claim.
        The claim follows the rules of `claim_many` and sees the rows as the completions left
        them; an empty scope claims nothing. Nothing commits unless all of it does (a crash
        mid-way leaves neither). Raises `ValueError` (nothing written) for a bad lease or limit.
        """
        batch = list(completions)
        return await self._then_claim(batch, plan_claim(claim_next, self._new_token), now)

    async def fail_then_claim(
        self,
        request_id: str,
        claim_token: str,
        error: Any,
        backoff: float,
        now: float | None,
        *,
        claim_next: ClaimAsk,
    ) -> ThenClaimed:
        """`fail` then `claim_many` as `claim_next` asks, in one transaction (one commit); the
        one outcome is the row `fail` returns, or the `LeaseLost` / `RequestNotFound` it would
        raise (then nothing is failed, and the claim still happens). Raises `ValueError`
        (nothing written) for a bad backoff, lease or limit."""
        failure = Failure(request_id, claim_token, error, backoff)
        return await self._then_claim(failure, plan_claim(claim_next, self._new_token), now)

    @abc.abstractmethod
    async def _then_claim(
        self, report: Sequence[Completion] | Failure, plan: ClaimPlan | None, now: float | None
    ) -> ThenClaimed:
        """The report (`complete_many`'s batch, or one `fail`) then the claim `plan` (None:
        nothing to claim), in one transaction: `complete_then_claim`'s contract."""

    # -- operators --------------------------------------------------------------------------------

    @abc.abstractmethod
    async def replay_poison(self, request_id: str, now: float | None) -> ProcessRequest:
        """Put a poison request back in the queue by hand, its dequeue count reset.

        Raises `RequestNotFound`, or `InvalidTransition` if the request is not poison.
        """

    @abc.abstractmethod
    async def cancel(self, request_id: str, now: float | None) -> ProcessRequest:
        """Cancel the request (`model.cancel`); return the row after it: `cancelled`, or still
        in progress with `cancel_requested`. Cancelling twice changes nothing more.

        Raises `RequestNotFound`, or `NotCancellable` if the request is done or poison.
        """

    @abc.abstractmethod
    async def discard_poison(self, request_id: str) -> ProcessRequest:
        """Delete a poison request and the result blob it names, by hand; return the row as it
        was (still `poison`). Nothing is announced: a poison row is finished, so no waiter and
        no worker is left to hear of it. A later enqueue of its id makes a new row.

        Raises `RequestNotFound`, or `NotDiscardable` if the request is not poison.
        """

    @abc.abstractmethod
    async def purge_finished(self, before: float, *, limit: int) -> Purged:
        """Delete at most `limit` `done` or `cancelled` requests that finished at or before
        `before`, and the result blobs they name, in one short transaction; return how many.

        The background pass calls it in a loop (`cv_server.reaper`) until a batch comes back
        short. Poison rows are never purged. Several instances may purge at once: each row is
        deleted by one of them, and none waits on a row another is deleting (PostgreSQL: SKIP
        LOCKED). Raises `ValueError` if `limit < 1`.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the store's own resources (a shared database is closed by its owner)."""


def claim_scope(
    worker_classes: str | Sequence[str],
    workspace_ids: Collection[str] | None,
    lease: float,
    limit: int,
) -> tuple[tuple[str, ...], tuple[str, ...] | None] | None:
    """Check a claim's arguments (every backend the same way) and normalise its scope: the
    worker classes and the workspaces (None: all). None when the scope is empty (nothing to
    claim). Raises `ValueError` for a bad lease or a limit below 1."""
    check_lease(lease)
    if limit < 1:
        raise ValueError(f"limit must be >= 1: {limit!r}")
    classes = normalize_classes(worker_classes)
    workspaces = None if workspace_ids is None else tuple(dict.fromkeys(workspace_ids))
    if not classes or workspaces == ():
        return None
    return classes, workspaces


def plan_claim(ask: ClaimAsk, new_token: Callable[[], str]) -> ClaimPlan | None:
    """Check `ask` (`claim_scope`) and mint one token per row it may claim; None when its scope
    is empty. Raises `ValueError` for a bad lease or limit, before anything is written."""
    scope = claim_scope(ask.worker_classes, ask.workspace_ids, ask.lease, ask.limit)
    if scope is None:
        return None
    classes, workspaces = scope
    tokens = tuple(new_token() for _ in range(ask.limit))
    return ClaimPlan(classes, workspaces, ask.worker_id, ask.lease, tokens)


def normalize_classes(worker_classes: str | Sequence[str]) -> tuple[str, ...]:
    """`"a"` and `["a"]` mean the same; duplicates are dropped, order kept."""
    if isinstance(worker_classes, str):
        return (worker_classes,)
    return tuple(dict.fromkeys(worker_classes))
