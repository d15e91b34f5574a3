"""The SQL of the PostgreSQL work queue and the mapping between its rows and `ProcessRequest`.

Tables come from `migrations/006_process_requests.sql`; names are unqualified (they resolve on
the connection's `search_path`, see `pool.PostgresSettings.schema`). JSON columns travel as
Python objects through the pool's codec, except inside `unnest` arrays, where they travel as
text and are cast back (`json_text`).

Time: a verb given `now=None` takes it from the database (`DB_NOW`), the one clock every instance
shares, in the very statement that needs it (the claim, the insert of a new row) or in the one
that locks the row(s) the verb then changes (`db_now` column): never an extra round trip.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Final

from cv_server.queue.model import PURGED_STATUSES, ProcessRequest

__all__ = [
    "COLUMNS",
    "DB_NOW",
    "DISCARD",
    "HELD_BY_KEY",
    "INSERT_IF_ABSENT",
    "INSERT_MANY",
    "INSERT_NEW_AND_NOTIFY",
    "LIFECYCLE",
    "LOCK_MANY",
    "LOCK_ONE",
    "NOTIFY_MANY",
    "PURGE",
    "READ_ONE",
    "REWRITE",
    "SELECT",
    "TABLE",
    "UPDATE_LIFECYCLE_AND_NOTIFY",
    "claim_sql",
    "claimable_sql",
    "insert_many_values",
    "insert_values",
    "json_text",
    "lifecycle_arrays",
    "list_sql",
    "request_from_row",
    "row_values",
]

TABLE: Final = "workspace_process_requests"

COLUMNS: Final = tuple(f.name for f in fields(ProcessRequest))
_JSON_COLUMNS: Final = frozenset({"input", "result", "error", "telemetry", "enqueue_grant"})
#: What only a rerun (which rewrites the whole request) may change.
_REQUEST_COLUMNS: Final = frozenset(
    {"request_id", "workspace_id", "stage", "job_id", "branch_path", "input", "worker_class"}
    | {"run", "max_dequeues", "created_at", "enqueue_grant", "caused_by_clock"}
    | {"concurrency_key", "max_running_per_key"}
)
#: What every other verb may change.
LIFECYCLE: Final = tuple(c for c in COLUMNS if c not in _REQUEST_COLUMNS)
_SQL_TYPES: Final = {
    "status": "text",
    "claim_token": "text",
    "claimed_by": "text",
    "lease_expires_at": "float8",
    "available_at": "float8",
    "dequeue_count": "int4",
    "result": "text",
    "error": "text",
    "blob_ref": "text",
    "cache": "text",
    "claimed_at": "float8",
    "finished_at": "float8",
    "telemetry": "text",
    "cancel_requested": "bool",
}

#: The database server's clock, in epoch seconds: the time every instance judges leases,
#: backoffs and availability by (`QueueStore.clock`). The statement's start, not
#: clock_timestamp(): one value however many rows (and probes) of a statement compare with it.
DB_NOW: Final = "extract(epoch FROM statement_timestamp())::float8"

_COLUMN_LIST: Final = ", ".join(COLUMNS)
SELECT: Final = f"SELECT {_COLUMN_LIST} FROM {TABLE}"
# These also read the database's clock (`db_now`): the time of a verb given now=None.
_SELECT_AT: Final = f"SELECT {_COLUMN_LIST}, {DB_NOW} AS db_now FROM {TABLE}"
READ_ONE: Final = f"{_SELECT_AT} WHERE request_id = $1"
LOCK_ONE: Final = f"{READ_ONE} FOR UPDATE"
# In id order: two transactions locking overlapping batches then queue instead of deadlocking.
LOCK_MANY: Final = f"{_SELECT_AT} WHERE request_id = ANY($1::text[]) ORDER BY request_id FOR UPDATE"

_PURGED: Final = "status IN ({})".format(", ".join(f"'{s}'" for s in PURGED_STATUSES))
_BLOBS: Final = "request_blobs"

# $1: finished at or before, $2: the batch. The oldest finished rows by the partial index
# (`008_request_lifecycle.sql`), skipping rows another transaction holds: a purge never waits
# on a rerun of the same row, nor two instances' purges on each other. The blobs the rows name
# go in the same statement.
PURGE: Final = f"""
WITH gone AS (
    DELETE FROM {TABLE} r USING (
        SELECT request_id FROM {TABLE}
        WHERE {_PURGED} AND finished_at <= $1
        ORDER BY finished_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) old
    WHERE r.request_id = old.request_id AND r.{_PURGED}
    RETURNING r.workspace_id, r.blob_ref
), blobs AS (
    DELETE FROM {_BLOBS} b USING gone
    WHERE b.workspace_id = gone.workspace_id AND b.blob_ref = gone.blob_ref
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS requests, (SELECT count(*) FROM blobs) AS blobs
"""

# $1: the request (locked by the caller's `LOCK_ONE`), with the blob it names.
DISCARD: Final = f"""
WITH gone AS (
    DELETE FROM {TABLE} WHERE request_id = $1 RETURNING workspace_id, blob_ref
)
DELETE FROM {_BLOBS} b USING gone
WHERE b.workspace_id = gone.workspace_id AND b.blob_ref = gone.blob_ref
"""

#: `held_by_key`: pending rows available by $1 (NULL: the database's clock) whose key runs as
#: many as their limit allows. Without the keys' locks: a gauge, not a decision.
HELD_BY_KEY: Final = f"""
SELECT count(*) FROM {TABLE} p
WHERE p.status = 'pending' AND p.max_running_per_key IS NOT NULL
  AND p.available_at <= coalesce($1::float8, {DB_NOW})
  AND (SELECT count(*) FROM {TABLE} k WHERE k.status = 'in_progress'
       AND k.concurrency_key IS NOT NULL AND k.workspace_id = p.workspace_id
       AND k.concurrency_key = p.concurrency_key
       AND k.lease_expires_at >= coalesce($1::float8, {DB_NOW})) >= p.max_running_per_key
"""

#: The columns a new row takes from `now` (`model.new_row`): the database's when now is None.
_STAMPED: Final = frozenset({"created_at", "available_at"})
_VALUES: Final = ", ".join(
    f"coalesce(${i}::float8, {DB_NOW})" if column in _STAMPED else f"${i}"
    for i, column in enumerate(COLUMNS, start=1)
)
_NEXT: Final = len(COLUMNS) + 1
#: Parameters: `insert_values`. Returns the new row's creation time (none if the id existed).
INSERT_IF_ABSENT: Final = (
    f"INSERT INTO {TABLE} ({_COLUMN_LIST}) VALUES ({_VALUES})"
    " ON CONFLICT (request_id) DO NOTHING RETURNING request_id, created_at"
)
# One statement, hence one transaction: the row and the announcement of its arrival commit
# together, and the announcement only if the row was new.
INSERT_NEW_AND_NOTIFY: Final = f"""
WITH inserted AS ({INSERT_IF_ABSENT})
SELECT request_id, created_at, pg_notify(${_NEXT}, ${_NEXT + 1}) FROM inserted
"""


def _unnest_column(column: str) -> str:
    value = f"u.{column}"
    return f"{value}::json" if column in _JSON_COLUMNS else value


#: Every column's array type, for `INSERT_MANY`.
_ROW_TYPES: Final = {
    **_SQL_TYPES,
    **dict.fromkeys(
        ("request_id", "workspace_id", "stage", "job_id", "branch_path", "worker_class"), "text"
    ),
    "input": "text",
    "enqueue_grant": "text",
    "caused_by_clock": "int8",
    "run": "int4",
    "max_dequeues": "int4",
    "concurrency_key": "text",
    "max_running_per_key": "int4",
}
_UNSTAMPED: Final = tuple(c for c in COLUMNS if c not in _STAMPED)
#: Many new rows in one statement, in the order given (their `seq` is their enqueue order), each
#: unless its id exists. Parameters: `insert_many_values`. Returns the new rows' ids and their
#: creation time (one for all: the statement's, when now is NULL).
INSERT_MANY: Final = (
    f"INSERT INTO {TABLE} ({_COLUMN_LIST}) SELECT "
    + ", ".join(
        f"coalesce($1::float8, {DB_NOW})" if c in _STAMPED else _unnest_column(c) for c in COLUMNS
    )
    + " FROM unnest("
    + ", ".join(f"${i}::{_ROW_TYPES[c]}[]" for i, c in enumerate(_UNSTAMPED, start=2))
    + f") WITH ORDINALITY AS u({', '.join(_UNSTAMPED)}, ord) ORDER BY u.ord"
    " ON CONFLICT (request_id) DO NOTHING RETURNING request_id, created_at"
)
#: A rerun re-opens a finished request: every column but the key is written.
REWRITE: Final = (
    f"UPDATE {TABLE} SET "
    + ", ".join(f"{c} = ${i}" for i, c in enumerate(COLUMNS, start=1) if c != "request_id")
    + " WHERE request_id = $1"
)
NOTIFY_MANY: Final = "SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p"


_ARRAYS: Final = ", ".join(f"${i}::{_SQL_TYPES[c]}[]" for i, c in enumerate(LIFECYCLE, start=2))
_NOTIFY_ARG: Final = len(LIFECYCLE) + 2
# The rows, then the notifications (which fire at COMMIT, never on rollback), in one round trip.
UPDATE_LIFECYCLE_AND_NOTIFY: Final = f"""
WITH updated AS (
    UPDATE {TABLE} t SET {", ".join(f"{c} = {_unnest_column(c)}" for c in LIFECYCLE)}
    FROM unnest($1::text[], {_ARRAYS}) AS u(request_id, {", ".join(LIFECYCLE)})
    WHERE t.request_id = u.request_id
)
SELECT pg_notify(${_NOTIFY_ARG}, p) FROM unnest(${_NOTIFY_ARG + 1}::text[]) AS p
"""


def json_text(value: Any) -> str | None:
    """A JSON column value as text for an `unnest` array (SQL NULL for None)."""
    if value is None:
        return None
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def row_values(row: ProcessRequest) -> list[Any]:
    """The parameters of `REWRITE`, in `COLUMNS` order."""
    return [getattr(row, column) for column in COLUMNS]


def insert_values(row: ProcessRequest, now: float | None) -> list[Any]:
    """The parameters of `INSERT_IF_ABSENT`: `row`'s, its creation time `now` (None: the
    database's, which the insert returns)."""
    return [now if column in _STAMPED else getattr(row, column) for column in COLUMNS]


def insert_many_values(rows: Sequence[ProcessRequest], now: float | None) -> list[Any]:
    """The parameters of `INSERT_MANY`: the creation time `now` of every row (None: the
    database's), then one array per column."""
    arrays: list[Any] = [now]
    for column in _UNSTAMPED:
        if column in _JSON_COLUMNS:
            arrays.append([json_text(getattr(row, column)) for row in rows])
        else:
            arrays.append([getattr(row, column) for row in rows])
    return arrays


def lifecycle_arrays(rows: Sequence[ProcessRequest]) -> list[list[Any]]:
    """The array parameters of `UPDATE_LIFECYCLE_AND_NOTIFY` ($1 .. before the channel)."""
    arrays: list[list[Any]] = [[row.request_id for row in rows]]
    for column in LIFECYCLE:
        if column in _JSON_COLUMNS:
            arrays.append([json_text(getattr(row, column)) for row in rows])
        else:
            arrays.append([getattr(row, column) for row in rows])
    return arrays


def request_from_row(row: Mapping[str, Any]) -> ProcessRequest:
    return ProcessRequest(**{column: row[column] for column in COLUMNS})


#: What a claim probe reads of a row's concurrency key (`t`: the table's alias and dot).
_KEY_COLUMNS: Final = "{t}workspace_id, {t}concurrency_key, {t}max_running_per_key"


#: The keys running at the statement's start, and how many of each (`running_keys` CTE): the
#: running keyed rows only, on their partial index. Parameter: now.
_RUNNING_KEYS: Final = (
    "running_keys AS (SELECT workspace_id, concurrency_key, count(*) AS n"
    f" FROM {TABLE} WHERE status = 'in_progress' AND concurrency_key IS NOT NULL"
    " AND lease_expires_at >= {now} GROUP BY workspace_id, concurrency_key)"
)


def _key_free(t: str, now: str) -> str:
    """Whether the row (alias `t`) may take a slot of its key (docs/queue.md, "Concurrency
    keys"): no limit, or fewer of its key running than its limit (`cv_key_running`,
    `migrations/014_request_concurrency_keys.sql`, which also takes the key's lock, or answers
    NULL — skip — when another claimer holds it). A CASE, so a row without a limit never calls
    the function: unkeyed work pays one NULL test. A row whose key was already full when the
    statement began (`running_keys`) is passed over without the function's lock and count:
    skipping on an old count only ever skips, and a claim only admits on the locked count, so
    the rows a full key holds back cost a lookup each, not a lock and a count."""
    return (
        f"CASE WHEN {t}max_running_per_key IS NULL THEN true"
        " WHEN coalesce((SELECT rk.n FROM running_keys rk"
        f" WHERE rk.workspace_id = {t}workspace_id AND rk.concurrency_key = {t}concurrency_key),"
        f" 0) >= {t}max_running_per_key THEN false ELSE"
        f" cv_key_running({t}workspace_id, {t}concurrency_key, {now}) < {t}max_running_per_key END"
    )


@functools.lru_cache(maxsize=2)
def claim_sql(restricted: bool) -> str:
    """The claim statement, for a worker whose token covers only some workspaces (`restricted`)
    or all of them. Parameters: $1 now, $2 limit, $3 worker_id, $4 lease, $5 claim tokens (one
    per possible row), $6 the worker classes, $7 the workspaces (NULL when all are allowed), $8
    channel, $9 instance id.

    One statement, one implicit transaction, one round trip, of the same size whatever the
    number of classes and workspaces: the scope travels as two arrays, so a worker naming
    thousands of classes, or a token covering thousands of workspaces, gets a statement the
    server plans within its statement_timeout
    (tests/worker/test_lease_lifecycle.py::test_a_claim_naming_thousands_of_classes_is_served_not_a_server_error).

    - one pending probe per class (and per allowed workspace), a LATERAL index walk of its
      partial index in claimable-since order that stops after `limit` rows;
    - one probe of lapsed leases (their workers died) that may still run; one of lapsed leases
      that were dequeued `max_dequeues` times, which are parked as poison (docs/queue.md), or whose
      request was cancelled while they ran, which are parked as cancelled;
    - the oldest `limit` candidates by when they became claimable are claimed, each under its own
      token; `FOR UPDATE SKIP LOCKED` in every probe, so concurrent claimers on any instance
      never wait on each other nor get the same row;
    - a parked row is announced (NOTIFY, fired at commit) to waiters on every instance;
    - a row with a `max_running_per_key` is passed over where it stands while its key runs that
      many (`_key_free`, which takes the key's lock before it counts), and a batch takes no more
      of a key than the slots left (`candidates.ahead`): docs/queue.md, "Concurrency keys".

    The claim itself is `model.claim` and the parking `model.park_lapsed`, spelled in SQL
    (tests compare the rows with the model's). Classes and workspaces must be distinct
    (`store.claim_scope` makes them so): a pair probed twice would offer its rows twice.
    A NULL `now` is the database's (`DB_NOW`): a lease is judged, and granted, on the clock
    every instance shares, not on the claiming machine's.
    """
    now = f"coalesce($1::float8, {DB_NOW})"
    # $7 is NULL when every workspace is allowed (always referenced, so its type is known).
    ws_filter = " AND ($7::text[] IS NULL OR workspace_id = ANY($7::text[]))"
    scope = "unnest($6::text[]) AS c(worker_class)"
    ws_clause = ""
    if restricted:
        scope += " CROSS JOIN unnest($7::text[]) AS w(workspace_id)"
        ws_clause = " AND p.workspace_id = w.workspace_id"
    pending = (
        f"SELECT probe.* FROM {scope} CROSS JOIN LATERAL ("
        f"SELECT p.request_id, p.available_at AS since, p.created_at, p.seq, false AS lapsed,"
        f" {_KEY_COLUMNS.format(t='p.')}"
        f" FROM {TABLE} p"
        f" WHERE p.status = 'pending' AND p.worker_class = c.worker_class{ws_clause}"
        f" AND p.available_at <= {now} AND {_key_free('p.', now)}"
        " ORDER BY p.available_at, p.created_at, p.seq LIMIT $2 FOR UPDATE SKIP LOCKED) probe"
    )
    lapsed_where = (
        "status = 'in_progress' AND worker_class = ANY($6::text[])"
        f" AND lease_expires_at < {now}{ws_filter}"
    )
    ctes = [_RUNNING_KEYS.format(now=now), f"pending AS ({pending})"]
    ctes.append(
        "lapsed AS (SELECT request_id, lease_expires_at AS since, created_at, seq, true AS lapsed,"
        f" {_KEY_COLUMNS.format(t='')} FROM {TABLE}"
        f" WHERE {lapsed_where} AND dequeue_count < max_dequeues AND NOT cancel_requested"
        f" AND {_key_free('', now)}"
        " ORDER BY lease_expires_at, created_at, seq LIMIT $2 FOR UPDATE SKIP LOCKED)"
    )
    ctes.append(
        f"doomed AS (SELECT request_id FROM {TABLE}"
        f" WHERE {lapsed_where} AND (dequeue_count >= max_dequeues OR cancel_requested)"
        " LIMIT $2 FOR UPDATE SKIP LOCKED)"
    )
    # Each candidate in claim order, with how many of its key's candidates come before it: a
    # keyed row is taken only if those and the key's running rows leave it a slot
    # (`model.held_back_by_key`; the key's lock is already ours, taken by its probe).
    ctes.append(
        "candidates AS (SELECT c.*, count(*) OVER (PARTITION BY c.workspace_id,"
        " c.concurrency_key ORDER BY c.since, c.created_at, c.seq"
        " ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS ahead"
        " FROM (SELECT * FROM pending UNION ALL SELECT * FROM lapsed) c)"
    )
    ctes.append(
        "chosen AS (SELECT request_id, lapsed,"
        " row_number() OVER (ORDER BY since, created_at, seq) AS n"
        " FROM (SELECT * FROM candidates WHERE CASE WHEN max_running_per_key IS NULL THEN true"
        f" ELSE cv_key_running(workspace_id, concurrency_key, {now}) + ahead"
        " < max_running_per_key END ORDER BY since, created_at, seq LIMIT $2) c)"
    )
    returning = ", ".join(f"t.{c}" for c in COLUMNS)
    ctes.append(
        f"claimed AS (UPDATE {TABLE} t SET status = 'in_progress',"
        f" claim_token = ($5::text[])[chosen.n], claimed_by = $3::text, claimed_at = {now},"
        f" lease_expires_at = {now} + $4::float8, dequeue_count = t.dequeue_count + 1"
        f" FROM chosen WHERE t.request_id = chosen.request_id"
        f" RETURNING {returning}, chosen.n, chosen.lapsed)"
    )
    # `model.park_lapsed`: cancelled if a cancel was asked for, else poison with its error.
    ctes.append(
        f"parked AS (UPDATE {TABLE} t SET"
        " status = CASE WHEN t.cancel_requested THEN 'cancelled' ELSE 'poison' END,"
        f" lease_expires_at = NULL, finished_at = {now},"
        " error = CASE WHEN t.cancel_requested THEN t.error ELSE coalesce(t.error,"
        " json_build_object('code', 'lease_lapsed', 'message',"
        " 'the lease lapsed on dequeue ' || t.dequeue_count || ' of ' || t.max_dequeues)) END"
        " FROM doomed WHERE t.request_id = doomed.request_id"
        f" RETURNING {returning}, 0::bigint AS n, true AS lapsed)"
    )
    announce = (
        "CASE WHEN r.status IN ('poison', 'cancelled') THEN"
        " pg_notify($8::text, json_build_array($9::text,"
        " json_build_array(json_build_array(r.workspace_id, r.request_id, r.status, r.run,"
        " r.worker_class)))::text) END"
    )
    return (
        f"WITH {', '.join(ctes)} "
        f"SELECT r.*, {announce} AS announced"
        " FROM (SELECT * FROM parked UNION ALL SELECT * FROM claimed) r ORDER BY r.n"
    )


@functools.lru_cache(maxsize=2)
def claimable_sql(restricted: bool) -> str:
    """Whether anything is claimable (`QueueStore.has_claimable`), for a worker whose token
    covers only some workspaces (`restricted`) or all of them. Parameters: $1 the worker
    classes, $2 now (NULL: the database's, `DB_NOW`), $3 the workspaces (restricted only).

    What `claim_sql` would find, probed as it probes but without locking or writing: per class
    (and per allowed workspace) a LATERAL walk of the pending rows' partial index, and per class
    one of the lapsed leases' (few: only dead workers leave them), each in index order and
    stopping at its first row. The ORDER BY is what keeps the walks on their indexes: without
    it the planner chose a sequential scan "until the first match" on a large backlog, which
    walks the whole table when the matches sit at its end. So an idle worker's poll costs a few
    index seeks whatever the backlog, and another tenant's backlog is never walked.
    """
    now = f"coalesce($2::float8, {DB_NOW})"
    scope = "unnest($1::text[]) AS c(worker_class)"
    ws_clause = lapsed_ws = ""
    if restricted:
        ws_clause = " AND p.workspace_id = w.workspace_id"
        lapsed_ws = " AND p.workspace_id = ANY($3::text[])"
    pending_scope = scope + (
        " CROSS JOIN unnest($3::text[]) AS w(workspace_id)" if restricted else ""
    )
    # A row its key holds back is not claimable (else an idle worker would be told of work it
    # cannot claim, and poll again at once, in a loop). Counted without the key's lock: a hint.
    running = (
        f"(SELECT count(*) FROM {TABLE} k WHERE k.status = 'in_progress'"
        " AND k.concurrency_key IS NOT NULL AND k.workspace_id = p.workspace_id"
        f" AND k.concurrency_key = p.concurrency_key AND k.lease_expires_at >= {now})"
    )
    key_free = (
        "CASE WHEN p.max_running_per_key IS NULL THEN true"
        f" ELSE {running} < p.max_running_per_key END"
    )
    lapsed_free = (
        "CASE WHEN p.max_running_per_key IS NULL OR p.dequeue_count >= p.max_dequeues"
        f" OR p.cancel_requested THEN true ELSE {running} < p.max_running_per_key END"
    )
    return (
        f"SELECT EXISTS (SELECT 1 FROM {pending_scope} CROSS JOIN LATERAL (SELECT 1 FROM {TABLE} p"
        f" WHERE p.status = 'pending' AND p.worker_class = c.worker_class{ws_clause}"
        f" AND p.available_at <= {now} AND {key_free} ORDER BY p.available_at LIMIT 1) probe)"
        f" OR EXISTS (SELECT 1 FROM {scope} CROSS JOIN LATERAL (SELECT 1 FROM {TABLE} p"
        f" WHERE p.status = 'in_progress' AND p.worker_class = c.worker_class"
        f" AND p.lease_expires_at < {now}{lapsed_ws} AND {lapsed_free}"
        " ORDER BY p.lease_expires_at LIMIT 1) probe)"
    )


def list_sql(by_status: bool, by_workspace: bool, after: bool = False) -> str:
    """`list`: $1 limit, then the status and the workspace if filtered on, then the cursor's
    created_at and request_id if paging (`after`)."""
    where: list[str] = []
    if by_status:
        where.append(f"status = ${len(where) + 2}")
    if by_workspace:
        where.append(f"workspace_id = ${len(where) + 2}")
    if after:
        # The cursor row's place: its created_at as listed, its seq (enqueue order, which no
        # update changes) read now. Scoped like the listing, so a cursor naming another
        # workspace's request tells nothing about it.
        n = len(where) + 2
        scope = f" AND workspace_id = ${n - 1}" if by_workspace else ""
        where.append(
            f"(created_at, seq) > (${n}::float8,"
            f" (SELECT seq FROM {TABLE} WHERE request_id = ${n + 1}::text{scope}))"
        )
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return f"{SELECT}{clause} ORDER BY created_at, seq LIMIT $1"
