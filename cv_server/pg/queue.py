"""The work queue on PostgreSQL, shared by every server instance (docs/queue.md, docs/postgres.md;
issue 7).

- **Claims** are one statement (`queue_sql.claim_sql`): each partial index is probed on its own
  (per worker class, and per workspace when the token is restricted, as a LATERAL index walk)
  with `FOR UPDATE SKIP LOCKED`, so claimers on any instance never wait on each other nor get
  the same row, and a claim costs an index walk whatever the backlog.
- **Every other verb** locks the row(s) it changes (`SELECT ... FOR UPDATE`), applies the pure
  rule of `cv_server.queue.model` and writes the result back in the same transaction.
- **Announcements.** A committed status change is announced to this store's listeners right
  after the commit, and to the other instances by a NOTIFY sent in the very transaction that
  made the change: it fires at COMMIT (never on rollback), so a waiter elsewhere can never be
  woken before the row is readable (docs/queue.md), and completion and notification are one
  transaction (docs/queue.md). Each instance LISTENs on the channel (`listen`) and announces what
  the others committed; its own notifications, tagged with its instance id, it skips.
- **Not every change crosses instances.** PostgreSQL serialises the commits of all
  transactions that NOTIFY (they queue on one lock held through the WAL flush): 16 concurrent
  committers did 1,902 commits/s without NOTIFY and 494 with it on the test machine. So only
  what a listener elsewhere acts on is sent — `pending` (wakes idle workers), `done`,
  `poison` and `cancelled` (wake waiters) — while claims (`in_progress`), which no listener
  acts on, commit without NOTIFY and are announced locally only. A missed notification costs
  at most a worker poll or a waiter sweep (docs/queue.md); nothing depends on it for correctness.
- **One clock.** Leases, backoffs and availability are judged on the database server's clock
  (`clock`), not on the machine of whichever instance serves the call: one running ahead would
  hand a live request to a second worker, one running behind would hand out backed-off or
  abandoned work late. A verb given `now=None` reads it inside its own statements
  (`queue_sql.DB_NOW`), so it costs no extra round trip.

Payloads are small (ids and status, never bodies): `[instance, [[workspace_id, request_id,
status, run, worker_class], ...]]`, split to stay under PostgreSQL's 8000-byte limit.
"""

from __future__ import annotations

import builtins
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, Final, TypeVar

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_server.pg import queue_sql as sql
from cv_server.pg.idempotency import complete_key
from cv_server.pg.notifier import NOTIFY_PAYLOAD_LIMIT, Notifier, Subscription, check_payload
from cv_server.pg.retry import SerializationRetryPolicy, run_with_retry
from cv_server.queue import model
from cv_server.queue.errors import QueueError, RequestNotFound
from cv_server.queue.idempotency import KeyCompletion
from cv_server.queue.model import (
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
    TransitionKind,
)
from cv_server.queue.store import Purged, QueueStore, check_purge_limit
from cv_server.shielded import commit_then_announce
from cv_server.tokens import new_claim_token

__all__ = [
    "BROADCAST_STATUSES",
    "QUEUE_CHANNEL",
    "PostgresQueueStore",
    "parse_queue_payload",
    "queue_payloads",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The channel queue changes are announced on (payload: `queue_payloads`).
QUEUE_CHANNEL: Final = "cv_queue"
#: The statuses other instances hear of (see the module docstring).
BROADCAST_STATUSES: Final[frozenset[RequestStatus]] = frozenset(
    {"pending", "done", "poison", "cancelled"}
)

Outcomes = builtins.list[ProcessRequest | QueueError]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def queue_payloads(instance_id: str, events: Iterable[RequestEvent]) -> builtins.list[str]:
    """The NOTIFY payloads announcing `events` (those in `BROADCAST_STATUSES`), each under the
    NOTIFY limit. Raises `NotifyPayloadTooLarge` if one event alone would not fit."""
    head = _dumps(instance_id)
    payloads: builtins.list[str] = []
    items: builtins.list[str] = []
    size = len(head) + 8  # brackets, comma, margin

    def flush() -> None:
        if items:
            payload = f"[{head},[{','.join(items)}]]"
            check_payload(payload)
            payloads.append(payload)
            items.clear()

    for event in events:
        if event.status not in BROADCAST_STATUSES:
            continue
        item = _dumps(
            [event.workspace_id, event.request_id, event.status, event.run, event.worker_class]
        )
        cost = len(item.encode("utf-8")) + 1
        if items and size + cost >= NOTIFY_PAYLOAD_LIMIT:
            flush()
            size = len(head) + 8
        items.append(item)
        size += cost
    flush()
    return payloads


def parse_queue_payload(payload: str) -> tuple[str, builtins.list[RequestEvent]]:
    """The instance id and the events of one queue notification. Raises `ValueError` if the
    payload is not one."""
    try:
        instance_id, items = json.loads(payload)
        events = [
            RequestEvent(str(ws), str(request_id), status, int(run), str(worker_class))
            for ws, request_id, status, run, worker_class in items
        ]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a queue notification: {payload[:200]!r}") from exc
    if not isinstance(instance_id, str) or any(e.status not in BROADCAST_STATUSES for e in events):
        raise ValueError(f"not a queue notification: {payload[:200]!r}")
    return instance_id, events


class PostgresQueueStore(QueueStore):
    """`QueueStore` on a PostgreSQL pool whose schema has `006_process_requests` and
    `007_request_cancel` (and, to
    complete idempotency keys with an enqueue, `004_idempotency_keys`) applied.

    Call `await listen(notifier)` to hear what other instances commit; `channel` must be the
    same on every instance of one deployment (and differ between deployments sharing a server).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        channel: str = QUEUE_CHANNEL,
        new_token: Callable[[], str] = new_claim_token,
        instance_id: str | None = None,
        retry_policy: SerializationRetryPolicy | None = None,
    ) -> None:
        super().__init__(new_token=new_token)
        self._pool = pool
        self.channel = channel
        self.instance_id = instance_id or secrets.token_hex(8)
        self._retry_policy = retry_policy
        self._subscription: Subscription | None = None

    # -- announcements ----------------------------------------------------------------------------

    async def listen(self, notifier: Notifier) -> None:
        """Announce to this store's listeners what other instances commit, from now on."""
        if self._subscription is None:
            self._subscription = await notifier.listen(self.channel, self._on_payload)

    def _on_payload(self, payload: str) -> None:
        try:
            instance_id, events = parse_queue_payload(payload)
        except ValueError:
            logger.warning("ignoring a malformed queue notification on %r", self.channel)
            return
        if instance_id != self.instance_id:  # our own changes were announced at commit
            self._announce(events)

    async def _write(
        self, attempt: Callable[[], Awaitable[tuple[T, builtins.list[RequestEvent]]]]
    ) -> T:
        """Run `attempt` (retried as a whole on 40001/40P01); once it committed, announce its
        events — even if our caller was cancelled meanwhile (the write happens regardless, so
        its waiters must hear of it)."""
        return await commit_then_announce(
            run_with_retry(attempt, policy=self._retry_policy), self._committed
        )

    async def _write_rows(
        self,
        conn: asyncpg.Connection,
        rows: Sequence[ProcessRequest],
        events: Sequence[RequestEvent],
    ) -> None:
        """Write the lifecycle columns of `rows` and queue the NOTIFY of `events`, in one round
        trip on `conn`'s open transaction."""
        await conn.execute(
            sql.UPDATE_LIFECYCLE_AND_NOTIFY,
            *sql.lifecycle_arrays(rows),
            self.channel,
            queue_payloads(self.instance_id, events),
        )

    # -- time -------------------------------------------------------------------------------------

    async def clock(self) -> float:
        """The database server's clock: several instances (several machines) share this store,
        and a lease must lapse at the same moment for all of them."""
        async with self._pool.acquire() as conn:
            now: float = await conn.fetchval(f"SELECT {sql.DB_NOW}")
        return now

    # -- enqueuers --------------------------------------------------------------------------------

    async def enqueue(
        self,
        req: NewRequest,
        now: float | None,
        *,
        rerun: bool = False,
        idempotency: KeyCompletion[Enqueued] | None = None,
    ) -> Enqueued:
        # The new row but for its creation time, which the insert stamps (`sql.insert_values`:
        # the database's when now is None) and returns; the announcement names no time.
        template = model.new_row(req, 0.0 if now is None else now)
        arrived = [RequestEvent.of(template)]
        values = sql.insert_values(template, now)

        async def plain() -> tuple[Enqueued, builtins.list[RequestEvent]]:
            # The common case in one statement: insert (announcing it) unless the id exists;
            # an existing row is answered as it stands, which needs no lock.
            (payload,) = queue_payloads(self.instance_id, arrived)
            async with self._pool.acquire() as conn:
                for _ in range(_MAX_ROUNDS):
                    inserted = await conn.fetchrow(
                        sql.INSERT_NEW_AND_NOTIFY, *values, self.channel, payload
                    )
                    if inserted is not None:
                        fresh = model.new_row(req, inserted["created_at"])
                        enqueued = Enqueued(fresh, coalesced=False)
                        return enqueued, [RequestEvent.of(fresh, "enqueued")]
                    found = await conn.fetchrow(sql.READ_ONE, req.request_id)
                    if found is not None:
                        answer, _ = model.decide_enqueue(
                            sql.request_from_row(found), req, _at(now, found)
                        )
                        return answer, []
            raise _vanishing(req)

        async def in_transaction() -> tuple[Enqueued, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                events: builtins.list[RequestEvent] = []
                inserted, found = await _insert_or_lock(conn, values, req)
                if inserted is not None:
                    fresh = model.new_row(req, inserted["created_at"])
                    answer = Enqueued(fresh, coalesced=False)
                    events = [RequestEvent.of(fresh, "enqueued")]
                else:
                    existing = sql.request_from_row(found)
                    answer, write = model.decide_enqueue(
                        existing, req, _at(now, found), rerun=rerun
                    )
                    if write:  # a rerun rewrites the whole request
                        await conn.execute(sql.REWRITE, *sql.row_values(answer.row))
                        events = [RequestEvent.of(answer.row, "enqueued")]
                if idempotency is not None:
                    response = idempotency.respond(answer)
                    await complete_key(
                        conn,
                        idempotency.workspace_id,
                        idempotency.key,
                        idempotency.fingerprint,
                        response,
                    )
                payloads = queue_payloads(self.instance_id, events)
                if payloads:
                    await conn.execute(sql.NOTIFY_MANY, self.channel, payloads)
                return answer, events

        if rerun or idempotency is not None:
            return await self._write(in_transaction)
        return await self._write(plain)

    async def enqueue_many(
        self,
        requests: Sequence[EnqueueAsk],
        now: float | None,
        *,
        idempotency: KeyCompletion[builtins.list[Enqueued]] | None = None,
    ) -> builtins.list[Enqueued]:
        batch = list(requests)
        if not batch and idempotency is None:
            return []

        async def attempt() -> tuple[builtins.list[Enqueued], builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                return await self.enqueue_in(conn, batch, now, idempotency=idempotency)

        return await self._write(attempt)

    async def enqueue_in(
        self,
        conn: asyncpg.Connection,
        batch: Sequence[EnqueueAsk],
        now: float | None,
        *,
        idempotency: KeyCompletion[builtins.list[Enqueued]] | None = None,
    ) -> tuple[builtins.list[Enqueued], builtins.list[RequestEvent]]:
        """`enqueue_many`'s writes in the caller's transaction on `conn` (an op-log commit that
        enqueues, `PostgresOpLogStore`): the answers and the events to announce, with
        `announce_committed`, once that transaction committed (its NOTIFY fires at COMMIT)."""
        # The row the first item of each id makes if its id is absent (`model.enqueue_batch`),
        # but for its creation time, which the insert stamps (the database's when now is None).
        firsts: dict[str, NewRequest] = {}
        for item in batch:
            firsts.setdefault(item.request.request_id, item.request)
        templates = [model.new_row(req, 0.0 if now is None else now) for req in firsts.values()]
        # Insert-unless-present first: an absent id then cannot appear (another instance's
        # enqueue of it waits on ours), and the rows that existed are locked before the rule
        # reads them. A deadlock with a batch inserting the same ids in another order is
        # retried as a whole (`run_with_retry`).
        inserted, locked = await _insert_or_lock_many(conn, templates, now)
        new_ids = {row["request_id"] for row in inserted}
        others = sorted(set(firsts) - new_ids)
        if now is not None:
            at = now
        elif inserted:
            at = float(inserted[0]["created_at"])
        elif locked:
            at = _at(None, locked[0])
        else:  # only an empty batch completing its key
            at = 0.0
        current = {row.request_id: row for row in map(sql.request_from_row, locked)}
        if len(current) != len(others):
            raise RuntimeError("an enqueue conflicted with a row it cannot read")
        answers, rows, rewritten, events = model.enqueue_batch(current, batch, at)
        if {row.request_id for row in rows} != new_ids:
            raise RuntimeError("the batch inserted other rows than its rule made")
        for row in rewritten.values():  # a rerun rewrites the whole request
            await conn.execute(sql.REWRITE, *sql.row_values(row))
        if idempotency is not None:
            await complete_key(
                conn,
                idempotency.workspace_id,
                idempotency.key,
                idempotency.fingerprint,
                idempotency.respond(answers),
            )
        payloads = queue_payloads(self.instance_id, events)
        if payloads:  # fired at COMMIT, never on rollback
            await conn.execute(sql.NOTIFY_MANY, self.channel, payloads)
        return answers, events

    async def get(self, workspace_id: str, request_id: str) -> ProcessRequest | None:
        async with self._pool.acquire() as conn:
            found = await conn.fetchrow(
                f"{sql.SELECT} WHERE request_id = $1 AND workspace_id = $2",
                request_id,
                workspace_id,
            )
        return None if found is None else sql.request_from_row(found)

    async def get_many(self, request_ids: Collection[str]) -> builtins.list[ProcessRequest]:
        ids = list(dict.fromkeys(request_ids))
        if not ids:
            return []
        async with self._pool.acquire() as conn:
            found = await conn.fetch(f"{sql.SELECT} WHERE request_id = ANY($1::text[])", ids)
        return [sql.request_from_row(row) for row in found]

    async def list(
        self,
        *,
        status: RequestStatus | None = None,
        workspace_id: str | None = None,
        limit: int = 100,
        after: tuple[float, str] | None = None,
    ) -> builtins.list[ProcessRequest]:
        if limit < 0:
            raise ValueError(f"limit must be >= 0: {limit!r}")
        params: builtins.list[Any] = [
            value for value in (status, workspace_id) if value is not None
        ]
        if after is not None:
            params.extend(after)
        query = sql.list_sql(status is not None, workspace_id is not None, after is not None)
        async with self._pool.acquire() as conn:
            found = await conn.fetch(query, limit, *params)
        return [sql.request_from_row(row) for row in found]

    async def status_counts(self) -> dict[RequestStatus, int]:
        async with self._pool.acquire() as conn:
            found = await conn.fetch(
                f"SELECT status, count(*) AS n FROM {sql.TABLE} GROUP BY status"
            )
        return {row["status"]: int(row["n"]) for row in found}

    async def held_by_key(self, now: float | None) -> int:
        async with self._pool.acquire() as conn:
            return int(await conn.fetchval(sql.HELD_BY_KEY, now))

    # -- workers ----------------------------------------------------------------------------------

    async def _has_claimable(
        self, classes: tuple[str, ...], workspaces: tuple[str, ...] | None, now: float | None
    ) -> bool:
        scope = () if workspaces is None else (list(workspaces),)
        async with self._pool.acquire() as conn:
            found: bool = await conn.fetchval(
                sql.claimable_sql(workspaces is not None), list(classes), now, *scope
            )
        return found

    async def _claim(self, plan: ClaimPlan, now: float | None) -> builtins.list[ProcessRequest]:
        async def attempt() -> tuple[builtins.list[ProcessRequest], builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn:
                return await self._claim_on(conn, plan, now)

        return await self._write(attempt)

    async def _claim_on(
        self, conn: asyncpg.Connection, plan: ClaimPlan, now: float | None
    ) -> tuple[builtins.list[ProcessRequest], builtins.list[RequestEvent]]:
        """The claim statement (`sql.claim_sql`) on `conn` (in its open transaction, if any):
        up to `len(plan.tokens)` rows of the plan's scope, and the events."""
        found = await conn.fetch(
            sql.claim_sql(plan.workspaces is not None),
            now,
            len(plan.tokens),
            plan.worker_id,
            plan.lease,
            list(plan.tokens),
            list(plan.classes),
            None if plan.workspaces is None else list(plan.workspaces),
            self.channel,
            self.instance_id,
        )
        # Parked rows (n = 0) come first, then the claimed ones in claim order.
        rows = [(row["n"], row["lapsed"], sql.request_from_row(row)) for row in found]
        claimed = [request for n, _, request in rows if n > 0]
        return claimed, [
            RequestEvent.of(request, _claim_kind(n, request), lapsed=lapsed)
            for n, lapsed, request in rows
        ]

    async def heartbeat(
        self, request_id: str, claim_token: str, lease: float, now: float | None
    ) -> ProcessRequest:
        return await self._transition(
            request_id,
            now,
            lambda row, at: model.Transition(model.heartbeat(row, claim_token, lease, at), True),
            kind=None,
        )

    async def complete_many(self, completions: Sequence[Completion], now: float | None) -> Outcomes:
        batch = list(completions)
        if not batch:
            return []

        async def attempt() -> tuple[Outcomes, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                return await self._complete_on(conn, batch, now)

        return await self._write(attempt)

    async def _complete_on(
        self, conn: asyncpg.Connection, batch: Sequence[Completion], now: float | None
    ) -> tuple[Outcomes, builtins.list[RequestEvent]]:
        """`complete_many` in `conn`'s open transaction: one outcome per completion, and the
        events (their NOTIFY queued in the same transaction)."""
        if not batch:
            return [], []
        ids = sorted({item.request_id for item in batch})
        locked = await conn.fetch(sql.LOCK_MANY, ids)
        current = {row.request_id: row for row in map(sql.request_from_row, locked)}
        # No row found: every item is refused, and no time is needed.
        at = _at(now, locked[0]) if locked else 0.0
        outcomes, changed, events = model.complete_batch(current, batch, at)
        if changed:
            # The rows and their NOTIFY commit together.
            await self._write_rows(conn, list(changed.values()), events)
        return outcomes, events

    async def _then_claim(
        self, report: Sequence[Completion] | Failure, plan: ClaimPlan | None, now: float | None
    ) -> ThenClaimed:
        async def attempt() -> tuple[ThenClaimed, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                if isinstance(report, Failure):
                    outcomes, events = await self._fail_on(conn, report, now)
                else:
                    outcomes, events = await self._complete_on(conn, report, now)
                claimed: builtins.list[ProcessRequest] = []
                if plan is not None:
                    claimed, claim_events = await self._claim_on(conn, plan, now)
                    events = [*events, *claim_events]
                return ThenClaimed(outcomes, claimed), events

        return await self._write(attempt)

    async def _fail_on(
        self, conn: asyncpg.Connection, failure: Failure, now: float | None
    ) -> tuple[Outcomes, builtins.list[RequestEvent]]:
        """`failure` as a then-claim's report in `conn`'s open transaction
        (`model.fail_report`): its one outcome, and the event (its NOTIFY queued) if it changed
        the row."""
        found = await conn.fetchrow(sql.LOCK_ONE, failure.request_id)
        row = None if found is None else sql.request_from_row(found)
        at = 0.0 if found is None else _at(now, found)  # no row: refused, no time needed
        outcome, changed = model.fail_report(row, failure, at)
        if not changed or isinstance(outcome, QueueError):
            return [outcome], []
        events = [RequestEvent.of(outcome, "failed")]
        await self._write_rows(conn, [outcome], events)
        return [outcome], events

    async def fail(
        self, request_id: str, claim_token: str, error: Any, backoff: float, now: float | None
    ) -> ProcessRequest:
        return await self._transition(
            request_id,
            now,
            lambda row, at: model.fail(row, claim_token, error, backoff, at),
            kind="failed",
        )

    # -- operators --------------------------------------------------------------------------------

    async def replay_poison(self, request_id: str, now: float | None) -> ProcessRequest:
        return await self._transition(
            request_id,
            now,
            lambda row, at: model.Transition(model.replay_poison(row, at), True),
            kind="replayed",
        )

    async def cancel(self, request_id: str, now: float | None) -> ProcessRequest:
        return await self._transition(request_id, now, model.cancel, kind="cancelled")

    async def discard_poison(self, request_id: str) -> ProcessRequest:
        async def attempt() -> tuple[ProcessRequest, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                found = await conn.fetchrow(sql.LOCK_ONE, request_id)
                if found is None:
                    raise RequestNotFound(f"no request {request_id!r}")
                row = model.discard_poison(sql.request_from_row(found))
                await conn.execute(sql.DISCARD, request_id)
                return row, []

        return await self._write(attempt)

    async def purge_finished(self, before: float, *, limit: int) -> Purged:
        check_purge_limit(limit)

        async def attempt() -> tuple[Purged, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn:
                found = await conn.fetchrow(sql.PURGE, before, limit)
            return Purged(requests=int(found["requests"]), blobs=int(found["blobs"])), []

        return await self._write(attempt)

    async def close(self) -> None:
        """Stop listening; the pool belongs to whoever opened it."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.close()

    # -- one row, one rule ------------------------------------------------------------------------

    async def _transition(
        self,
        request_id: str,
        now: float | None,
        rule: Callable[[ProcessRequest, float], model.Transition],
        *,
        kind: TransitionKind | None,
    ) -> ProcessRequest:
        """Lock the row, apply `rule` at `now` (None: the database's time as it locked the
        row), write what changed, announcing it as a `kind` change (None: not a status change,
        nothing to announce)."""

        async def attempt() -> tuple[ProcessRequest, builtins.list[RequestEvent]]:
            async with self._pool.acquire() as conn, conn.transaction():
                found = await conn.fetchrow(sql.LOCK_ONE, request_id)
                if found is None:
                    raise RequestNotFound(f"no request {request_id!r}")
                after, changed = rule(sql.request_from_row(found), _at(now, found))
                if not changed:
                    return after, []
                events = [] if kind is None else [RequestEvent.of(after, kind)]
                await self._write_rows(conn, [after], events)
                return after, events

        return await self._write(attempt)


def _claim_kind(n: int, row: ProcessRequest) -> TransitionKind:
    """A claim statement's row: claimed (n > 0), or parked (n = 0) as poison or cancelled."""
    if n > 0:
        return "claimed"
    return "cancelled" if row.status == "cancelled" else "poisoned"


def _at(now: float | None, found: Any) -> float:
    """The time of a verb: `now`, or the database's, read by the statement that returned the
    row `found` (`sql.READ_ONE`, `LOCK_ONE`, `LOCK_MANY`)."""
    if now is not None:
        return now
    db_now: float = found["db_now"]
    return db_now


#: An enqueue whose id conflicted, then whose row was gone when it read it (purged or
#: discarded in between, `purge_finished`), inserts again: each round needs another deletion
#: of the same id in between, so a handful is already far-fetched.
_MAX_ROUNDS: Final = 8


def _vanishing(req: NewRequest) -> RuntimeError:
    return RuntimeError(f"request {req.request_id!r} was deleted {_MAX_ROUNDS} times in a row")


async def _insert_or_lock(
    conn: asyncpg.Connection, values: Sequence[Any], req: NewRequest
) -> tuple[Any, Any]:
    """Insert the new row unless its id exists, else lock the row that does: `(inserted,
    None)` or `(None, locked)`. A row deleted between the conflict and the lock (finished rows
    are purged, tests/contract/queue_lifecycle_contract.py) leaves the id free: insert again."""
    for _ in range(_MAX_ROUNDS):
        inserted = await conn.fetchrow(sql.INSERT_IF_ABSENT, *values)
        if inserted is not None:
            return inserted, None
        found = await conn.fetchrow(sql.LOCK_ONE, req.request_id)
        if found is not None:
            return None, found
    raise _vanishing(req)


async def _insert_or_lock_many(
    conn: asyncpg.Connection, templates: Sequence[ProcessRequest], now: float | None
) -> tuple[builtins.list[Any], builtins.list[Any]]:
    """`_insert_or_lock` for a batch: the rows inserted and the existing rows locked, every id
    of `templates` in one of them."""
    inserted: builtins.list[Any] = []
    locked: builtins.list[Any] = []
    todo = list(templates)
    for _ in range(_MAX_ROUNDS):
        inserted += await conn.fetch(sql.INSERT_MANY, *sql.insert_many_values(todo, now))
        new_ids = {row["request_id"] for row in inserted}
        others = sorted({t.request_id for t in todo} - new_ids)
        locked += await conn.fetch(sql.LOCK_MANY, others) if others else []
        seen = new_ids | {row["request_id"] for row in locked}
        todo = [t for t in todo if t.request_id not in seen]
        if not todo:
            return inserted, locked
    raise RuntimeError(f"requests {[t.request_id for t in todo]} were deleted repeatedly")
