"""The backend-neutral seam of a server's storage: the bundle of stores every backend returns,
and the one error both translate a database they cannot serve into.

`cv_server/sqlite/stores.py` and `cv_server/pg/stores.py` open a `Stores` on their engine;
`cv_server/backends.py` picks one from the configuration. Nothing here imports a driver.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeAlias, TypeVar

from cv_server.errors import CvServerError
from cv_server.locks.store import ComputeLockStore
from cv_server.oplog import OpLogStore
from cv_server.queue import BlobStore, IdempotencyStore, QueueStore
from cv_server.revocations import RevocationStore
from cv_server.schedules.store import ScheduleStore
from cv_server.storage_faults import StorageFaults, StorageUnavailable

__all__ = [
    "DatabaseUnusable",
    "FollowCommits",
    "FollowRevocations",
    "FollowSecret",
    "Stores",
    "give_space_back",
    "translating",
]

P = ParamSpec("P")
R = TypeVar("R")


class DatabaseUnusable(CvServerError):
    """The database cannot be served by this process (in use by another server, written by a
    newer cv-server, unreadable, or refused by PostgreSQL). The message says why and what to do;
    `cv-server` prints it in one line and exits. Each backend translates its driver's errors at
    opening into this (or a subclass of it), so no caller imports a driver to report them."""


def translating(
    driver_error: type[Exception], into: Callable[[str], Exception]
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """A decorator for an adapter's opening verbs: `driver_error` raised by the verb comes out as
    `into(message)` (the driver's message kept, the driver's error chained), so callers never
    import a driver to report it (tests/server/test_cli_token.py,
    tests/acceptance/test_lifecycle_edges.py: each refusal is one line)."""

    def decorate(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(fn)
        async def translated(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return await fn(*args, **kwargs)
            except driver_error as exc:
                raise into(str(exc) or type(exc).__name__) from exc

        return translated

    return decorate


#: `await follow(on_head, on_reconnect)`: from now on, call `on_head(workspace_id, sub_doc,
#: clock)` when any instance commits to a sub-doc, and `on_reconnect()` when such news may have
#: been lost (subscribers then catch up from the log). Only backends shared by several
#: instances have one.
FollowCommits: TypeAlias = Callable[
    [Callable[[str, str, int], None], Callable[[], None]], Awaitable[None]
]

#: `await follow(on_secret)`: from now on, call `on_secret(secret)` with the token secret stored
#: in the database whenever it may have been replaced (`cv-server rotate-secret`), the value
#: read at start included if it changed since. Only backends shared by several instances have
#: one: an embedded server's file is not rotated while it is served.
FollowSecret: TypeAlias = Callable[[Callable[[bytes], None]], Awaitable[None]]

#: `await follow(on_revoked)`: from now on, call `on_revoked()` whenever another instance may
#: have revoked a token (PostgreSQL: NOTIFY; also after the LISTEN connection came back), so
#: that revocations are read at once rather than at the next poll.
FollowRevocations: TypeAlias = Callable[[Callable[[], None]], Awaitable[None]]


def _translated_already(exc: BaseException) -> StorageUnavailable | None:
    return exc if isinstance(exc, StorageUnavailable) else None


@dataclass
class Stores:
    """Every store of one server, on one backend."""

    oplog: OpLogStore
    queue: QueueStore
    idempotency: IdempotencyStore
    blobs: BlobStore
    locks: ComputeLockStore
    revocations: RevocationStore
    schedules: ScheduleStore
    secret: bytes
    follow_commits: FollowCommits | None = None
    follow_secret: FollowSecret | None = None
    follow_revocations: FollowRevocations | None = None
    #: Writes refused for storage, and whether the last one was (docs/operating.md, "Storage
    #: faults"): read by `/readyz` and `cv_storage_writes_refused_total`.
    faults: StorageFaults = field(default_factory=StorageFaults)
    #: `exc` as the `StorageUnavailable` it means (recorded in `faults`), or None: a backend
    #: whose stores raise the driver's errors (PostgreSQL) translates them here, once, for
    #: every route; one that translates in its engine (SQLite) keeps the default.
    storage_fault: Callable[[BaseException], StorageUnavailable | None] = _translated_already
    #: One small write that succeeds only if the storage takes writes: `/readyz` runs it while
    #: `faults.fault` is set, and clears it when it succeeds (writes resume by themselves).
    probe_write: Callable[[], Awaitable[None]] | None = None
    #: `await reclaim_space(max_pages)`: give at most that many freed pages back to the file
    #: system and return how many (SQLite's incremental vacuum, after a background pass deleted
    #: rows: `give_space_back`).
    #: None where the database does it itself (PostgreSQL: autovacuum, docs/operating.md).
    reclaim_space: Callable[[int], Awaitable[int]] | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()


async def give_space_back(stores: Stores, step: int) -> int:
    """Give every freed page back to the file system, `step` pages per write job (the writer is
    free between steps); return how many. 0 where the backend has no `reclaim_space`.

    Call after a background pass deleted rows: compaction (`cv_server.compaction`) and the
    reaper (`cv_server.reaper`) both do, so the SQLite file shrinks whichever of them freed the
    pages (tests/server/test_sqlite_space.py)."""
    if stores.reclaim_space is None:
        return 0
    pages = 0
    while True:
        freed = await stores.reclaim_space(step)
        pages += freed
        if freed < step:
            return pages
