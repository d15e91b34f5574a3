"""A chaos writer process: `python -m tests.chaos.writer URL TOKEN INDEX OUTBOX ws|http UNTIL
ACKS RATE`.

It applies its plan (`tests.chaos.plan`) at `RATE` ops per second through a durable file outbox
until the wall clock passes `UNTIL` (epoch seconds), then waits until every op it intended is
answered and exits 0. Each acknowledged op_id is appended to `ACKS` as soon as its answer
arrives (the harness counts those as acknowledged: none may be missing from the log). A writer
started on an outbox a killed predecessor left replays that outbox first, then resumes its plan
after the highest op of its own the log holds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any, Final

from cv_workspace_client import (
    ClientConfig,
    Committed,
    OpRejectedError,
    StillPendingError,
    WorkspaceClient,
    WorkspaceError,
)
from tests.chaos.plan import DOCS, WS, op_for, parse_op_id

__all__ = ["CHAOS_RETRY", "read_log", "settle"]

#: Short retries with many attempts: a chaos run waits out cuts and restarts within seconds,
#: not a production backoff of minutes.
CHAOS_RETRY: Final = ClientConfig(
    retry_base_seconds=0.05, retry_cap_seconds=0.5, retry_attempts=40, request_timeout_seconds=10
)
#: Ops kept in flight at once (pipelined; one sub-doc's ops still apply in order).
WINDOW: Final = 8


async def settle(client: WorkspaceClient, deadline: float) -> None:
    """Until every op submitted so far is answered: ops that used up their tries stay in the
    outbox and get a fresh cycle, never a new op_id."""
    while not client.synced:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.pending_count()} ops still pending")
        try:
            await client.wait_synced(timeout=2)
        except TimeoutError:
            client.retry_pending()


async def read_log(client: WorkspaceClient, doc: str, workspace: str = WS) -> list[Committed]:
    """The whole committed log of `doc`, page by page, up to the head the last page names."""
    entries: list[Committed] = []
    while True:
        head, page = await client.read_ops(
            workspace, doc, since=entries[-1].clock if entries else 0
        )
        entries += page
        if not page or entries[-1].clock >= head:
            return entries


async def _retrying(what: Any, deadline: float) -> Any:
    """A read through the faults: the SDK retries it with `CHAOS_RETRY`; one that used those
    tries up (a restart longer than them) is tried again, until `deadline`."""
    while True:
        try:
            return await what()
        except WorkspaceError as exc:
            if not exc.retryable or time.monotonic() > deadline:
                raise


async def run_writer(
    url: str, token: str, index: int, outbox: Path, transport: str, until: float, acks: Path,
    rate: float,
) -> int:  # fmt: skip
    # Bounded: the run's own deadline plus room to settle what is pending through restarts.
    deadline = time.monotonic() + max(0.0, until - time.time()) + 120
    config = ClientConfig(
        retry_base_seconds=CHAOS_RETRY.retry_base_seconds,
        retry_cap_seconds=CHAOS_RETRY.retry_cap_seconds,
        retry_attempts=CHAOS_RETRY.retry_attempts,
        request_timeout_seconds=CHAOS_RETRY.request_timeout_seconds,
        ops_over_websocket=transport == "ws",
    )
    rejected: list[str] = []
    with acks.open("a", buffering=1) as ack_file:
        async with WorkspaceClient(url, token=token, outbox=outbox, config=config) as client:
            restored = client.pending_count()
            await settle(client, deadline)
            done = [
                key[1]
                for doc in DOCS
                for entry in await _retrying(lambda d=doc: read_log(client, d), deadline)
                if (key := parse_op_id(entry.op_id)) is not None and key[0] == index
            ]
            k = max(done, default=-1) + 1
            print(f"writer {index} resumes at {k} (restored {restored})", flush=True)
            window = asyncio.Semaphore(WINDOW)

            async def one(doc: str, op: dict[str, Any]) -> None:
                try:
                    commit = await client.apply_op(WS, doc, op)
                    ack_file.write(commit.op_id + "\n")
                except StillPendingError:
                    pass  # it stays in the outbox under its op_id; settle() sees it through
                except OpRejectedError as exc:
                    rejected.append(f"{op['op_id']}: {exc.code}")
                finally:
                    window.release()

            tasks: set[asyncio.Task[None]] = set()
            gap = 1 / rate
            next_at = time.monotonic()
            while time.time() < until:
                await window.acquire()
                doc, op = op_for(index, k)
                task = asyncio.create_task(one(doc, op))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
                next_at += gap
                # Paced, not synchronised: the rate is the load, the faults do the rest.
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*tasks)
            await settle(client, deadline)
            pending = client.pending_count()
    print(f"writer {index} done at {k} pending={pending} rejected={rejected}", flush=True)
    return 0 if pending == 0 and not rejected else 3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.writer")
    parser.add_argument("url")
    parser.add_argument("token")
    parser.add_argument("index", type=int)
    parser.add_argument("outbox", type=Path)
    parser.add_argument("transport", choices=["ws", "http"])
    parser.add_argument("until", type=float, help="stop intending new ops at this epoch second")
    parser.add_argument("acks", type=Path)
    parser.add_argument("rate", type=float, help="ops per second")
    a = parser.parse_args(argv)
    return asyncio.run(
        run_writer(a.url, a.token, a.index, a.outbox, a.transport, a.until, a.acks, a.rate)
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
