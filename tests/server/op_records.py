"""Compaction of op_id records, for tests on both backends (docs/ops.md#exactly-once): the
server's own compaction verbs, run once the ops they record are older than a dedupe window the
test shrinks."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from cv_server.oplog import OpLogStore

#: The server's dedupe window (`oplog_retention_seconds`) and allowed skew, shrunk so a test's
#: ops outlive them: the server answers a resend without record by its `minted_at` against them.
RETENTION_SECONDS: Final = 1.5
SKEW_SECONDS: Final = 0.5


async def outlive_the_window(minted_before: float) -> None:
    """Wait until ops minted before `minted_before` (unix seconds) are older than the window
    less the skew: the age at which their records may be compacted. A wait on the wall clock
    the server judges `minted_at` by, not for a race."""
    await asyncio.sleep(max(0.0, minted_before + RETENTION_SECONDS - SKEW_SECONDS - time.time()))


async def compact_past(store: OpLogStore, workspace_id: str, sub_doc: str, clock: int) -> None:
    """Run the server's compaction (`compact`, then `expire_rejections`) with every op counted
    as old, and check that it took the sub-doc's log, and the op_id records with it, past
    `clock`: only the lane marks and `minted_at` are then left to tell a resend from a new op.

    Compaction keeps the op at the latest snapshot, so the tests snapshot every op
    (`SNAPSHOT_EVERY`) and write one op after those whose records must go.
    """
    everything = time.time() + 1.0
    resume: tuple[str, str] | None = None
    while True:
        batch = await store.compact(everything, limit=1000, start=resume)
        resume = batch.resume
        if resume is None:
            break
    while await store.expire_rejections(everything, limit=1000):
        pass
    assert await store.horizon(workspace_id, sub_doc) > clock


#: Ops between two snapshots in these tests' servers: compaction deletes only below the latest.
SNAPSHOT_EVERY: Final = 1
