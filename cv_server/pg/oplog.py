"""The op-log on PostgreSQL, shared by several server instances (docs/concepts.md, docs/postgres.md;
issue 7).

Same pure pipeline as SQLite (`cv_server.oplog.pipeline`); what changes is who else may write:

- **Clocks under a row lock.** Each transaction first locks the sub-doc's head row
  (`SELECT ... FOR UPDATE`): writers on every instance queue there instead of racing and
  retrying, and whoever holds the lock owns the next clocks.
- **Catch-up before apply.** Each instance caches (clock, state) per sub-doc. Holding the lock, it
  compares its cached clock with the head and first applies the log entries it has not seen
  (committed by other instances), so its state is the log's state before it plans anything.
- **Group commit.** Appends to one sub-doc queue in a per-sub-doc lane; one task drains the lane,
  committing every append waiting there in **one** transaction (one lock, one dedupe lookup,
  one write statement, one COMMIT). Appends still commit in call order.
- **Across sub-docs too.** The groups of every lane that is ready in the same event-loop tick
  (the applies of one websocket message, the acks of one commit answered at once) commit in one
  transaction (`_join`, `_commit_groups`): the heads locked in one statement, in key order, one
  lookup, one write statement, one COMMIT, so 64 sub-docs with one writer each cost one fsync,
  not 64. If that transaction fails, each group is committed again alone, so one sub-doc's
  failure (a corrupt log, say) is its own and no other's.
- **Publish on commit.** The write statement NOTIFYs `workspace_id/sub_doc/clock` on `channel` in
  the same transaction, so other instances hear of it only once it is readable; a lost
  notification is covered by catch-up from the log (`read_since`), never by re-applying.

If a transaction fails, the lane drops its cached copy (the plans may have mutated it) and the
next use rebuilds it from the snapshot and the log: the cache never runs ahead of the database.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_mutations import SubDocState
from cv_server.config import ServerConfig
from cv_server.oplog.pipeline import (
    CommitPlan,
    Recorded,
    RecordedCommit,
    RecordedRejection,
    copy_state,
    op_ids_to_look_up,
    plan_commit,
    snapshot_due,
)
from cv_server.oplog.store import (
    AppendEnqueued,
    Compaction,
    IncomingOp,
    LogEntry,
    OpLogCorrupted,
    OpLogStats,
    OpLogStore,
    Outcome,
    SubDocHead,
)
from cv_server.pg import oplog_sql as sql
from cv_server.pg.migrations import migrate
from cv_server.pg.notifier import check_payload
from cv_server.pg.pool import PostgresSettings, close_pool, create_pool
from cv_server.pg.queue import PostgresQueueStore
from cv_server.pg.retry import SerializationRetryPolicy, run_with_retry
from cv_server.queue.model import EnqueueAsk, Enqueued, RequestEvent, caused_by

__all__ = [
    "OPLOG_CHANNEL",
    "OpLogCorrupted",
    "PostgresOpLogStore",
    "oplog_payload",
    "parse_oplog_payload",
]


logger = logging.getLogger(__name__)

#: The channel commits are announced on (payload: `oplog_payload`).
OPLOG_CHANNEL: Final = "cv_oplog"

_DEFAULTS: Final = ServerConfig()

AppendResult = tuple[list[Outcome], list[LogEntry]]


def oplog_payload(workspace_id: str, sub_doc: str, clock: int) -> str:
    """`workspace_id/sub_doc/clock`: ids cannot contain `/` (docs/concepts.md), and it stays
    tiny."""
    return f"{workspace_id}/{sub_doc}/{clock}"


def parse_oplog_payload(payload: str) -> tuple[str, str, int]:
    """The (workspace_id, sub_doc, clock) a commit notification announces."""
    workspace_id, sub_doc, clock = payload.split("/")
    return workspace_id, sub_doc, int(clock)


@dataclass(slots=True)
class _Pending:
    ops: list[IncomingOp]
    atomic: bool
    future: asyncio.Future[AppendResult]
    if_clock: int | None = None
    #: `append_enqueuing`'s items (None: a plain append), and what its transaction enqueued
    #: (None: nothing, the batch applied no op), set by each attempt of the commit.
    enqueue: list[EnqueueAsk] | None = None
    enqueued: tuple[list[Enqueued], list[RequestEvent]] | None = None


@dataclass(slots=True)
class _Member:
    """One lane's group in a batch (`_join`). The lane's lock is held from before it joins until the
    batch is over, and released by the batch, not by the drainer: a drainer cancelled while it
    waits must not free a lane whose cached state the batch is still changing."""

    key: tuple[str, str]
    lane: _Lane
    group: list[_Pending]
    future: asyncio.Future[list[AppendResult]]


@dataclass(slots=True)
class _Lane:
    """Everything this instance holds for one sub-doc. `lock` guards `doc`."""

    doc: sql.CachedSubDoc | None = None
    pending: deque[_Pending] = field(default_factory=deque)
    drainer: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PostgresOpLogStore(OpLogStore):
    """`OpLogStore` on a PostgreSQL pool whose schema has the op-log migration applied.

    `snapshot_every`: ops between two state snapshots (a snapshot is written by the transaction
    whose clocks cross a multiple of it, whichever instance that is). `channel`: where commits
    are announced. `max_group_ops`: ops one group transaction takes at most (an append is never
    split; a single larger append still commits alone). Use `await PostgresOpLogStore.open(dsn)`
    for a store that owns its pool and migrates the database.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        snapshot_every: int = _DEFAULTS.snapshot_every,
        channel: str = OPLOG_CHANNEL,
        max_group_ops: int = _DEFAULTS.max_ops_per_request,
        cache_limit: int = _DEFAULTS.subdoc_cache_limit,
        retry_policy: SerializationRetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        owns_pool: bool = False,
        retention_seconds: float = 0.0,
        skew_seconds: float = 0.0,
        now: Callable[[], float] = time.time,
        queue: PostgresQueueStore | None = None,
    ) -> None:
        self._settings(
            snapshot_every=snapshot_every,
            cache_limit=cache_limit,
            retention_seconds=retention_seconds,
            skew_seconds=skew_seconds,
        )
        self._now = now
        #: The queue on the same database, which `append_enqueuing` writes into (None: unbound).
        self._queue = queue
        if max_group_ops < 1:
            raise ValueError("max_group_ops must be at least 1")
        self.pool = pool
        self.channel = channel
        self.max_group_ops = max_group_ops
        self._retry_policy = retry_policy
        self._sleep = sleep
        self._owns_pool = owns_pool
        # Least recently used first. Idle lanes past `cache_limit` are dropped: a sub-doc's cached
        # state is only ever used after catching up from the log under the head row lock, so a
        # dropped (or even duplicated) lane costs a rebuild, never a wrong answer.
        self._lanes: OrderedDict[tuple[str, str], _Lane] = OrderedDict()
        #: Groups ready in this event-loop tick, committed together once it ends.
        self._forming: list[_Member] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Lanes' groups committed, the appends they carried, and the transactions that carried
        #: them (several groups share one when their lanes were ready in the same tick).
        self.groups_committed = 0
        self._on_commit: Callable[[float, int], None] | None = None
        self.appends_committed = 0
        self.transactions_committed = 0

    @classmethod
    async def open(
        cls,
        dsn: str,
        settings: PostgresSettings | None = None,
        *,
        snapshot_every: int = _DEFAULTS.snapshot_every,
        channel: str = OPLOG_CHANNEL,
        max_group_ops: int = _DEFAULTS.max_ops_per_request,
        cache_limit: int = _DEFAULTS.subdoc_cache_limit,
        retention_seconds: float = 0.0,
        skew_seconds: float = 0.0,
        now: Callable[[], float] = time.time,
    ) -> PostgresOpLogStore:
        """Open a pool, apply pending migrations, and return a store that closes the pool."""
        pool = await create_pool(dsn, settings)
        try:
            await migrate(pool)
        except BaseException:
            await pool.close()
            raise
        return cls(
            pool,
            snapshot_every=snapshot_every,
            channel=channel,
            max_group_ops=max_group_ops,
            cache_limit=cache_limit,
            owns_pool=True,
            retention_seconds=retention_seconds,
            skew_seconds=skew_seconds,
            now=now,
        )

    # -- OpLogStore ------------------------------------------------------------------------------

    #: A sub-doc's lane commits its appends in the order they were queued (one drainer, FIFO),
    #: so a websocket queues its next apply at once, and `close()` commits every apply queued
    #: before it (tests/acceptance/test_server_shutdown.py).
    appends_in_order = True

    def append_nowait(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> asyncio.Future[AppendResult]:
        """`append` as the lane's own future: queued now, so appends to one sub-doc queued in
        order commit in order."""
        return self._submit(workspace_id, sub_doc, ops, atomic, if_clock).future

    async def append_enqueuing(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        enqueue: Sequence[EnqueueAsk],
        *,
        atomic: bool = False,
        if_clock: int | None = None,
    ) -> AppendEnqueued:
        """Queued on the lane as an append of its own group (`_take_group`), whose transaction
        also runs the queue's insert (`PostgresQueueStore.enqueue_in`) when the batch applied
        an op; the queue's NOTIFY fires at that COMMIT, the local announcement right after."""
        queue = self._queue
        if queue is None:
            raise NotImplementedError("this op-log store is not bound to a queue store")
        pending = self._submit(workspace_id, sub_doc, ops, atomic, if_clock, list(enqueue))

        def announce(future: asyncio.Future[AppendResult]) -> None:
            if future.cancelled() or future.exception() is not None:
                return  # nothing committed, nothing to announce
            if pending.enqueued is not None:
                queue.announce_committed(pending.enqueued[1])

        pending.future.add_done_callback(announce)
        outcomes, entries = await asyncio.shield(pending.future)
        answers = None if pending.enqueued is None else pending.enqueued[0]
        return AppendEnqueued(outcomes, entries, answers)

    def _submit(
        self,
        workspace_id: str,
        sub_doc: str,
        ops: Sequence[IncomingOp],
        atomic: bool,
        if_clock: int | None,
        enqueue: list[EnqueueAsk] | None = None,
    ) -> _Pending:
        self._check_open()
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        pending = _Pending(list(ops), atomic, future, if_clock, enqueue)
        if not ops:
            future.set_result(([], []))
            return pending
        key = (workspace_id, sub_doc)
        lane = self._lane(key)
        lane.pending.append(pending)
        if lane.drainer is None:
            lane.drainer = asyncio.create_task(self._drain(key, lane), name=f"oplog-{key}")
        return pending

    async def read_since(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, list[LogEntry]]:
        self._check_open()
        async with self.pool.acquire() as conn:
            return await sql.read_since(conn, workspace_id, sub_doc, since, limit)

    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        """The cached state, first brought up to the log's head (other instances may have
        committed since this one last looked)."""
        self._check_open()
        key = (workspace_id, sub_doc)
        lane = self._lane(key)
        async with lane.lock, self.pool.acquire() as conn:
            try:
                # The head, the snapshot and the log read in one snapshot of the database, so
                # the state must end exactly at the head: a snapshot (or a cache) ahead of the
                # log is rebuilt or reported as corruption, never served as a state that is
                # not durable (`test_a_snapshot_ahead_of_the_log_is_reported_as_corruption_by_
                # get_state`, `test_a_cache_ahead_of_a_rewound_log_is_rebuilt_by_get_state_not_
                # served`).
                async with conn.transaction(isolation="repeatable_read", readonly=True):
                    head = await sql.read_head(conn, workspace_id, sub_doc)
                    doc = await self._caught_up(conn, key, lane, head)
            except BaseException:
                lane.doc = None
                raise
            if doc.clock == 0:
                lane.doc = None  # never written: not worth a cache entry
            return doc.clock, copy_state(doc.state)

    async def head(self, workspace_id: str, sub_doc: str) -> int:
        self._check_open()
        async with self.pool.acquire() as conn:
            return await sql.read_head(conn, workspace_id, sub_doc)

    async def list_sub_docs(
        self, workspace_id: str, *, after: str | None = None, limit: int
    ) -> list[SubDocHead]:
        self._check_open()
        if limit < 0:
            raise ValueError(f"limit must be >= 0: {limit!r}")
        if limit == 0:
            return []
        async with self.pool.acquire() as conn:
            rows = await sql.list_sub_docs(conn, workspace_id, after or "", limit)
        return [SubDocHead(name, clock, at, horizon) for name, clock, at, horizon in rows]

    async def horizon(self, workspace_id: str, sub_doc: str) -> int:
        self._check_open()
        async with self.pool.acquire() as conn:
            return await sql.read_horizon(conn, workspace_id, sub_doc)

    async def compact(
        self, older_than: float, *, limit: int, start: tuple[str, str] | None = None
    ) -> Compaction:
        """One transaction over at most `limit` sub-docs with a snapshot. Each is taken with a
        tried advisory lock (`oplog_sql.compact_sub_doc`): two compactors at once delete each
        row once and never wait on each other or on a writer."""
        self._check_open()
        if limit < 1:
            raise ValueError(f"limit must be >= 1: {limit!r}")
        async with self.pool.acquire() as conn, conn.transaction():
            docs = await sql.snapshots_from(conn, start or ("", ""), limit + 1)
            budget = limit
            for workspace_id, sub_doc, snapshot_clock in docs[:limit]:
                deleted = await sql.compact_sub_doc(
                    conn, workspace_id, sub_doc, snapshot_clock, older_than, budget
                )
                budget -= deleted or 0
                if budget == 0:
                    return Compaction(limit, (workspace_id, sub_doc))
        resume = (docs[limit][0], docs[limit][1]) if len(docs) > limit else None
        return Compaction(limit - budget, resume)

    async def expire_rejections(self, older_than: float, *, limit: int) -> int:
        self._check_open()
        if limit < 1:
            raise ValueError(f"limit must be >= 1: {limit!r}")
        async with self.pool.acquire() as conn:
            return await sql.expire_rejections(conn, older_than, limit)

    async def stats(self) -> OpLogStats:
        """The row count is the planner's estimate (`pg_class.reltuples`): cheap at any size."""
        self._check_open()
        async with self.pool.acquire() as conn:
            rows, oldest = await sql.read_stats(conn)
        return OpLogStats(rows, oldest, estimated=True)

    async def client_mark(self, workspace_id: str, sub_doc: str, client_id: str) -> int:
        self._check_open()
        async with self.pool.acquire() as conn:
            return await sql.read_mark(conn, workspace_id, sub_doc, client_id)

    async def close(self) -> None:
        """Finish every append queued before this call, then close the pool if this store
        opened it."""
        if self._closed:
            return
        self._closed = True
        drainers = [lane.drainer for lane in self._lanes.values() if lane.drainer is not None]
        if drainers:
            await asyncio.gather(*drainers, return_exceptions=True)
        if self._batches:  # drainers cancelled meanwhile leave their batch running
            await asyncio.gather(*self._batches, return_exceptions=True)
        self._lanes.clear()
        if self._owns_pool:
            # Bounded: a graceful close on a dead path never ends (see `close_pool`).
            await close_pool(self.pool, PostgresSettings().statement_timeout_seconds)

    # -- lanes -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the op-log store is closed")

    def _lane(self, key: tuple[str, str]) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            # Evict before adding: the new lane is idle too, and evicting it (when every other
            # lane is busy) would hand the caller a lane nobody else finds, so the next append
            # to this sub-doc would start a second drainer and race this one to the row lock,
            # out of call order. The cache may exceed its limit until busy lanes go idle.
            self._evict_idle_lanes(room_for=1)
            lane = self._lanes[key] = _Lane()
        else:
            self._lanes.move_to_end(key)
        return lane

    def _evict_idle_lanes(self, room_for: int) -> None:
        excess = len(self._lanes) + room_for - self.cache_limit
        if excess <= 0:
            return
        for key, lane in list(self._lanes.items()):
            if excess <= 0:
                break
            if not lane.pending and lane.drainer is None and not lane.lock.locked():
                del self._lanes[key]
                excess -= 1

    def _take_group(self, lane: _Lane) -> list[_Pending]:
        group = [lane.pending.popleft()]
        if group[0].enqueue is not None:
            # An append that enqueues commits in a group of its own: a refused item fails its
            # transaction, which must not take other appends with it.
            return group
        size = len(group[0].ops)
        while (
            lane.pending
            and lane.pending[0].enqueue is None
            and size + len(lane.pending[0].ops) <= self.max_group_ops
        ):
            pending = lane.pending.popleft()
            group.append(pending)
            size += len(pending.ops)
        return group

    async def _drain(self, key: tuple[str, str], lane: _Lane) -> None:
        group: list[_Pending] = []
        try:
            while lane.pending:
                group = self._take_group(lane)
                try:
                    await lane.lock.acquire()
                    results = await self._join(key, lane, group)
                except Exception as exc:
                    for pending in group:
                        if not pending.future.done():
                            pending.future.set_exception(exc)
                    continue
                for pending, result in zip(group, results, strict=True):
                    if not pending.future.done():
                        pending.future.set_result(result)
                group = []
        except BaseException as exc:
            # Only what `except Exception` lets through gets here (the drainer cancelled,
            # KeyboardInterrupt). Every append in flight or queued behind it is answered, with
            # an ordinary error (not CancelledError: its caller was not cancelled); pinned by
            # `test_a_cancelled_drainer_fails_its_appends_instead_of_leaving_them_hanging`.
            for pending in group:
                if not pending.future.done():
                    pending.future.set_exception(
                        RuntimeError(f"{key}: the op-log lane stopped mid-commit ({exc!r})")
                    )
            while lane.pending:
                pending = lane.pending.popleft()
                if not pending.future.done():
                    pending.future.set_exception(
                        RuntimeError(f"{key}: the op-log lane stopped ({exc!r}); not applied")
                    )
            raise
        finally:
            # No await between the last `while` check and this line: an append that arrives
            # after it sees `drainer is None` and starts a new drainer.
            lane.drainer = None

    # -- batches of lanes ------------------------------------------------------------------------

    def _join(
        self, key: tuple[str, str], lane: _Lane, group: list[_Pending]
    ) -> asyncio.Future[list[AppendResult]]:
        """Add `group` (its lane locked by the caller) to the batch of this tick; the batch
        releases the lane's lock once it is over."""
        loop = asyncio.get_running_loop()
        member = _Member(key, lane, group, loop.create_future())
        if self._forming is None:
            self._forming = []
            # Once this tick's ready callbacks ran: every lane ready now has joined by then.
            loop.call_soon(self._launch)
        self._forming.append(member)
        return member.future

    def _launch(self) -> None:
        members, self._forming = self._forming or [], None
        task = asyncio.get_running_loop().create_task(self._run_batch(members))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _run_batch(self, members: list[_Member]) -> None:
        try:
            if len(members) > 1:
                try:
                    results = await self._commit_with_retry(members)
                except Exception:
                    # Whatever failed took the whole transaction: each group again, alone, so
                    # it fails (or commits) on its own account. Nothing was committed.
                    logger.debug("batch of %d sub-docs failed; committing each alone", len(members))
                else:
                    for member, result in zip(members, results, strict=True):
                        _settle(member.future, result)
                    return
            await asyncio.gather(*(self._run_alone(member) for member in members))
        except BaseException as exc:
            for member in members:
                if not member.future.done():
                    member.lane.doc = None
                    member.future.set_exception(
                        RuntimeError(f"{member.key}: the op-log batch stopped mid-commit ({exc!r})")
                    )
            raise
        finally:
            for member in members:
                member.lane.lock.release()

    async def _run_alone(self, member: _Member) -> None:
        try:
            (result,) = await self._commit_with_retry([member])
        except Exception as exc:
            if not member.future.done():
                member.future.set_exception(exc)
        else:
            _settle(member.future, result)

    async def _commit_with_retry(self, members: list[_Member]) -> list[list[AppendResult]]:
        return await run_with_retry(
            functools.partial(self._commit_groups, members),
            policy=self._retry_policy,
            sleep=self._sleep,
        )

    # -- one transaction -------------------------------------------------------------------------

    def observe_commits(self, observer: Callable[[float, int], None] | None) -> None:
        self._on_commit = observer

    async def _commit_groups(self, members: list[_Member]) -> list[list[AppendResult]]:
        """Commit the groups of one or several lanes (their locks held) in one transaction: per
        lane, the results of its appends in order."""
        began = time.perf_counter()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                heads = await sql.lock_heads(conn, [member.key for member in members])
                docs = [
                    await self._caught_up(conn, member.key, member.lane, heads[member.key])
                    for member in members
                ]
                wanted = [
                    (*member.key, op_id)
                    for member in members
                    for op_id in op_ids_to_look_up(
                        op for pending in member.group for op in pending.ops
                    )
                ]
                recorded = await sql.look_up_many(conn, wanted) if wanted else {}
                lanes = sorted(
                    {
                        (*member.key, pending_op.op.client_id)
                        for member in members
                        for pending in member.group
                        for pending_op in pending.ops
                        if pending_op.op.client_id is not None
                    }
                )
                marks = await sql.look_up_marks(conn, lanes) if lanes else {}
                now = self._now()
                dating = (self.expired_before(now), self.latest_minted_at(now))
                all_plans = [
                    self._plan_group(
                        doc,
                        member.group,
                        recorded.get(member.key, {}),
                        marks.get(member.key, {}),
                        dating,
                    )
                    for member, doc in zip(members, docs, strict=True)
                ]
                moved = [
                    (*member.key, client_id, seq)
                    for member, plans in zip(members, all_plans, strict=True)
                    for client_id, seq in _last_marks(plans).items()
                ]
                if moved:
                    await sql.write_marks(conn, moved)
                writes: list[sql.DocWrite] = []
                for member, plans in zip(members, all_plans, strict=True):
                    entries = [entry for plan in plans for entry in plan.entries]
                    rejections = [rejection for plan in plans for rejection in plan.rejections]
                    if not entries and not rejections:
                        continue
                    clock = plans[-1].clock
                    payload = oplog_payload(*member.key, clock) if entries else None
                    if payload is not None:
                        check_payload(payload)
                    writes.append(
                        sql.DocWrite(
                            *member.key,
                            entries=entries,
                            fingerprints=[fp for plan in plans for fp in plan.fingerprints],
                            rejections=rejections,
                            clock=clock,
                            payload=payload,
                        )
                    )
                committed_at: float | None = None
                if writes:
                    committed_at = await sql.write_batches(conn, writes, self.channel)
                for member, plans in zip(members, all_plans, strict=True):
                    for pending, plan in zip(member.group, plans, strict=True):
                        await self._enqueue_for(conn, pending, plan)
                for member, doc, plans in zip(members, docs, all_plans, strict=True):
                    head, clock = heads[member.key], plans[-1].clock
                    if snapshot_due(head, clock, self.snapshot_every):
                        await sql.write_snapshot(
                            conn, *member.key, sql.CachedSubDoc(clock, doc.state)
                        )
        except BaseException:
            # The plans mutated the cached states; whatever the failure (even an unknown COMMIT
            # outcome), rebuilding from the database is right.
            for member in members:
                member.lane.doc = None
            raise
        for doc, plans in zip(docs, all_plans, strict=True):
            doc.clock = plans[-1].clock
        self.groups_committed += len(members)
        self.transactions_committed += 1
        self.appends_committed += sum(len(member.group) for member in members)
        if self._on_commit is not None:
            ops = sum(len(pending.ops) for member in members for pending in member.group)
            try:
                self._on_commit(time.perf_counter() - began, ops)
            except Exception:  # a metric must never fail the commit it measures
                logger.exception("commit observer failed")
        return [
            [(plan.outcomes, _stamped(plan.entries, committed_at)) for plan in plans]
            for plans in all_plans
        ]

    async def _enqueue_for(
        self, conn: asyncpg.Connection, pending: _Pending, plan: CommitPlan
    ) -> None:
        """`append_enqueuing`'s enqueues, in its commit's transaction, if it applied an op."""
        pending.enqueued = None  # a retried attempt starts afresh
        if pending.enqueue is None or not plan.entries or self._queue is None:
            return
        batch = caused_by(pending.enqueue, plan.entries[-1].clock)
        pending.enqueued = await self._queue.enqueue_in(conn, batch, None)

    async def _caught_up(
        self, conn: asyncpg.Connection, key: tuple[str, str], lane: _Lane, head: int
    ) -> sql.CachedSubDoc:
        """The lane's cached sub-doc at exactly `head` (call holding the head row lock, or in a
        repeatable-read transaction that read `head`)."""
        workspace_id, sub_doc = key
        doc = lane.doc
        if doc is None or doc.clock > head:
            lane.doc = None
            doc = await sql.load_sub_doc(conn, workspace_id, sub_doc)
        elif doc.clock < head:
            doc = await sql.catch_up(conn, workspace_id, sub_doc, doc)
        if doc.clock != head:
            raise OpLogCorrupted(f"{key}: the log ends at clock {doc.clock}, the head is {head}")
        lane.doc = doc
        return doc

    @staticmethod
    def _plan_group(
        doc: sql.CachedSubDoc,
        group: list[_Pending],
        recorded: dict[str, Recorded],
        marks: dict[str, int],
        dating: tuple[int | None, int],
    ) -> list[CommitPlan]:
        """The pipeline for each append of the group, in order, on the cached state (`recorded`:
        what the log holds for the group's op_ids, `marks` the lanes' marks; both are added to
        as the plans go)."""
        plans: list[CommitPlan] = []
        clock = doc.clock
        for pending in group:
            plan = plan_commit(
                doc.state,
                clock,
                pending.ops,
                recorded,
                atomic=pending.atomic,
                marks=marks,
                expired_before=dating[0],
                latest_minted_at=dating[1],
                # Against the clock the plans before it reached, under the head row lock
                # (`lock_heads`): no other instance can move the head before this commits.
                if_clock=pending.if_clock,
            )
            plans.append(plan)
            clock = plan.clock
            # A later append of the same group decides against this one's marks.
            marks.update(plan.marks)
            # A later append of the same group sees this one's outcomes as already recorded.
            for entry, fingerprint in zip(plan.entries, plan.fingerprints, strict=True):
                if entry.op_id is not None:
                    recorded[entry.op_id] = RecordedCommit(entry.clock, fingerprint)
            for rejection in plan.rejections:
                recorded[rejection.op_id] = RecordedRejection(
                    rejection.code, rejection.message, rejection.fingerprint
                )
        return plans


def _last_marks(plans: Sequence[CommitPlan]) -> dict[str, int]:
    """The marks a group's plans moved, each at its last value."""
    moved: dict[str, int] = {}
    for plan in plans:
        moved.update(plan.marks)
    return moved


def _stamped(entries: list[LogEntry], committed_at: float | None) -> list[LogEntry]:
    """`entries` with the commit time their rows were written with (None: nothing written)."""
    if committed_at is None:
        return entries
    return [replace(entry, committed_at=committed_at) for entry in entries]


def _settle(future: asyncio.Future[list[AppendResult]], result: list[AppendResult]) -> None:
    if not future.done():  # its drainer was cancelled; the commit itself happened
        future.set_result(result)
