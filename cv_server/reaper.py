"""The background pass that keeps the queue's storage bounded (docs/operating.md, "Queue rows").

Each pass deletes, in batches of `ServerConfig.reap_batch_size` rows (one short transaction
each), what has outlived its retention:

- `idempotency_keys`: keys past `idempotency_retention_seconds`;
- `blobs`: result blobs past `blob_retention_seconds`, and those of the requests purged below;
- `requests`: `done` and `cancelled` rows `request_retention_seconds` after they finished (0:
  never); `poison` rows stay until an operator replays or discards them;
- `compute_locks`: locks dead past their TTL that nobody acquired again;
- `token_revocations`: revocations of tokens that have expired since (docs/operating.md,
  "Revoking a token"): such a token is refused as expired anyway.

A pass that deleted anything then gives the freed pages back to the file system where the
backend can (`give_space_back`: SQLite's incremental vacuum), as compaction does, so the file
shrinks after a large purge even with the op-log kept whole (tests/server/test_sqlite_space.py).

A pass takes one batch of each kind in turn, dropping a kind once a batch of it comes back
short, until every kind is caught up or `PASS_BUDGET_SECONDS` ran out; a pass still behind is
followed by the next at once, so a steady workload is caught up with, not outpaced
(tests/server/test_reaper.py). The loop is the one piece with I/O; which kinds to delete and
when to stop is `reap_once`'s, with the clock injectable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Final

from cv_server.config import ServerConfig
from cv_server.metrics import Metrics
from cv_server.stores import Stores, give_space_back

__all__ = [
    "KINDS",
    "PASS_BUDGET_SECONDS",
    "PassReport",
    "reap_forever",
    "reap_once",
    "reap_pass",
]

log = logging.getLogger(__name__)

#: What a pass deletes, as the `kind` label of its metrics.
KINDS: Final = ("idempotency_keys", "blobs", "requests", "compute_locks", "token_revocations")
#: A pass stops taking batches after this long (the next one then starts at once): its metrics
#: are published and the server's shutdown is never held up by a long backlog.
PASS_BUDGET_SECONDS: Final = 60.0

#: One batch of a kind: deletes at most `limit` rows; returns how many per kind (the first
#: kind named is the one whose short batch says the kind is caught up).
Batch = Callable[[int], Awaitable[dict[str, int]]]


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass deleted, per kind, how long it took, whether it caught up, and how many
    freed pages it gave back to the file system (`reap_pass`; 0 from `reap_once`)."""

    deleted: dict[str, int]
    seconds: float
    caught_up: bool
    pages: int = 0


def batches(stores: Stores, config: ServerConfig) -> dict[str, Batch]:
    """One batch verb per kind, each reading its store's clock (the database's on PostgreSQL),
    so that several instances judge retention alike."""

    async def keys(limit: int) -> dict[str, int]:
        return {"idempotency_keys": await stores.idempotency.sweep(time.time(), limit=limit)}

    async def blobs(limit: int) -> dict[str, int]:
        return {"blobs": await stores.blobs.sweep(time.time(), limit=limit)}

    async def requests(limit: int) -> dict[str, int]:
        before = await stores.queue.clock() - config.request_retention_seconds
        purged = await stores.queue.purge_finished(before, limit=limit)
        return {"requests": purged.requests, "blobs": purged.blobs}

    async def locks(limit: int) -> dict[str, int]:
        return {"compute_locks": await stores.locks.sweep(await stores.locks.clock(), limit=limit)}

    async def revocations(limit: int) -> dict[str, int]:
        return {"token_revocations": await stores.revocations.sweep(time.time(), limit=limit)}

    kinds: dict[str, Batch] = {"idempotency_keys": keys, "blobs": blobs}
    if config.request_retention_seconds > 0:
        kinds["requests"] = requests
    kinds["compute_locks"] = locks
    kinds["token_revocations"] = revocations
    return kinds


async def reap_once(
    kinds: dict[str, Batch],
    batch_size: int,
    *,
    budget: float = PASS_BUDGET_SECONDS,
    monotonic: Callable[[], float] = time.monotonic,
) -> PassReport:
    """One pass: a batch of each kind in turn until each came back short or `budget` seconds
    passed. A failed batch drops its kind for this pass (logged) and spares the others."""
    started = monotonic()
    deleted = dict.fromkeys(KINDS, 0)
    behind = dict(kinds)
    while behind and monotonic() - started < budget:
        for kind, batch in list(behind.items()):
            try:
                counts = await batch(batch_size)
            except Exception:  # retried next pass; a failure must never stop the server
                log.exception("reaping %s failed", kind)
                del behind[kind]
                continue
            for name, n in counts.items():
                deleted[name] += n
            if counts[kind] < batch_size:
                del behind[kind]
    return PassReport(deleted, monotonic() - started, caught_up=not behind)


async def reap_pass(stores: Stores, config: ServerConfig, kinds: dict[str, Batch]) -> PassReport:
    """One pass of the server's reaper over `kinds` (`batches(stores, config)`): `reap_once`,
    then, if it deleted anything, the freed pages given back (`give_space_back`)."""
    report = await reap_once(kinds, config.reap_batch_size)
    if not any(report.deleted.values()):
        return report
    return replace(report, pages=await give_space_back(stores, config.reap_batch_size))


async def reap_forever(stores: Stores, config: ServerConfig, metrics: Metrics) -> None:
    """Run a pass every `config.reap_seconds`, at once again while a pass is behind."""
    kinds = batches(stores, config)
    while True:
        await asyncio.sleep(config.reap_seconds)
        report = await reap_pass(stores, config, kinds)
        metrics.record_reap(report.deleted, report.seconds)
        while not report.caught_up:
            log.info("reaping is behind after %.0f s: next pass at once", report.seconds)
            report = await reap_pass(stores, config, kinds)
            metrics.record_reap(report.deleted, report.seconds)
