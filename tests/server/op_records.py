"""What compaction does to op_id records, for tests on both backends (docs/ops.md#exactly-once):
drop them, once the ops they record are older than a dedupe window the test shrinks."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from typing import Final

from cv_server import ServerConfig
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


async def drop_op_id_records(store: OpLogStore, config: ServerConfig) -> None:
    """Forget every op_id's outcome, as compaction will for ops past the retention: the lane
    marks and `minted_at` are all that is left to tell a resend from a new op."""
    pool = getattr(store, "pool", None)
    if pool is not None:
        await pool.execute("DELETE FROM workspace_sub_doc_op_outcomes")
        return
    db_path = config.db_path
    assert db_path is not None

    def drop() -> None:
        with contextlib.closing(sqlite3.connect(db_path, timeout=10)) as conn, conn:
            conn.execute("UPDATE workspace_sub_doc_ops SET op_id = NULL")
            conn.execute("DELETE FROM workspace_sub_doc_op_rejections")

    await asyncio.to_thread(drop)
