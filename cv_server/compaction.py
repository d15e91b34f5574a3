"""Op-log compaction: the background pass that bounds the log (docs/operating.md, "Storage over
time").

A pass deletes, in batches of at most `compact_batch_rows` rows per transaction, every op older
than `oplog_retention_seconds` below its sub-doc's latest snapshot (`OpLogStore.compact`) and
every recorded rejection older than that (`OpLogStore.expire_rejections`), then gives the freed
space back where the backend can (`give_space_back`: SQLite's incremental vacuum) and reads
the log's size for `/metrics`. Retention 0 runs no pass. Several servers on one PostgreSQL
database may run passes at once: the store verbs make that safe and cheap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cv_server.config import ServerConfig
from cv_server.metrics import Metrics
from cv_server.stores import Stores, give_space_back

__all__ = ["PassReport", "compact_forever", "compact_once"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass did: rows deleted, pages given back to the file system, batches run."""

    ops: int
    rejections: int
    pages: int
    batches: int


async def compact_once(
    stores: Stores,
    config: ServerConfig,
    metrics: Metrics | None = None,
    *,
    now: Callable[[], float] = time.time,
) -> PassReport:
    """Run one whole pass now (a no-op answering zeros when retention is 0).

    Each batch is its own short transaction; between batches the event loop and the store's
    other callers run. Raises what the store raises (the caller retries at the next pass: rows
    already deleted stay deleted, and the pass resumes from the first sub-doc)."""
    if config.oplog_retention_seconds == 0:
        return PassReport(0, 0, 0, 0)
    began = time.perf_counter()
    older_than = now() - config.oplog_retention_seconds
    limit = config.compact_batch_rows
    oplog = stores.oplog
    ops = rejections = pages = batches = 0
    start: tuple[str, str] | None = None
    while True:
        batch = await oplog.compact(older_than, limit=limit, start=start)
        ops += batch.deleted
        batches += 1
        if batch.resume is None:
            break
        start = batch.resume
    while True:
        deleted = await oplog.expire_rejections(older_than, limit=limit)
        rejections += deleted
        batches += 1
        if deleted < limit:
            break
    if ops or rejections:
        pages = await give_space_back(stores, limit)
    if metrics is not None:
        stats = await oplog.stats()
        metrics.oplog_rows.set(stats.op_rows)
        metrics.oldest_op_committed_at = stats.oldest_committed_at
        metrics.compaction_deleted.labels("ops").inc(ops)
        metrics.compaction_deleted.labels("rejections").inc(rejections)
        metrics.compaction_seconds.observe(time.perf_counter() - began)
    report = PassReport(ops, rejections, pages, batches)
    if ops or rejections:
        log.info(
            "compacted the op-log: %d ops, %d rejections, %d pages given back, %d batches",
            ops,
            rejections,
            pages,
            batches,
            extra={"step": "compaction"},
        )
    return report


async def compact_forever(stores: Stores, config: ServerConfig, metrics: Metrics) -> None:
    """A pass every `compact_seconds` (the first one that long after start-up), until
    cancelled. A failed pass is logged and retried at the next one: it never stops the server."""
    if config.oplog_retention_seconds == 0:
        return
    while True:
        await asyncio.sleep(config.compact_seconds)
        try:
            await compact_once(stores, config, metrics)
        except Exception:
            log.exception("compacting the op-log failed; retried in %s s", config.compact_seconds)
