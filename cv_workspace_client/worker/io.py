"""The worker's two I/O helpers: the heartbeat timer of a running stage, and the completer that
sends completions made together in one call (docs/queue.md; `cv_workspace_client.worker` runs them).
A batch may carry the worker's next claim (`ClaimAlong`): one call, one commit for both.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from cv_workspace_client._queue import holder as api
from cv_workspace_client._queue.channel import ChannelHost
from cv_workspace_client.errors import (
    InvalidRequestError,
    LeaseLostError,
    RequestCancelledError,
    WorkspaceError,
)
from cv_workspace_client.stage import LeaseState

__all__ = ["ClaimAlong", "Completer", "Heartbeat"]

logger = logging.getLogger("cv_workspace_client.worker")


class Heartbeat:
    """Renews a running stage's lease every `heartbeat_seconds` (a timer, not a task per stage:
    most stages end before the first beat). A beat answered `lease_lost` marks the lease and
    cancels the stage (River #1302: it must stop writing and complete nothing); one answered
    `cancelled` (someone cancelled the request) marks it cancelled and cancels the stage too,
    which the worker then reports back."""

    def __init__(
        self,
        client: api.QueueHost,
        every: float,
        claimed: api.Claim,
        lease: LeaseState,
        stage_task: asyncio.Task[None],
    ) -> None:
        self._client = client
        self._every = every
        self._claimed = claimed
        self._lease = lease
        self._stage_task = stage_task
        self._loop = asyncio.get_running_loop()
        self._beating: asyncio.Task[None] | None = None
        self._stopped = False
        self._timer: asyncio.TimerHandle | None = self._schedule()

    def _schedule(self) -> asyncio.TimerHandle:
        return self._loop.call_later(self._every, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if not self._stopped:
            self._beating = self._loop.create_task(self._beat())

    async def _beat(self) -> None:
        row = self._claimed.request
        # A beat has half the interval to be answered (beats run at most every half lease, so
        # a second beat still lands inside the lease). One sent on a connection that went
        # silent (a NAT that forgot the flow) otherwise waited out the client's request
        # timeout (300 s), the lease lapsed meanwhile and a second worker ran the request
        # while this one still did. The abandoned request's connection is closed, so the
        # next beat, at once, goes out on a fresh one.
        bound = self._every / 2
        while not self._stopped:
            try:
                async with asyncio.timeout(bound):
                    await api.heartbeat(
                        self._client, row.workspace_id, row.request_id, self._claimed.claim_token
                    )
            except TimeoutError:
                if isinstance(self._client, ChannelHost):  # the channel went silent: give it up
                    self._client.drop_channel()
                logger.warning(
                    "heartbeat of %s unanswered after %.1f s; sending another",
                    row.request_id,
                    bound,
                )
                continue
            except LeaseLostError:
                if not self._stopped:
                    self._lease.lost = True
                    self._stage_task.cancel()
                return
            except RequestCancelledError:
                if not self._stopped:
                    self._lease.cancelled = True
                    self._stage_task.cancel()
                return
            except WorkspaceError as exc:
                logger.warning("heartbeat of %s failed (%s); trying again", row.request_id, exc)
            break
        if not self._stopped:
            self._timer = self._schedule()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        if self._beating is not None and not self._beating.done():
            self._beating.cancel()


class ClaimAlong(Protocol):
    """The worker's side of a claim sent with a report (docs/queue.md, "report and claim")."""

    def ask(self) -> api.ClaimNext | None:
        """The claim to send with a report now, its slots reserved (None: none wanted). Every
        ask is given back to `settle`, exactly once, whatever became of the report."""

    def settle(self, ask: api.ClaimNext, claimed: list[api.Claim]) -> None:
        """The rows the ask claimed (none if its call failed); its reservation ends."""


class Completer:
    """Completions made together travel together: whatever is queued while one batch is in
    flight goes in the next call (`POST /v1/queue/complete`, one commit for all), with the
    worker's next claim if it wants one (`along`)."""

    #: The server's per-call cap.
    MAX_BATCH = 1000

    def __init__(self, client: api.QueueHost, along: ClaimAlong | None = None) -> None:
        self._client = client
        self._along = along
        #: (completion, its request's workspace, the future of its outcome)
        self._queued: list[tuple[dict[str, Any], str, asyncio.Future[api.CompletionOutcome]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def complete(self, workspace_id: str, item: dict[str, Any]) -> None:
        """Complete one request; raises `LeaseLostError` if the server refused it."""
        future: asyncio.Future[api.CompletionOutcome] = asyncio.get_running_loop().create_future()
        # Mark an error as seen even when the stage awaiting it was cancelled meanwhile.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queued.append((item, workspace_id, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        # shield: a cancelled stage must not tear a batch other stages share.
        outcome = await asyncio.shield(future)
        if outcome.error is not None:
            raise outcome.error

    @property
    def holds_unsent(self) -> bool:
        """Completions queued and not yet sent: the next call goes out soon, and carries the
        worker's claim if it wants one (so the worker need not claim on its own)."""
        return bool(self._queued)

    async def _send(self) -> None:
        await asyncio.sleep(0)  # gather everything completed in this tick
        while self._queued:
            batch = self._queued[: self.MAX_BATCH]
            del self._queued[: self.MAX_BATCH]
            ask = None if self._along is None else self._along.ask()
            claimed: list[api.Claim] = []
            try:
                items = [item for item, _, _ in batch]
                if ask is None:
                    outcomes = await api.complete_many(self._client, items)
                else:
                    reported = await api.complete_many(self._client, items, claim_next=ask)
                    outcomes, claimed = reported.outcomes, reported.claimed
            except InvalidRequestError:
                # The batch route refused the batch as a whole (a result over a smaller server
                # threshold, say): complete one by one, so one item cannot sink the others.
                # A refused batch wrote nothing, its claim neither.
                outcomes = [await self._complete_alone(ws, item) for item, ws, _ in batch]
            except WorkspaceError as exc:
                self._settle(ask, [])
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            except BaseException as exc:
                # Abandoned (the drain deadline): rows its claim leased, if it committed, are
                # leased to nobody and re-drive after the lease, as a claim whose answer was lost.
                self._settle(ask, [])
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(
                            WorkspaceError("completion_aborted", f"{type(exc).__name__}")
                        )
                raise
            # The claimed rows start before the stages that reported hear back: a stage's task
            # ends on its answer, and a drain waiting on the tasks must see the new ones.
            self._settle(ask, claimed)
            for (_, _, future), outcome in zip(batch, outcomes, strict=True):
                if not future.done():
                    future.set_result(outcome)

    def _settle(self, ask: api.ClaimNext | None, claimed: list[api.Claim]) -> None:
        if ask is not None and self._along is not None:
            self._along.settle(ask, claimed)

    async def _complete_alone(
        self, workspace_id: str, item: dict[str, Any]
    ) -> api.CompletionOutcome:
        request_id = item["request_id"]
        try:
            status = await api.complete(
                self._client,
                workspace_id,
                request_id,
                item["claim_token"],
                result=item.get("result"),
                error=item.get("error"),
                blob_ref=item.get("blob_ref"),
                cache=item.get("cache"),
                telemetry=item.get("telemetry"),
            )
        except WorkspaceError as exc:
            return api.CompletionOutcome(request_id, error=exc)
        return api.CompletionOutcome(request_id, status=status)

    async def close(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Let the batch in flight (and what is queued behind it) go out, for at most `timeout`
        seconds (None: no bound); past it, abandon it: its stages hear `completion_aborted`."""
        sender = self._sender
        if sender is None or sender.done():
            return
        await asyncio.wait({sender}, timeout=timeout)
        if not sender.done():
            sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        for _, _, future in self._queued:  # never sent: nobody may wait on them forever
            if not future.done():
                future.set_exception(WorkspaceError("completion_aborted", "the worker stopped"))
        self._queued.clear()
