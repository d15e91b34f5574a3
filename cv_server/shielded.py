"""The shell both queue backends write through (`cv_server/sqlite/queue.py`,
`cv_server/pg/queue.py`): a transaction that, once started, commits and is announced whatever
happens to its caller. Kept out of `cv_server/queue/`, whose modules import no asyncio
(the pure-cores contract, tests/test_architecture.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E")

__all__ = ["commit_then_announce"]


async def commit_then_announce(
    write: Awaitable[tuple[T, Sequence[E]]], announce: Callable[[Sequence[E]], None]
) -> T:
    """Await `write` (a backend's transaction, answering its result and the events it made
    true) shielded from our caller's cancellation, and once it committed `announce` its events,
    even if the caller was cancelled meanwhile: the write happens regardless, so its waiters
    must hear of it. Pinned by the queue contract suite (tests/contract/queue_contract.py)."""
    task = asyncio.ensure_future(write)

    def done(finished: asyncio.Future[tuple[T, Sequence[E]]]) -> None:
        if finished.cancelled() or finished.exception() is not None:
            return  # nothing committed, nothing to announce
        announce(finished.result()[1])

    task.add_done_callback(done)
    result, _events = await asyncio.shield(task)
    return result
