"""Keeping a server's set of revoked tokens current (docs/operating.md, "Revoking a token"):
the thin asyncio shell around `RevokedTokens` (cv_server/revocations.py).

One task reads the entries past the last one seen at start, every `revocation_poll_seconds`,
and at once when woken (PostgreSQL: a NOTIFY from whichever instance or `cv-server token revoke`
revoked; this server's own revoke route). Watchers of `RevokedTokens` (open sockets) hear of each
new id as it is read. Pinned by tests/server/test_token_revocation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from cv_server.revocations import RevocationStore, RevokedTokens

__all__ = ["RevocationFollower"]

log = logging.getLogger(__name__)


class RevocationFollower:
    """Reads `store` into `revoked`: call `refresh` once before serving, then `start`."""

    def __init__(
        self,
        store: RevocationStore,
        revoked: RevokedTokens,
        *,
        poll_seconds: float,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._revoked = revoked
        self._poll_seconds = poll_seconds
        self._now = now
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def refresh(self) -> list[str]:
        """Read the entries stored since the last read; returns the ids new here."""
        async with self._lock:  # one read at a time: `last_seq` only moves forward
            new = self._revoked.add(await self._store.revoked_since(self._revoked.last_seq))
            self._revoked.forget_expired(self._now())
        return new

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="token-revocations")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_seconds)
            self._wake.clear()  # before the read: a wake during it reads once more
            try:
                await self.refresh()
            except Exception as exc:  # the database away: read again at the next poll
                log.warning("reading token revocations failed: %r", exc)
