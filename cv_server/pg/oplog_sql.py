"""The SQL of the PostgreSQL op-log, and the reads that rebuild or catch up a cached sub-doc.

Tables come from `migrations/001_oplog.sql`. Every statement names its tables unqualified, so
they resolve on the connection's `search_path` (see `pool.PostgresSettings.schema`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

from cv_mutations import OpRejected, SubDocState, apply_op, parse_op
from cv_server.oplog.pipeline import (
    NewRejection,
    Recorded,
    RecordedCommit,
    RecordedRejection,
)
from cv_server.oplog.store import LogEntry

__all__ = [
    "HEADS_TABLE",
    "OPS_TABLE",
    "OUTCOMES_TABLE",
    "SNAPSHOTS_TABLE",
    "CachedSubDoc",
    "OpLogCorrupted",
    "catch_up",
    "load_sub_doc",
    "lock_head",
    "look_up",
    "read_head",
    "read_since",
    "write_batch",
    "write_snapshot",
]

HEADS_TABLE: Final = "workspace_sub_doc_heads"
OPS_TABLE: Final = "workspace_sub_doc_ops"
OUTCOMES_TABLE: Final = "workspace_sub_doc_op_outcomes"
SNAPSHOTS_TABLE: Final = "workspace_sub_doc_snapshots"

_LOCK_HEAD: Final = (
    f"SELECT clock FROM {HEADS_TABLE} WHERE workspace_id = $1 AND sub_doc = $2 FOR UPDATE"
)
_CREATE_HEAD: Final = (
    f"INSERT INTO {HEADS_TABLE} (workspace_id, sub_doc) VALUES ($1, $2)"
    " ON CONFLICT (workspace_id, sub_doc) DO NOTHING"
)
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
SELECT h.clock AS head, o.clock, o.op_id, o.op
FROM {HEADS_TABLE} h
LEFT JOIN LATERAL (
    SELECT clock, op_id, op::text AS op FROM {OPS_TABLE}
    WHERE workspace_id = h.workspace_id AND sub_doc = h.sub_doc AND clock > $3
    ORDER BY clock LIMIT $4
) o ON true
WHERE h.workspace_id = $1 AND h.sub_doc = $2
ORDER BY o.clock
"""
_LOOK_UP: Final = f"""
SELECT op_id, clock, fingerprint, code, message FROM {OUTCOMES_TABLE}
WHERE op_id = ANY($3::text[]) AND workspace_id = $1 AND sub_doc = $2
"""
# Rows, outcomes, the head and the notification in one round trip. Data-modifying CTEs run
# whether or not the outer query reads them; pg_notify fires at COMMIT (never on rollback).
_WRITE_BATCH: Final = f"""
WITH new_ops AS (
    INSERT INTO {OPS_TABLE} (workspace_id, sub_doc, clock, op_id, op)
    SELECT $1, $2, t.clock, t.op_id, t.op::json
    FROM unnest($3::bigint[], $4::text[], $5::text[]) AS t(clock, op_id, op)
), new_outcomes AS (
    INSERT INTO {OUTCOMES_TABLE} (op_id, workspace_id, sub_doc, fingerprint, clock, code, message)
    SELECT t.op_id, $1, $2, t.fingerprint, t.clock, t.code, t.message
    FROM unnest($6::text[], $7::text[], $8::bigint[], $9::text[], $10::text[])
        AS t(op_id, fingerprint, clock, code, message)
), new_head AS (
    UPDATE {HEADS_TABLE} SET clock = $11
    WHERE workspace_id = $1 AND sub_doc = $2 AND clock < $11
)
SELECT pg_notify($12, $13) WHERE $13::text IS NOT NULL
"""
_UPSERT_SNAPSHOT: Final = f"""
INSERT INTO {SNAPSHOTS_TABLE} (workspace_id, sub_doc, clock, state)
VALUES ($1, $2, $3, $4::text::json)
ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET clock = excluded.clock, state = excluded.state
WHERE {SNAPSHOTS_TABLE}.clock < excluded.clock
"""


class OpLogCorrupted(RuntimeError):
    """The stored log cannot be replayed (a gap, or an op its own history rejects)."""

    code = "internal"


@dataclass(slots=True)
class CachedSubDoc:
    """One instance's copy of a sub-doc: the state after every op up to `clock`."""

    clock: int
    state: SubDocState


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def lock_head(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> int:
    """Take the sub-doc's row lock (held until the transaction ends); return its head clock.

    Every writer of the sub-doc, on every instance, queues here: clocks are allocated under this
    lock, so there is nothing to retry (issue 7: no optimistic retry storms).
    """
    clock = await conn.fetchval(_LOCK_HEAD, workspace_id, sub_doc)
    if clock is None:
        await conn.execute(_CREATE_HEAD, workspace_id, sub_doc)
        clock = await conn.fetchval(_LOCK_HEAD, workspace_id, sub_doc)
    return int(clock)


async def read_head(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> int:
    clock = await conn.fetchval(_SELECT_HEAD, workspace_id, sub_doc)
    return 0 if clock is None else int(clock)


def _replay(doc: CachedSubDoc, rows: Sequence[Any], key: tuple[str, str]) -> None:
    for row in rows:
        clock = int(row["clock"])
        if clock != doc.clock + 1:
            raise OpLogCorrupted(f"{key}: log jumps from clock {doc.clock} to {clock}")
        try:
            apply_op(doc.state, parse_op(json.loads(row["op"])))
        except OpRejected as exc:
            raise OpLogCorrupted(f"{key}: logged op at clock {clock} replays as {exc}") from exc
        doc.clock = clock


async def load_sub_doc(conn: asyncpg.Connection, workspace_id: str, sub_doc: str) -> CachedSubDoc:
    """Rebuild a sub-doc from its latest snapshot plus the log after it."""
    key = (workspace_id, sub_doc)
    row = await conn.fetchrow(_SELECT_SNAPSHOT, workspace_id, sub_doc)
    if row is None:
        doc = CachedSubDoc(0, SubDocState.empty())
    else:
        doc = CachedSubDoc(int(row["clock"]), SubDocState.loads(row["state"]))
    _replay(doc, await conn.fetch(_SELECT_OPS_AFTER, workspace_id, sub_doc, doc.clock), key)
    return doc


async def catch_up(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, doc: CachedSubDoc
) -> None:
    """Apply the log entries after `doc.clock` (committed by other instances) to `doc`."""
    rows = await conn.fetch(_SELECT_OPS_AFTER, workspace_id, sub_doc, doc.clock)
    _replay(doc, rows, (workspace_id, sub_doc))


async def look_up(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, op_ids: list[str]
) -> dict[str, Recorded]:
    """What the log holds for `op_ids`: committed clocks and recorded rejections."""
    recorded: dict[str, Recorded] = {}
    for row in await conn.fetch(_LOOK_UP, workspace_id, sub_doc, op_ids):
        if row["clock"] is not None:
            recorded[row["op_id"]] = RecordedCommit(int(row["clock"]), row["fingerprint"])
        else:
            recorded[row["op_id"]] = RecordedRejection(
                row["code"], row["message"], row["fingerprint"]
            )
    return recorded


async def write_batch(
    conn: asyncpg.Connection,
    workspace_id: str,
    sub_doc: str,
    entries: Sequence[LogEntry],
    fingerprints: Sequence[str],
    rejections: Sequence[NewRejection],
    clock: int,
    channel: str,
    payload: str | None,
) -> None:
    """Insert `entries` (`fingerprints[i]` is that of `entries[i]`), the outcomes of their op_ids
    and the `rejections`, move the head to `clock`, and NOTIFY `payload` (if any) on `channel`
    when the transaction commits."""
    committed = [
        (entry, fingerprint)
        for entry, fingerprint in zip(entries, fingerprints, strict=True)
        if entry.op_id is not None
    ]
    await conn.execute(
        _WRITE_BATCH,
        workspace_id,
        sub_doc,
        [entry.clock for entry in entries],
        [entry.op_id for entry in entries],
        [_dumps(entry.op) for entry in entries],
        [entry.op_id for entry, _ in committed] + [r.op_id for r in rejections],
        [fingerprint for _, fingerprint in committed] + [r.fingerprint for r in rejections],
        [entry.clock for entry, _ in committed] + [None] * len(rejections),
        [None] * len(committed) + [r.code for r in rejections],
        [None] * len(committed) + [r.message for r in rejections],
        clock,
        channel,
        payload,
    )


async def write_snapshot(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, doc: CachedSubDoc
) -> None:
    await conn.execute(_UPSERT_SNAPSHOT, workspace_id, sub_doc, doc.clock, doc.state.dumps())


async def read_since(
    conn: asyncpg.Connection, workspace_id: str, sub_doc: str, since: int, limit: int
) -> tuple[int, list[tuple[int, str | None, dict[str, Any]]]]:
    """The head clock and at most `limit` (clock, op_id, op) after `since`, in order."""
    rows = await conn.fetch(_READ_SINCE, workspace_id, sub_doc, since, max(limit, 0))
    if not rows:
        return 0, []
    head = int(rows[0]["head"])
    entries = [
        (int(row["clock"]), row["op_id"], json.loads(row["op"]))
        for row in rows
        if row["clock"] is not None
    ]
    return head, entries
