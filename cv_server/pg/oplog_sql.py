"""The SQL of the PostgreSQL op-log, and the reads that rebuild or catch up a cached sub-doc.

Tables come from `migrations/001_oplog.sql`. Every statement names its tables unqualified, so
they resolve on the connection's `search_path` (see `pool.PostgresSettings.schema`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_mutations import SubDocState
from cv_server.oplog.pipeline import (
    NewRejection,
    Recorded,
    RecordedCommit,
    RecordedRejection,
    rebuild_from_log,
)
from cv_server.oplog.store import LogEntry, OpLogCorrupted

__all__ = [
    "HEADS_TABLE",
    "OPS_TABLE",
    "OUTCOMES_TABLE",
    "SNAPSHOTS_TABLE",
    "CachedSubDoc",
    "OpLogCorrupted",
    "catch_up",
    "compact_sub_doc",
    "expire_rejections",
    "list_sub_docs",
    "load_sub_doc",
    "lock_heads",
    "look_up_many",
    "read_head",
    "read_horizon",
    "read_since",
    "read_stats",
    "snapshots_from",
    "write_batches",
    "write_snapshot",
]

HEADS_TABLE: Final = "workspace_sub_doc_heads"
OPS_TABLE: Final = "workspace_sub_doc_ops"
OUTCOMES_TABLE: Final = "workspace_sub_doc_op_outcomes"
SNAPSHOTS_TABLE: Final = "workspace_sub_doc_snapshots"

_SELECT_HEAD: Final = f"SELECT clock FROM {HEADS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2"
_SELECT_OPS_AFTER: Final = (
    f"SELECT clock, op::text AS op FROM {OPS_TABLE}"
    " WHERE workspace_id = $1 AND sub_doc = $2 AND clock > $3 ORDER BY clock"
)
_SELECT_SNAPSHOT: Final = (
    f"SELECT clock, state::text AS state FROM {SNAPSHOTS_TABLE}"
    " WHERE workspace_id = $1 AND sub_doc = $2"
)
# One statement, hence one snapshot: the head can never be behind the entries returned.
_READ_SINCE: Final = f"""
SELECT h.clock AS head, o.clock, o.op_id, o.op, o.committed_at
FROM {HEADS_TABLE} h
LEFT JOIN LATERAL (
    SELECT clock, op_id, op::text AS op, extract(epoch FROM committed_at)::float8 AS committed_at
    FROM {OPS_TABLE}
    WHERE workspace_id = h.workspace_id AND sub_doc = h.sub_doc AND clock > $3
    ORDER BY clock LIMIT $4
) o ON true
WHERE h.workspace_id = $1 AND h.sub_doc = $2
ORDER BY o.clock
"""
# Written sub-docs by name from the heads (one row each, in key order: the page is a range scan of
# their primary key), with the time of the op at the head (one probe of the log's key each). A
# head at clock 0 (only rejections so far) is no written sub-doc.
_LIST_SUB_DOCS: Final = f"""
SELECT h.sub_doc, h.clock, extract(epoch FROM o.committed_at)::float8 AS committed_at, (
    SELECT min(clock) FROM {OPS_TABLE} WHERE workspace_id = h.workspace_id AND sub_doc = h.sub_doc
) AS horizon
FROM {HEADS_TABLE} h
JOIN {OPS_TABLE} o
    ON o.workspace_id = h.workspace_id AND o.sub_doc = h.sub_doc AND o.clock = h.clock
WHERE h.workspace_id = $1 AND h.sub_doc > $2 AND h.clock > 0
ORDER BY h.sub_doc
LIMIT $3
"""
# The groups of one or several sub-docs in one transaction: heads locked (`lock_heads`), outcomes
# looked up (`look_up_many`), then rows, outcomes, heads and notifications written in one round
# trip (`write_batches`: data-modifying CTEs run whether or not the outer query reads them, and
# pg_notify fires at COMMIT, never on rollback). It answers the transaction's `now()`, the
# `committed_at` its op rows default to, so the entries `append` returns carry the very value a
# later `read_since` reads (both through the same `extract(epoch ...)::float8`). The heads are
# locked in one order on every instance (ORDER BY under FOR UPDATE locks rows as they come out of
# the sort), so two instances locking overlapping sets cannot deadlock. Only heads created
# meanwhile are locked out of that order; PostgreSQL detects such a deadlock and the transaction
# is retried (40P01).
_LOCK_HEADS: Final = f"""
SELECT h.workspace_id, h.sub_doc, h.clock
FROM {HEADS_TABLE} h
JOIN unnest($1::text[], $2::text[]) AS k(workspace_id, sub_doc)
    ON h.workspace_id = k.workspace_id AND h.sub_doc = k.sub_doc
ORDER BY h.workspace_id, h.sub_doc
FOR UPDATE OF h
"""
_CREATE_HEADS: Final = f"""
INSERT INTO {HEADS_TABLE} (workspace_id, sub_doc)
SELECT * FROM unnest($1::text[], $2::text[])
ON CONFLICT (workspace_id, sub_doc) DO NOTHING
"""
_LOOK_UP_MANY: Final = f"""
SELECT o.workspace_id, o.sub_doc, o.op_id, o.clock, o.fingerprint, o.code, o.message
FROM unnest($1::text[], $2::text[], $3::text[]) AS k(workspace_id, sub_doc, op_id)
JOIN {OUTCOMES_TABLE} o
    ON o.op_id = k.op_id AND o.workspace_id = k.workspace_id AND o.sub_doc = k.sub_doc
"""
_WRITE_BATCHES: Final = f"""
WITH new_ops AS (
    INSERT INTO {OPS_TABLE} (workspace_id, sub_doc, clock, op_id, op)
    SELECT t.workspace_id, t.sub_doc, t.clock, t.op_id, t.op::json
    FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[])
        AS t(workspace_id, sub_doc, clock, op_id, op)
), new_outcomes AS (
    INSERT INTO {OUTCOMES_TABLE} (op_id, workspace_id, sub_doc, fingerprint, clock, code, message)
    SELECT t.op_id, t.workspace_id, t.sub_doc, t.fingerprint, t.clock, t.code, t.message
    FROM unnest($6::text[], $7::text[], $8::text[], $9::text[], $10::bigint[], $11::text[],
                $12::text[])
        AS t(op_id, workspace_id, sub_doc, fingerprint, clock, code, message)
), new_heads AS (
    UPDATE {HEADS_TABLE} h SET clock = t.clock
    FROM unnest($13::text[], $14::text[], $15::bigint[]) AS t(workspace_id, sub_doc, clock)
    WHERE h.workspace_id = t.workspace_id AND h.sub_doc = t.sub_doc AND h.clock < t.clock
)
SELECT extract(epoch FROM now())::float8 AS committed_at, count(pg_notify($16, p)) AS notified
FROM unnest($17::text[]) AS p
"""
_UPSERT_SNAPSHOT: Final = f"""
INSERT INTO {SNAPSHOTS_TABLE} (workspace_id, sub_doc, clock, state)
VALUES ($1, $2, $3, $4::text::json)
ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET clock = excluded.clock, state = excluded.state
WHERE {SNAPSHOTS_TABLE}.clock < excluded.clock
"""

# -- storage over time (`compact`, docs/operating.md) ---------------------------------------------

_SNAPSHOTS_FROM: Final = f"""
SELECT workspace_id, sub_doc, clock FROM {SNAPSHOTS_TABLE}
WHERE (workspace_id, sub_doc) >= ($1, $2)
ORDER BY workspace_id, sub_doc
LIMIT $3
"""
# One compactor per sub-doc at a time, without waiting: a transaction-scoped advisory lock, tried
# (never awaited), on the sub-doc's key. Another compactor holding it skips the sub-doc for this
# pass; writers never take it, so compaction never queues an append (and deletes only rows below
# the snapshot, which no writer touches). A hash collision only makes a compactor skip a sub-doc.
# The first key is this feature's own namespace among advisory locks ("cvcompact" in short).
_TRY_COMPACT_LOCK: Final = "SELECT pg_try_advisory_xact_lock(43301, hashtext($1 || '/' || $2))"
# Delete the prefix of the sub-doc's log below the snapshot ($3), at most $4 rows, up to the first
# op committed at or after $5 (so only a prefix goes: the log stays gap-free), and the op_id records
# of the deleted ops (probes of the outcomes' key). Answers the rows deleted.
_COMPACT_SUB_DOC: Final = f"""
WITH win AS (
    SELECT clock, committed_at FROM {OPS_TABLE}
    WHERE workspace_id = $1 AND sub_doc = $2 AND clock < $3
    ORDER BY clock
    LIMIT $4
), stop AS (
    SELECT coalesce(min(clock) FILTER (WHERE committed_at >= $5), $3) AS clock FROM win
), gone AS (
    DELETE FROM {OPS_TABLE} o
    USING win, stop
    WHERE o.workspace_id = $1 AND o.sub_doc = $2 AND o.clock = win.clock
        AND win.clock < stop.clock
    RETURNING o.op_id
), gone_records AS (
    DELETE FROM {OUTCOMES_TABLE} u
    USING gone
    WHERE u.op_id = gone.op_id AND u.workspace_id = $1 AND u.sub_doc = $2
)
SELECT count(*) FROM gone
"""
# Rejections older than $1, at most $2, oldest first; rows another compactor is deleting are
# skipped, not waited for.
_EXPIRE_REJECTIONS: Final = f"""
WITH doomed AS (
    SELECT ctid FROM {OUTCOMES_TABLE}
    WHERE clock IS NULL AND recorded_at < $1
    ORDER BY recorded_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {OUTCOMES_TABLE} u USING doomed WHERE u.ctid = doomed.ctid RETURNING 1
)
SELECT count(*) FROM gone
"""
# The log's first clock, or the head + 1 when the log holds none (1 for a sub-doc never written).
_SELECT_HORIZON: Final = f"""
SELECT coalesce(
    (SELECT min(clock) FROM {OPS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2),
    (SELECT clock FROM {HEADS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2) + 1,
    1
)
"""
# The planner's row estimate (kept by autovacuum/ANALYZE; -1 before the first), not a count: a
# COUNT(*) of the log would scan it. The oldest op: the heads (one row per sub-doc) each probe
# the first op of their log, so this costs one probe per sub-doc, not a scan of every op.
_STATS: Final = f"""
SELECT
    (SELECT greatest(reltuples, 0)::bigint FROM pg_class
     WHERE oid = to_regclass('{OPS_TABLE}')) AS rows,
    (SELECT extract(epoch FROM min(o.committed_at))::float8
     FROM {HEADS_TABLE} h
     CROSS JOIN LATERAL (
         SELECT committed_at FROM {OPS_TABLE}
         WHERE workspace_id = h.workspace_id AND sub_doc = h.sub_doc
         ORDER BY clock LIMIT 1
     ) o) AS oldest
"""


@dataclass(slots=True)
class CachedSubDoc:
    """One instance's copy of a sub-doc: the state after every op up to `clock`."""

    clock: int
    state: SubDocState


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def lock_heads(
    conn: asyncpg.Connection, keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], int]:
    """Take the sub-docs' head row locks (in key order, held until the transaction ends) and
    return their head clocks, creating the heads of new sub-docs.

    Every writer of a sub-doc, on every instance, queues here: clocks are allocated under this
    lock, so there is nothing to retry (issue 7: no optimistic retry storms).
    """
    heads = await _lock_heads(conn, sorted(keys))
    missing = sorted(key for key in keys if key not in heads)
    if missing:
        await conn.execute(_CREATE_HEADS, [key[0] for key in missing], [key[1] for key in missing])
        heads.update(await _lock_heads(conn, missing))
    return heads


async def _lock_heads(
    conn: asyncpg.Connection, keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], int]:
    rows = await conn.fetch(_LOCK_HEADS, [key[0] for key in keys], [key[1] for key in keys])
    return {(row["workspace_id"], row["sub_doc"]): int(row["clock"]) for row in rows}


async def list_sub_docs(
    conn: asyncpg.Connection, workspace_id: str, after: str, limit: int
) -> list[tuple[str, int, float, int]]:
    rows = await conn.fetch(_LIST_SUB_DOCS, workspace_id, after, limit)
    return [
        (row["sub_doc"], int(row["clock"]), float(row["committed_at"]), int(row["horizon"]))
        for row in rows
    ]


async def read_head(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> int:
    clock = await conn.fetchval(_SELECT_HEAD, workspace_id, sub_doc)
    return 0 if clock is None else int(clock)


def _rebuild(doc: CachedSubDoc, rows: Sequence[Any], key: tuple[str, str]) -> None:
    entries = ((int(row["clock"]), row["op"]) for row in rows)
    doc.clock = rebuild_from_log(doc.state, doc.clock, entries, key)


async def load_sub_doc(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> CachedSubDoc:
    """Rebuild a sub-doc from its latest snapshot plus the log after it."""
    key = (workspace_id, sub_doc)
    row = await conn.fetchrow(_SELECT_SNAPSHOT, workspace_id, sub_doc)
    if row is None:
        doc = CachedSubDoc(0, SubDocState.empty())
    else:
        doc = CachedSubDoc(int(row["clock"]), SubDocState.loads(row["state"]))
    _rebuild(doc, await conn.fetch(_SELECT_OPS_AFTER, workspace_id, sub_doc, doc.clock), key)
    return doc


async def catch_up(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, doc: CachedSubDoc
) -> CachedSubDoc:
    """Apply the log entries after `doc.clock` (committed by other instances) to `doc`; return
    it, or a copy rebuilt from the snapshot when the log no longer reaches back to `doc.clock`
    (compacted past a cache that stood still that long:
    `test_a_cache_behind_the_horizon_is_rebuilt_from_the_snapshot`)."""
    rows = await conn.fetch(_SELECT_OPS_AFTER, workspace_id, sub_doc, doc.clock)
    if rows and int(rows[0]["clock"]) > doc.clock + 1:
        snapshot = await conn.fetchrow(_SELECT_SNAPSHOT, workspace_id, sub_doc)
        if snapshot is not None and int(snapshot["clock"]) >= int(rows[0]["clock"]) - 1:
            return await load_sub_doc(conn, workspace_id, sub_doc)
    _rebuild(doc, rows, (workspace_id, sub_doc))
    return doc


async def snapshots_from(
    conn: asyncpg.Connection, start: tuple[str, str], limit: int
) -> list[tuple[str, str, int]]:
    """The sub-docs with a snapshot from `start` (inclusive) in key order, and their clocks."""
    rows = await conn.fetch(_SNAPSHOTS_FROM, start[0], start[1], limit)
    return [(row["workspace_id"], row["sub_doc"], int(row["clock"])) for row in rows]


async def compact_sub_doc(
    conn: asyncpg.Connection,
    workspace_id: str,
    sub_doc: str,
    snapshot_clock: int,
    older_than: float,
    limit: int,
) -> int | None:
    """In the caller's transaction: delete at most `limit` ops of the sub-doc's log prefix below
    `snapshot_clock` that committed before `older_than` (epoch seconds), with their op_id
    records. None when another compactor holds the sub-doc (skipped, not waited for)."""
    if not await conn.fetchval(_TRY_COMPACT_LOCK, workspace_id, sub_doc):
        return None
    cutoff = datetime.fromtimestamp(older_than, tz=UTC)
    return int(
        await conn.fetchval(_COMPACT_SUB_DOC, workspace_id, sub_doc, snapshot_clock, limit, cutoff)
    )


async def expire_rejections(conn: asyncpg.Connection, older_than: float, limit: int) -> int:
    cutoff = datetime.fromtimestamp(older_than, tz=UTC)
    return int(await conn.fetchval(_EXPIRE_REJECTIONS, cutoff, limit))


async def read_horizon(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> int:
    return int(await conn.fetchval(_SELECT_HORIZON, workspace_id, sub_doc))


async def read_stats(conn: asyncpg.Connection) -> tuple[int, float | None]:
    row = await conn.fetchrow(_STATS)
    oldest = row["oldest"]
    return int(row["rows"] or 0), None if oldest is None else float(oldest)


async def look_up_many(
    conn: asyncpg.Connection, wanted: Sequence[tuple[str, str, str]]
) -> dict[tuple[str, str], dict[str, Recorded]]:
    """What the log holds for (workspace_id, sub_doc, op_id) triples, per sub-doc: committed
    clocks and recorded rejections."""
    recorded: dict[tuple[str, str], dict[str, Recorded]] = {}
    rows = await conn.fetch(
        _LOOK_UP_MANY, [w[0] for w in wanted], [w[1] for w in wanted], [w[2] for w in wanted]
    )
    for row in rows:
        of_doc = recorded.setdefault((row["workspace_id"], row["sub_doc"]), {})
        if row["clock"] is not None:
            of_doc[row["op_id"]] = RecordedCommit(int(row["clock"]), row["fingerprint"])
        else:
            of_doc[row["op_id"]] = RecordedRejection(
                row["code"], row["message"], row["fingerprint"]
            )
    return recorded


_LOOK_UP_MARKS: Final = """
SELECT m.workspace_id, m.sub_doc, m.client_id, m.seq
FROM unnest($1::text[], $2::text[], $3::text[]) AS w(workspace_id, sub_doc, client_id)
JOIN workspace_sub_doc_client_marks m USING (workspace_id, sub_doc, client_id)
"""
_UPSERT_MARKS: Final = """
INSERT INTO workspace_sub_doc_client_marks (workspace_id, sub_doc, client_id, seq)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
ON CONFLICT (workspace_id, sub_doc, client_id) DO UPDATE
SET seq = greatest(workspace_sub_doc_client_marks.seq, excluded.seq), decided_at = now()
"""
_SELECT_MARK: Final = """
SELECT seq FROM workspace_sub_doc_client_marks
WHERE workspace_id = $1 AND sub_doc = $2 AND client_id = $3
"""


async def look_up_marks(
    conn: asyncpg.Connection, wanted: Sequence[tuple[str, str, str]]
) -> dict[tuple[str, str], dict[str, int]]:
    """The marks of (workspace_id, sub_doc, client_id) lanes, per sub-doc (absent: none yet)."""
    marks: dict[tuple[str, str], dict[str, int]] = {}
    rows = await conn.fetch(_LOOK_UP_MARKS, *_columns(wanted, 3))
    for row in rows:
        marks.setdefault((row["workspace_id"], row["sub_doc"]), {})[row["client_id"]] = int(
            row["seq"]
        )
    return marks


async def write_marks(conn: asyncpg.Connection, marks: Sequence[tuple[str, str, str, int]]) -> None:
    """Move lanes' marks up to the seqs given (never down), in the caller's transaction."""
    await conn.execute(_UPSERT_MARKS, *_columns(marks, 4))


async def read_mark(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, client_id: str
) -> int:
    value = await conn.fetchval(_SELECT_MARK, workspace_id, sub_doc, client_id)
    return 0 if value is None else int(value)


@dataclass(slots=True)
class DocWrite:
    """What one sub-doc's group writes in a `write_batches` transaction."""

    workspace_id: str
    sub_doc: str
    entries: Sequence[LogEntry]
    fingerprints: Sequence[str]
    rejections: Sequence[NewRejection]
    clock: int
    payload: str | None


async def write_batches(
    conn: asyncpg.Connection, writes: Sequence[DocWrite], channel: str
) -> float:
    """Insert each sub-doc's entries (`fingerprints[i]` is that of `entries[i]`), the outcomes of
    their op_ids and the rejections, move the heads, and NOTIFY each sub-doc's payload (if any)
    on `channel` when the transaction commits. Returns the rows' `committed_at` (epoch seconds,
    the database's clock)."""
    ops: list[tuple[str, str, int, str | None, str]] = []
    outcomes: list[tuple[str, str, str, str, int | None, str | None, str | None]] = []
    heads: list[tuple[str, str, int]] = []
    payloads: list[str] = []
    for w in writes:
        for entry, fingerprint in zip(w.entries, w.fingerprints, strict=True):
            ops.append((w.workspace_id, w.sub_doc, entry.clock, entry.op_id, _dumps(entry.op)))
            if entry.op_id is not None:
                outcomes.append(
                    (entry.op_id, w.workspace_id, w.sub_doc, fingerprint, entry.clock, None, None)
                )
        for r in w.rejections:
            outcomes.append(
                (r.op_id, w.workspace_id, w.sub_doc, r.fingerprint, None, r.code, r.message)
            )
        heads.append((w.workspace_id, w.sub_doc, w.clock))
        if w.payload is not None:
            payloads.append(w.payload)
    committed_at = await conn.fetchval(
        _WRITE_BATCHES,
        *_columns(ops, 5),
        *_columns(outcomes, 7),
        *_columns(heads, 3),
        channel,
        payloads,
    )
    return float(committed_at)


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as `width` column arrays (what `unnest` takes back apart)."""
    return [[row[i] for row in rows] for i in range(width)]


async def write_snapshot(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, doc: CachedSubDoc
) -> None:
    await conn.execute(_UPSERT_SNAPSHOT, workspace_id, sub_doc, doc.clock, doc.state.dumps())


async def read_since(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, since: int, limit: int
) -> tuple[int, list[LogEntry]]:
    """The head clock and at most `limit` entries after `since`, in order."""
    rows = await conn.fetch(_READ_SINCE, workspace_id, sub_doc, since, max(limit, 0))
    if not rows:
        return 0, []
    head = int(rows[0]["head"])
    entries = [
        LogEntry(int(row["clock"]), row["op_id"], json.loads(row["op"]), row["committed_at"])
        for row in rows
        if row["clock"] is not None
    ]
    return head, entries
