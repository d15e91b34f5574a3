"""The worker's claims over its channel (docs/queue.md, "The worker channel"): keep one channel
open, offer the server every free slot, and start the rows it hands over. The HTTP claim loop
(`Worker._claim_loop`) takes over when the server has no channel (404 on the handshake) or the
channel cannot be opened `channel_attempts` times in a row.

A slot is offered once: a report about to go out carries the slots it frees (its `free`, claimed
in its commit), and the rest are offered alone (`free` frames). The worker counts what the
server holds for it (`WorkerChannel.credit`) as slots promised, like a claim in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Final, Literal, Protocol

from cv_workspace_client._core.reconnect import ReconnectPolicy, Streak
from cv_workspace_client._queue.channel import (
    ChannelHost,
    ChannelUnsupportedError,
    WorkerChannel,
)
from cv_workspace_client.errors import AuthError, ForbiddenError, WorkspaceError
from cv_workspace_client.queue_models import Claim
from cv_workspace_client.worker.io import Completer

__all__ = ["FALL_BACK", "ChannelFeed", "FedWorker"]

logger = logging.getLogger("cv_workspace_client.worker")

#: What `ChannelFeed.run` answers when the worker should claim over HTTP instead.
FALL_BACK: Final = "http"


class FedWorker(Protocol):
    """What the feed needs of the worker (`Worker`): its slots, its starts, its stop."""

    worker_classes: tuple[str, ...]
    worker_id: str
    _completer: Completer
    _slot_freed: asyncio.Event

    @property
    def stopping(self) -> bool: ...

    def _free_slots(self) -> int: ...

    def _start(self, claims: list[Claim]) -> None: ...

    def _drain_left(self) -> float: ...

    async def _until(self, waiting: Awaitable[Any]) -> None: ...


class ChannelFeed:
    """Feeds `worker` from its channel on `host` until it stops; after `attempts` failed
    connects in a row it gives up (`FALL_BACK`)."""

    def __init__(
        self, worker: FedWorker, host: ChannelHost, policy: ReconnectPolicy, attempts: int
    ) -> None:
        self._worker = worker
        self._host = host
        self._policy = policy
        self._attempts = attempts
        #: Seconds to wait before the next offer (an offer refused as rate limited).
        self._pause = 0.0

    async def run(self) -> WorkspaceError | Literal["http"] | None:
        """Serve channels until `stop()` (None), a refused token or hello (the error, as the
        claim loop returns it), or `FALL_BACK`."""
        worker = self._worker
        streak = Streak()
        failed = 0
        while not worker.stopping:
            try:
                channel = await WorkerChannel.connect(
                    self._host,
                    worker.worker_classes,
                    worker.worker_id,
                    on_claimed=self._claimed,
                    on_refused_offer=self._refused_offer,
                    on_closed=self._worker._slot_freed.set,
                )
            except ChannelUnsupportedError:
                logger.info("worker %s: the server has no worker channel; HTTP", worker.worker_id)
                return FALL_BACK
            except (AuthError, ForbiddenError) as exc:
                logger.error("worker %s: the server refused the token: %s", worker.worker_id, exc)
                return exc
            except WorkspaceError as exc:
                if not exc.retryable:
                    logger.error("worker %s: the channel refused: %s", worker.worker_id, exc)
                    return exc
                failed += 1
                if failed >= self._attempts:
                    logger.warning(
                        "worker %s: the channel failed %d times (%s); claiming over HTTP",
                        worker.worker_id,
                        failed,
                        exc,
                    )
                    return FALL_BACK
                streak = self._policy.refused(streak)
                await worker._until(asyncio.sleep(self._policy.delay(streak)))
                continue
            failed = 0
            self._host.channel = channel
            await self._serve(channel)
            if worker.stopping:
                await self._drain(channel)
                return None
            logger.warning("worker %s: the channel dropped; reconnecting", worker.worker_id)
            streak = self._policy.ended(
                streak, delivered=True, close_code=None, broke_protocol=False
            )
            await worker._until(asyncio.sleep(self._policy.delay(streak)))
        return None

    async def _serve(self, channel: WorkerChannel) -> None:
        worker = self._worker
        while not worker.stopping and channel.open:
            if self._pause > 0:
                pause, self._pause = self._pause, 0.0
                await worker._until(asyncio.sleep(pause))
                continue
            free = worker._free_slots()
            if free > 0 and not worker._completer.holds_unsent:
                channel.offer(free)
                continue
            # Set when a stage ends, rows arrive, the channel closes, or on `stop()`: one event,
            # no task per wait (this loop wakes once per request).
            worker._slot_freed.clear()
            await worker._slot_freed.wait()
            await asyncio.sleep(0)  # let every stage finishing in this tick free its slot

    async def _drain(self, channel: WorkerChannel) -> None:
        """Ask for no more rows, and take those already on their way (they run: a claimed row is
        never held unstarted), within the drain deadline."""
        try:
            async with asyncio.timeout(self._worker._drain_left()):
                await channel.drain()
        except (TimeoutError, WorkspaceError) as exc:
            logger.warning("worker %s: channel drain unanswered (%r)", self._worker.worker_id, exc)

    def _claimed(self, rows: list[Claim]) -> None:
        self._worker._start(rows)
        self._worker._slot_freed.set()

    def _refused_offer(self, retry_after: float) -> None:
        self._pause = max(self._pause, retry_after)
        self._worker._slot_freed.set()
