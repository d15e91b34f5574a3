"""The work queue on the shared embedded SQLite database (docs/queue.md, docs/postgres.md).

Every verb is one write job on the database's single writer thread (its own SAVEPOINT inside a
group commit, under `BEGIN IMMEDIATE`): it reads the row, applies the pure rule from
`cv_server.queue.model` and writes back only the columns that changed. No other writer — thread
or process — can act between the read and the write, so two claimers never get the same row.

The claim probes two partial indexes separately instead of one query that ORs "pending and
available" with "lease lapsed" under one ORDER BY: such a query cannot walk an ordered index and
sorts the whole backlog on every claim (issue 5, measured at a 40,000-row backlog: 195 jobs/s
against 2,801; `bench.queue_store` prints both plans). Each probe is an index seek that stops
after the rows it needs; the claim takes the candidates that became claimable first, so a row
whose worker died does not starve behind a long pending backlog.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import fields
from typing import Any, Final, TypeVar

import sqlite_utils

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
from cv_server.sqlite.blobs import TABLE as BLOBS
from cv_server.sqlite.engine import SQLiteDatabase, Transaction
from cv_server.sqlite.idempotency import complete_key
from cv_server.tokens import new_claim_token

__all__ = [
    "CLAIM_PROBES",
    "TABLE",
    "SQLiteQueueStore",
    "claimable_sql",
    "create_schema",
    "enqueue_rows",
]

TABLE: Final = "workspace_process_requests"

_COLUMNS: Final = tuple(f.name for f in fields(ProcessRequest))
_JSON_COLUMNS: Final = frozenset({"input", "result", "error", "telemetry", "enqueue_grant"})
#: What only a rerun (which rewrites the whole request) may change.
_REQUEST_COLUMNS: Final = frozenset(
    {"request_id", "workspace_id", "stage", "job_id", "branch_path", "input", "worker_class"}
    | {"run", "max_dequeues", "created_at", "enqueue_grant", "caused_by_clock"}
    | {"concurrency_key", "max_running_per_key"}
)
#: What every other verb may change: all `_update` compares and writes, so a claim never
#: re-serializes the input.
_LIFECYCLE: Final = tuple(c for c in _COLUMNS if c not in _REQUEST_COLUMNS)
_SELECT: Final = f"SELECT {', '.join(_COLUMNS)} FROM {TABLE}"
_STATUS: Final = _COLUMNS.index("status")
_AVAILABLE_AT: Final = _COLUMNS.index("available_at")
_LEASE_EXPIRES_AT: Final = _COLUMNS.index("lease_expires_at")
_CREATED_AT: Final = _COLUMNS.index("created_at")
_DEQUEUES: Final = _COLUMNS.index("dequeue_count")
_MAX_DEQUEUES: Final = _COLUMNS.index("max_dequeues")
_CANCEL_REQUESTED: Final = _COLUMNS.index("cancel_requested")
#: Stored as 0/1 (SQLite has no boolean type).
_BOOL_COLUMNS: Final = frozenset({"cancel_requested"})
#: A probe also selects the rowid, after the columns: the enqueue order that breaks ties.
_ROWID: Final = len(_COLUMNS)
_WORKSPACE: Final = _COLUMNS.index("workspace_id")
_KEY: Final = _COLUMNS.index("concurrency_key")
_MAX_RUNNING: Final = _COLUMNS.index("max_running_per_key")
#: The rows `purge_finished` may delete, spelled once: the partial index's WHERE and the
#: purge's must read the same for the planner to use the index.
_PURGED: Final = "status IN ({})".format(", ".join(f"'{s}'" for s in model.PURGED_STATUSES))
#: The purge's batch: the oldest finished rows first, by the partial index.
PURGE_BATCH: Final = (
    f"SELECT rowid, workspace_id, blob_ref FROM {TABLE} INDEXED BY {TABLE}_finished "
    f"WHERE {_PURGED} AND finished_at <= ? ORDER BY finished_at LIMIT ?"
)
#: Page size of `get_many`: far below SQLite's bound on host parameters.
_GET_MANY_CHUNK: Final = 500

# The three claim probes. `status = '...'` is spelled as a literal so the planner can match each
# probe to its partial index; each stops after `limit` rows in index order. They select the rowid
# too (free: every index holds it) so that merging the probes keeps their tie-break.
_PROBE_SELECT: Final = f"SELECT {', '.join(_COLUMNS)}, rowid FROM {TABLE}"
#: The key's running requests: in progress under a live lease (a lapsed one has freed its slot),
#: counted on their own partial index. Parameter: now.
_RUNNING_OF_KEY: Final = (
    f"SELECT count(*) FROM {TABLE} k INDEXED BY {TABLE}_running_key"
    " WHERE k.status = 'in_progress' AND k.concurrency_key IS NOT NULL"
    f" AND k.workspace_id = {TABLE}.workspace_id AND k.concurrency_key = {TABLE}.concurrency_key"
    " AND k.lease_expires_at >= ?"
)
# A row whose key's slots are full is skipped where it stands, so the probe walks on to other
# keys (no head-of-line blocking, docs/queue.md). A row without a limit costs one NULL test.
# Parameter: now.
_KEY_FREE: Final = f"AND (max_running_per_key IS NULL OR ({_RUNNING_OF_KEY}) < max_running_per_key)"
#: `_RUNNING_OF_KEY` for one key. Parameters: workspace, key, now.
_RUNNING_COUNT: Final = (
    f"SELECT count(*) FROM {TABLE} INDEXED BY {TABLE}_running_key"
    " WHERE status = 'in_progress' AND concurrency_key IS NOT NULL"
    " AND workspace_id = ? AND concurrency_key = ? AND lease_expires_at >= ?"
)
#: `held_by_key`: the pending rows a claim would skip for their key. Parameters: now, now.
_HELD_BY_KEY: Final = (
    f"SELECT count(*) FROM {TABLE} WHERE status = 'pending' AND max_running_per_key IS NOT NULL"
    f" AND available_at <= ? AND ({_RUNNING_OF_KEY}) >= max_running_per_key"
)
_PENDING_PROBE: Final = (
    f"{_PROBE_SELECT} WHERE status = 'pending' AND worker_class = ? AND available_at <= ? "
    f"{_KEY_FREE} ORDER BY available_at, created_at, rowid LIMIT ?"
)
_PENDING_IN_WORKSPACE_PROBE: Final = (
    f"{_PROBE_SELECT} WHERE status = 'pending' AND worker_class = ? AND workspace_id = ? "
    f"AND available_at <= ? {_KEY_FREE} ORDER BY available_at, created_at, rowid LIMIT ?"
)
# A lapsed row that must be parked (exhausted, cancelled) is found whatever its key: parking
# takes no slot. Parameter: now.
_LAPSED_KEY_FREE: Final = (
    "AND (dequeue_count >= max_dequeues OR cancel_requested = 1"
    f" OR max_running_per_key IS NULL OR ({_RUNNING_OF_KEY}) < max_running_per_key)"
)
_LAPSED_PROBE: Final = (
    f"{_PROBE_SELECT} WHERE status = 'in_progress' AND worker_class = ? AND lease_expires_at < ? "
    "{workspaces} "
    + _LAPSED_KEY_FREE.replace("{", "{{").replace("}", "}}")
    + " ORDER BY lease_expires_at, created_at, rowid LIMIT ?"
)
#: The probes a claim runs, for EXPLAIN QUERY PLAN (the benchmark prints them).
CLAIM_PROBES: Final = {
    "pending": _PENDING_PROBE,
    "pending_in_workspace": _PENDING_IN_WORKSPACE_PROBE,
    "lapsed": _LAPSED_PROBE.format(workspaces=""),
}

T = TypeVar("T")


def claimable_sql(classes: int, workspaces: int | None) -> str:
    """Whether anything is claimable (`QueueStore.has_claimable`) for `classes` worker classes
    and `workspaces` workspaces (None: all). Parameters: the classes, the workspaces, now; the
    classes, now, the workspaces. Each status is one EXISTS that stops at its first row. The
    indexes are named: with IN lists on a table never analyzed, the planner preferred the
    status index, a walk of every pending row (`test_the_claimable_check_is_an_index_seek`).
    """
    names = ", ".join("?" * classes)
    scope = "" if workspaces is None else f" AND workspace_id IN ({', '.join('?' * workspaces)})"
    pending = f"{TABLE}_pending" if workspaces is None else f"{TABLE}_pending_workspace"
    # A row its key holds back is not claimable (else an idle worker would be told of work it
    # cannot claim, and poll again at once, in a loop). Parameter: now, after each scope.
    return (
        f"SELECT EXISTS (SELECT 1 FROM {TABLE} INDEXED BY {pending} WHERE status = 'pending'"
        f" AND worker_class IN ({names}){scope} AND available_at <= ? {_KEY_FREE})"
        f" OR EXISTS (SELECT 1 FROM {TABLE} INDEXED BY {TABLE}_leased"
        f" WHERE status = 'in_progress' AND worker_class IN ({names})"
        f" AND lease_expires_at < ?{scope} {_LAPSED_KEY_FREE})"
    )


def create_schema(db: sqlite_utils.Database) -> None:
    """Create `workspace_process_requests` and its indexes if missing (idempotent)."""
    db.table(TABLE).create(
        {
            "request_id": str,
            "workspace_id": str,
            "stage": str,
            "job_id": str,
            "branch_path": str,
            "input": str,
            "worker_class": str,
            "status": str,
            "run": int,
            "claim_token": str,
            "claimed_by": str,
            "lease_expires_at": float,
            "available_at": float,
            "dequeue_count": int,
            "max_dequeues": int,
            "result": str,
            "error": str,
            "blob_ref": str,
            "cache": str,
            "created_at": float,
            "claimed_at": float,
            "finished_at": float,
            "telemetry": str,
            "cancel_requested": int,
            "enqueue_grant": str,
            "concurrency_key": str,
            "max_running_per_key": int,
            "caused_by_clock": int,
        },
        pk="request_id",
        not_null={
            "request_id",
            "workspace_id",
            "stage",
            "worker_class",
            "status",
            "run",
            "available_at",
            "dequeue_count",
            "max_dequeues",
            "created_at",
            "cancel_requested",
        },
        defaults={"cancel_requested": 0},
        if_not_exists=True,
    )
    # A file made before cancelling existed lacks the column: every row of it is uncancelled.
    if "cancel_requested" not in db.table(TABLE).columns_dict:
        db.table(TABLE).add_column("cancel_requested", int, not_null_default=0)
    # One made before enqueue grants: its rows were enqueued under the full grant (NULL).
    if "enqueue_grant" not in db.table(TABLE).columns_dict:
        db.table(TABLE).add_column("enqueue_grant", str)
    # One made before concurrency keys: none of its rows has a key.
    if "concurrency_key" not in db.table(TABLE).columns_dict:
        db.table(TABLE).add_column("concurrency_key", str)
        db.table(TABLE).add_column("max_running_per_key", int)
    # One made before enqueue-with-commit: every row of it was enqueued on its own (NULL).
    if "caused_by_clock" not in db.table(TABLE).columns_dict:
        db.table(TABLE).add_column("caused_by_clock", int)
    # Partial indexes need a WHERE clause, which sqlite-utils' create_index cannot express.
    # Each holds only the rows of one status, so it stays the size of the live backlog, not of
    # the whole history of done rows.
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_pending ON {TABLE} "
        "(worker_class, available_at, created_at) WHERE status = 'pending'"
    )
    # A worker whose token covers some workspaces probes each of them (tenant isolation, §11):
    # without this index it would walk past every other tenant's backlog.
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_pending_workspace ON {TABLE} "
        "(worker_class, workspace_id, available_at, created_at) WHERE status = 'pending'"
    )
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_leased ON {TABLE} "
        "(worker_class, lease_expires_at, created_at) WHERE status = 'in_progress'"
    )
    # The running requests of each concurrency key (`_RUNNING_OF_KEY`): only keyed rows in
    # progress, so it stays the size of the work running, and unkeyed work never touches it.
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_running_key ON {TABLE} "
        "(workspace_id, concurrency_key, lease_expires_at)"
        " WHERE status = 'in_progress' AND concurrency_key IS NOT NULL"
    )
    # The background pass purges finished rows by when they finished (`purge_finished`); the
    # index holds only the rows it may delete, so a purge is a seek, not a walk of the queue
    # (tests/contract/test_queue_sqlite.py, test_the_purge_is_an_index_seek).
    db.execute(
        f"CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_at) WHERE {_PURGED}"
    )
    # Operators list by status (poison above all), oldest first.
    db.table(TABLE).create_index(["status", "created_at"], if_not_exists=True)
    db.table(TABLE).create_index(["workspace_id", "status", "created_at"], if_not_exists=True)


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _to_db(column: str, value: Any) -> Any:
    if column in _BOOL_COLUMNS:
        return int(bool(value))
    return _dumps(value) if column in _JSON_COLUMNS else value


def _row(values: Sequence[Any]) -> ProcessRequest:
    data = dict(zip(_COLUMNS, values, strict=True))
    for column in _JSON_COLUMNS:
        raw = data[column]
        data[column] = None if raw is None else json.loads(raw)
    for column in _BOOL_COLUMNS:
        data[column] = bool(data[column])
    return ProcessRequest(**data)


def _claimable_since(raw: Sequence[Any]) -> tuple[float, float, int]:
    """When a probed row became claimable (ties: the older request first, then the one enqueued
    first). The rowid is part of the key, as in each probe's ORDER BY: without it, a tie between
    probes (a lapsed lease and a backoff ending at the same instant, two worker classes or two
    workspaces) went to whichever probe ran first instead of the request enqueued first, unlike
    the PostgreSQL store, which breaks it by `seq`."""
    since = raw[_LEASE_EXPIRES_AT] if raw[_STATUS] == "in_progress" else raw[_AVAILABLE_AT]
    return (since, raw[_CREATED_AT], raw[_ROWID])


def _claimable_candidates(
    tx: Transaction,
    classes: tuple[str, ...],
    workspaces: tuple[str, ...] | None,
    now: float,
    limit: int,
) -> builtins.list[Sequence[Any]]:
    """The first `limit` claimable rows of each probe, unparsed and followed by their rowid
    (`_ROWID`; `_probed` parses one): one index seek per
    (class[, workspace]) and status. The oldest `limit` of all are among them, since every probe
    walks its index in claimable-since order."""
    found: builtins.list[Sequence[Any]] = []
    lapsed_sql = _LAPSED_PROBE.format(workspaces="")
    if workspaces is not None:
        marks = ", ".join("?" for _ in workspaces)
        lapsed_sql = _LAPSED_PROBE.format(workspaces=f"AND workspace_id IN ({marks})")
    for worker_class in classes:
        if workspaces is None:
            found.extend(tx.execute(_PENDING_PROBE, (worker_class, now, now, limit)))
        else:
            for ws in workspaces:
                found.extend(
                    tx.execute(_PENDING_IN_WORKSPACE_PROBE, (worker_class, ws, now, now, limit))
                )
        # Lapsed leases are few (only dead workers leave them): filtering them by workspace
        # after the index seek costs nothing worth another index.
        found.extend(tx.execute(lapsed_sql, (worker_class, now, *(workspaces or ()), now, limit)))
    return found


def _within_key_limits(
    tx: Transaction, candidates: Sequence[Sequence[Any]], now: float, limit: int
) -> builtins.list[Sequence[Any]]:
    """The first `limit` of `candidates` (oldest first) that their keys' slots admit: a probe
    checked each row against the rows running, and this counts the rows the same claim takes
    before it too (`model.held_back_by_key`)."""
    running: dict[tuple[str, str], int] = {}
    taken: builtins.list[Sequence[Any]] = []
    for raw in candidates:
        if len(taken) == limit:
            break
        if raw[_KEY] is not None:  # it takes a slot of its key, limited or not
            key = (raw[_WORKSPACE], raw[_KEY])
            if key not in running:
                (running[key],) = tx.execute(_RUNNING_COUNT, (*key, now)).fetchone()
            if raw[_MAX_RUNNING] is not None and running[key] >= raw[_MAX_RUNNING]:
                continue
            running[key] += 1
        taken.append(raw)
    return taken


def _probed(raw: Sequence[Any]) -> ProcessRequest:
    """A row a claim probe found (its columns, then its rowid)."""
    return _row(raw[:_ROWID])


def _delete_blobs(tx: Transaction, refs: Sequence[tuple[str, str]]) -> int:
    """Delete the result blobs `(workspace_id, blob_ref)` (those already swept are skipped);
    return how many were deleted."""
    deleted = 0
    for ref in refs:
        deleted += tx.execute(
            f"DELETE FROM {BLOBS} WHERE workspace_id = ? AND blob_ref = ?", ref
        ).rowcount
    return deleted


def _select(tx: Transaction, request_id: str) -> ProcessRequest:
    found = tx.execute(f"{_SELECT} WHERE request_id = ?", (request_id,)).fetchone()
    if found is None:
        raise RequestNotFound(f"no request {request_id!r}")
    return _row(found)


def _insert(tx: Transaction, row: ProcessRequest) -> None:
    placeholders = ", ".join("?" for _ in _COLUMNS)
    tx.execute(
        f"INSERT INTO {TABLE} ({', '.join(_COLUMNS)}) VALUES ({placeholders})",
        [_to_db(column, getattr(row, column)) for column in _COLUMNS],
    )


def _update(
    tx: Transaction,
    before: ProcessRequest,
    after: ProcessRequest,
    columns: Sequence[str] = _LIFECYCLE,
) -> None:
    """Write those of `columns` that changed between `before` and `after`.

    Compared as stored, not with `==`: Python finds JSON `1`, `1.0` and `true` (or `0.0` and
    `-0.0`) equal, and a value that differs only in its JSON type must still be written (pinned
    by `test_a_rerun_stores_its_input_type_for_type` and
    `test_the_last_error_is_stored_type_for_type`).
    """
    changed = []
    for column in columns:
        old, new = getattr(before, column), getattr(after, column)
        # The same object stores the same (the pure rules build `after` with
        # `dataclasses.replace`, which keeps every field they do not set): only the others are
        # serialized to compare.
        if old is not new and _to_db(column, old) != _to_db(column, new):
            changed.append(column)
    if not changed:
        return
    assignments = ", ".join(f"{column} = ?" for column in changed)
    params = [_to_db(column, getattr(after, column)) for column in changed]
    tx.execute(
        f"UPDATE {TABLE} SET {assignments} WHERE request_id = ?", (*params, after.request_id)
    )


def _claim_rows(
    tx: Transaction, plan: ClaimPlan, now: float
) -> tuple[builtins.list[ProcessRequest], builtins.list[RequestEvent]]:
    """Claim up to `len(plan.tokens)` rows of the plan's scope in `tx`, each under its own
    token, parking the lapsed rows that may not run again (`QueueStore.claim_many`)."""
    limit = len(plan.tokens)
    events: builtins.list[RequestEvent] = []
    while True:
        found = _claimable_candidates(tx, plan.classes, plan.workspaces, now, limit)
        doomed = [
            _probed(raw)
            for raw in found
            if raw[_DEQUEUES] >= raw[_MAX_DEQUEUES] or raw[_CANCEL_REQUESTED]
        ]
        if doomed:
            # Their last allowed worker died, or a cancelled one's holder died before it
            # heard: park them (`model.park_lapsed`), then look again.
            for row in doomed:
                parked = model.park_lapsed(row, now)
                _update(tx, row, parked)
                kind: TransitionKind = "cancelled" if parked.status == "cancelled" else "poisoned"
                events.append(RequestEvent.of(parked, kind, lapsed=True))
            continue
        claimed = []
        oldest = _within_key_limits(tx, sorted(found, key=_claimable_since), now, limit)
        for raw, token in zip(oldest, plan.tokens[: len(oldest)], strict=True):
            row = _probed(raw)
            held = model.claim(
                row, claim_token=token, worker_id=plan.worker_id, lease=plan.lease, now=now
            )
            _update(tx, row, held)
            claimed.append(held)
            lapsed = row.status == "in_progress"
            events.append(RequestEvent.of(held, "claimed", lapsed=lapsed))
        return claimed, events


def _fail_row(
    tx: Transaction, failure: Failure, now: float
) -> tuple[builtins.list[ProcessRequest | QueueError], builtins.list[RequestEvent]]:
    """`failure` as a then-claim's report in `tx` (`model.fail_report`): its one outcome, and
    the event if it changed the row."""
    found = tx.execute(f"{_SELECT} WHERE request_id = ?", (failure.request_id,)).fetchone()
    row = None if found is None else _row(found)
    outcome, changed = model.fail_report(row, failure, now)
    if not changed or row is None or isinstance(outcome, QueueError):
        return [outcome], []
    _update(tx, row, outcome)
    return [outcome], [RequestEvent.of(outcome, "failed")]


def _complete_rows(
    tx: Transaction, batch: Sequence[Completion], now: float
) -> tuple[builtins.list[ProcessRequest | QueueError], builtins.list[RequestEvent]]:
    """`QueueStore.complete_many` in `tx`: one outcome per completion, and the events."""
    stored: dict[str, ProcessRequest] = {}
    for request_id in {item.request_id for item in batch}:
        found = tx.execute(f"{_SELECT} WHERE request_id = ?", (request_id,)).fetchone()
        if found is not None:
            stored[request_id] = _row(found)
    outcomes, changed, events = model.complete_batch(stored, batch, now)
    for request_id, done in changed.items():
        _update(tx, stored[request_id], done)
    return outcomes, events


def _enqueue_rows(
    tx: Transaction, batch: Sequence[EnqueueAsk], now: float
) -> tuple[builtins.list[Enqueued], builtins.list[RequestEvent]]:
    """`QueueStore.enqueue_many` in `tx`: read the rows the batch names, apply
    `model.enqueue_batch`, insert the new rows in batch order (their rowid is their enqueue
    order) and rewrite the re-opened ones."""
    stored: dict[str, ProcessRequest] = {}
    for request_id in dict.fromkeys(item.request.request_id for item in batch):
        found = tx.execute(f"{_SELECT} WHERE request_id = ?", (request_id,)).fetchone()
        if found is not None:
            stored[request_id] = _row(found)
    outcomes, inserted, rewritten, events = model.enqueue_batch(stored, batch, now)
    for row in inserted:
        _insert(tx, row)
    for request_id, row in rewritten.items():  # a rerun rewrites the whole request
        _update(tx, stored[request_id], row, _COLUMNS)
    return outcomes, events


def enqueue_rows(
    tx: Transaction, batch: Sequence[EnqueueAsk], now: float
) -> tuple[builtins.list[Enqueued], builtins.list[RequestEvent]]:
    """`enqueue_many`'s writes inside another store's writer job on the same file (the op-log
    commit that enqueues, `SQLiteOpLogStore.append_enqueuing`): the answers, and the events to
    announce with `QueueStore.announce_committed` once the job committed."""
    return _enqueue_rows(tx, batch, now)


def _now(now: float | None) -> float:
    """`now`, or this store's clock (`SQLiteQueueStore.clock`) read when the verb is called, as
    the routes did before they handed the choice of clock to the store."""
    return time.time() if now is None else now


class SQLiteQueueStore(QueueStore):
    """`QueueStore` on a `SQLiteDatabase` whose schema includes `create_schema` (and, to complete
    idempotency keys with an enqueue, `cv_server.sqlite.idempotency.create_schema`)."""

    def __init__(
        self, db: SQLiteDatabase, *, new_token: Callable[[], str] = new_claim_token
    ) -> None:
        super().__init__(new_token=new_token)
        self._db = db

    async def _write(self, job: Callable[[Transaction], tuple[T, list[RequestEvent]]]) -> T:
        """Run `job` on the writer thread; once it committed, announce its events
        (`cv_server.shielded.commit_then_announce`)."""
        return await commit_then_announce(self._db.write(job), self._committed)

    async def clock(self) -> float:
        """This process's wall clock: only one process serves the file."""
        return time.time()

    # -- enqueuers --------------------------------------------------------------------------------

    async def enqueue(
        self,
        req: NewRequest,
        now: float | None,
        *,
        rerun: bool = False,
        idempotency: KeyCompletion[Enqueued] | None = None,
    ) -> Enqueued:
        now = _now(now)
        batch = [EnqueueAsk(req, rerun)]

        # A batch of one (`enqueue_many`): the same reads, writes and announcement.
        def job(tx: Transaction) -> tuple[Enqueued, list[RequestEvent]]:
            (answer,), events = _enqueue_rows(tx, batch, now)
            if idempotency is not None:
                response = idempotency.respond(answer)
                complete_key(
                    tx, idempotency.workspace_id, idempotency.key, idempotency.fingerprint, response
                )
            return answer, events

        return await self._write(job)

    async def enqueue_many(
        self,
        requests: Sequence[EnqueueAsk],
        now: float | None,
        *,
        idempotency: KeyCompletion[builtins.list[Enqueued]] | None = None,
    ) -> builtins.list[Enqueued]:
        now = _now(now)
        batch = list(requests)

        def job(tx: Transaction) -> tuple[builtins.list[Enqueued], list[RequestEvent]]:
            answers, events = _enqueue_rows(tx, batch, now)
            if idempotency is not None:
                response = idempotency.respond(answers)
                complete_key(
                    tx, idempotency.workspace_id, idempotency.key, idempotency.fingerprint, response
                )
            return answers, events

        if not batch and idempotency is None:
            return []
        return await self._write(job)

    async def get(self, workspace_id: str, request_id: str) -> ProcessRequest | None:
        def read(conn: sqlite3.Connection) -> ProcessRequest | None:
            found = conn.execute(
                f"{_SELECT} WHERE request_id = ? AND workspace_id = ?", (request_id, workspace_id)
            ).fetchone()
            return None if found is None else _row(found)

        return await self._db.read(read)

    async def get_many(self, request_ids: Collection[str]) -> builtins.list[ProcessRequest]:
        ids = list(dict.fromkeys(request_ids))

        def read(conn: sqlite3.Connection) -> builtins.list[ProcessRequest]:
            rows: builtins.list[ProcessRequest] = []
            for start in range(0, len(ids), _GET_MANY_CHUNK):
                chunk = ids[start : start + _GET_MANY_CHUNK]
                marks = ", ".join("?" for _ in chunk)
                found = conn.execute(f"{_SELECT} WHERE request_id IN ({marks})", chunk)
                rows.extend(_row(values) for values in found)
            return rows

        return await self._db.read(read)

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
        where = []
        params: builtins.list[Any] = []
        if workspace_id is not None:
            where.append("workspace_id = ?")
            params.append(workspace_id)
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if after is not None:
            # The cursor row's place: its created_at as listed, its rowid (enqueue order, which
            # no update changes) read now. Scoped like the listing, so a cursor naming another
            # workspace's request tells nothing about it.
            scope = "" if workspace_id is None else " AND workspace_id = ?"
            where.append(
                f"(created_at, rowid) > (?, (SELECT rowid FROM {TABLE} "
                f"WHERE request_id = ?{scope}))"
            )
            params.extend([after[0], after[1], *([] if workspace_id is None else [workspace_id])])
        clause = f"WHERE {' AND '.join(where)}" if where else ""

        def read(conn: sqlite3.Connection) -> builtins.list[ProcessRequest]:
            found = conn.execute(
                f"{_SELECT} {clause} ORDER BY created_at, rowid LIMIT ?", (*params, limit)
            )
            return [_row(values) for values in found]

        return await self._db.read(read)

    async def status_counts(self) -> dict[RequestStatus, int]:
        def read(conn: sqlite3.Connection) -> dict[RequestStatus, int]:
            found = conn.execute(f"SELECT status, count(*) FROM {TABLE} GROUP BY status")
            return {status: int(n) for status, n in found}

        return await self._db.read(read)

    async def held_by_key(self, now: float | None) -> int:
        at = _now(now)

        def read(conn: sqlite3.Connection) -> int:
            (held,) = conn.execute(_HELD_BY_KEY, (at, at)).fetchone()
            return int(held)

        return await self._db.read(read)

    # -- workers ----------------------------------------------------------------------------------

    async def _has_claimable(
        self, classes: tuple[str, ...], workspaces: tuple[str, ...] | None, now: float | None
    ) -> bool:
        at = _now(now)
        query = claimable_sql(len(classes), None if workspaces is None else len(workspaces))
        scope = workspaces or ()
        params = (*classes, *scope, at, at, *classes, at, *scope, at)

        def read(conn: sqlite3.Connection) -> bool:
            (found,) = conn.execute(query, params).fetchone()
            return bool(found)

        return await self._db.read(read)

    async def _claim(self, plan: ClaimPlan, now: float | None) -> builtins.list[ProcessRequest]:
        at = _now(now)
        return await self._write(lambda tx: _claim_rows(tx, plan, at))

    async def heartbeat(
        self, request_id: str, claim_token: str, lease: float, now: float | None
    ) -> ProcessRequest:
        now = _now(now)

        def job(tx: Transaction) -> tuple[ProcessRequest, list[RequestEvent]]:
            row = _select(tx, request_id)
            extended = model.heartbeat(row, claim_token, lease, now)
            _update(tx, row, extended)
            return extended, []

        return await self._write(job)

    async def complete_many(
        self, completions: Sequence[Completion], now: float | None
    ) -> builtins.list[ProcessRequest | QueueError]:
        now = _now(now)
        batch = list(completions)

        def job(
            tx: Transaction,
        ) -> tuple[builtins.list[ProcessRequest | QueueError], list[RequestEvent]]:
            return _complete_rows(tx, batch, now)

        return await self._write(job)

    async def _then_claim(
        self, report: Sequence[Completion] | Failure, plan: ClaimPlan | None, now: float | None
    ) -> ThenClaimed:
        at = _now(now)

        def job(tx: Transaction) -> tuple[ThenClaimed, list[RequestEvent]]:
            if isinstance(report, Failure):
                outcomes, events = _fail_row(tx, report, at)
            else:
                outcomes, events = _complete_rows(tx, report, at)
            claimed: builtins.list[ProcessRequest] = []
            if plan is not None:
                claimed, claim_events = _claim_rows(tx, plan, at)
                events = [*events, *claim_events]
            return ThenClaimed(outcomes, claimed), events

        return await self._write(job)

    async def fail(
        self, request_id: str, claim_token: str, error: Any, backoff: float, now: float | None
    ) -> ProcessRequest:
        now = _now(now)

        def job(tx: Transaction) -> tuple[ProcessRequest, list[RequestEvent]]:
            row = _select(tx, request_id)
            after, changed = model.fail(row, claim_token, error, backoff, now)
            if not changed:
                return after, []
            _update(tx, row, after)
            return after, [RequestEvent.of(after, "failed")]

        return await self._write(job)

    # -- operators --------------------------------------------------------------------------------

    async def replay_poison(self, request_id: str, now: float | None) -> ProcessRequest:
        now = _now(now)

        def job(tx: Transaction) -> tuple[ProcessRequest, list[RequestEvent]]:
            row = _select(tx, request_id)
            replayed = model.replay_poison(row, now)
            _update(tx, row, replayed)
            return replayed, [RequestEvent.of(replayed, "replayed")]

        return await self._write(job)

    async def cancel(self, request_id: str, now: float | None) -> ProcessRequest:
        now = _now(now)

        def job(tx: Transaction) -> tuple[ProcessRequest, list[RequestEvent]]:
            row = _select(tx, request_id)
            after, changed = model.cancel(row, now)
            if not changed:
                return after, []
            _update(tx, row, after)
            return after, [RequestEvent.of(after, "cancelled")]

        return await self._write(job)

    async def discard_poison(self, request_id: str) -> ProcessRequest:
        def job(tx: Transaction) -> tuple[ProcessRequest, list[RequestEvent]]:
            row = model.discard_poison(_select(tx, request_id))
            tx.execute(f"DELETE FROM {TABLE} WHERE request_id = ?", (request_id,))
            if row.blob_ref is not None:
                _delete_blobs(tx, [(row.workspace_id, row.blob_ref)])
            return row, []

        return await self._write(job)

    async def purge_finished(self, before: float, *, limit: int) -> Purged:
        check_purge_limit(limit)

        def job(tx: Transaction) -> tuple[Purged, list[RequestEvent]]:
            batch = tx.execute(PURGE_BATCH, (before, limit)).fetchall()
            tx.executemany(f"DELETE FROM {TABLE} WHERE rowid = ?", [(r[0],) for r in batch])
            blobs = _delete_blobs(tx, [(r[1], r[2]) for r in batch if r[2] is not None])
            return Purged(requests=len(batch), blobs=blobs), []

        return await self._write(job)

    async def close(self) -> None:
        """Nothing to do: the shared database belongs to whoever opened it."""
