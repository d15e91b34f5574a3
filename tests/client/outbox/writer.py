"""A client process for the SIGKILL test: replays its outbox, then submits `node.increment` ops
forever, WINDOW at a time, printing `committed <op_id>` (flushed) for each answer it gets, until it
is killed.

Usage: python -m tests.client.outbox.writer URL TOKEN OUTBOX SUB_DOC WINDOW websocket|http
"""

from __future__ import annotations

import asyncio
import sys

from cv_mutations import NodeIncrement
from cv_workspace_client import StillPendingError, WorkspaceClient

from ..helpers import WS, fast_config


async def main(url: str, token: str, outbox: str, sub_doc: str, window: int, mode: str) -> None:
    config = fast_config(ops_over_websocket=mode == "websocket")
    async with WorkspaceClient(url, token=token, outbox=outbox, config=config) as client:
        print(f"started {client.pending_count()}", flush=True)
        slots = asyncio.Semaphore(window)
        running: set[asyncio.Task[None]] = set()

        async def one() -> None:
            try:
                commit = await client.apply_op(WS, sub_doc, NodeIncrement(node_id="n", field="c"))
                print(f"committed {commit.op_id}", flush=True)
            except StillPendingError:
                pass  # stays in the outbox; replayed ahead of the next op
            finally:
                slots.release()

        while True:
            await slots.acquire()
            task = asyncio.create_task(one())
            running.add(task)
            task.add_done_callback(running.discard)


if __name__ == "__main__":
    url, token, outbox, sub_doc, window, mode = sys.argv[1:7]
    asyncio.run(main(url, token, outbox, sub_doc, int(window), mode))
