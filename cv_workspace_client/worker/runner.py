"""The worker runner (docs/stages.md, docs/queue.md, docs/operating.md): claim stage requests, run
their handlers, report the outcome — at least once, never acknowledged before the work.

```python
async with WorkspaceClient(url, token=token, outbox="worker.outbox.db") as client:
    worker = Worker(client, stages={"evaluate": evaluate, "enrich": Stage(enrich, ttl=300)})
    loop.add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()          # returns after the drain
```

The loop, in order of the rules it keeps:

- **Claim** requests of all its stages' worker classes, as many as it has free slots
  (`concurrency`, default 1), in one call. A slot freed by a stage whose report is about to go
  out is claimed by that report (`claim_next`: the report and the claim in one call, one
  commit), so a busy worker makes one round trip per request. Claimed rows start at once:
  nothing is claimed ahead of a free slot. When there is nothing, wait 100 ms doubling to 2 s,
  woken early by the server's `/v1/queue/pending` push. By default all of this goes over the
  worker channel (`worker.feed`, docs/queue.md "The worker channel"): the worker offers its free
  slots on one websocket and the server hands rows over as they become claimable; HTTP is the
  fallback.
- **Run** each under a heartbeat (every 60 s). A heartbeat answered `lease_lost` marks the
  context (`ensure_lease()` / `apply_op` raise `LeaseLostError`), cancels the handler and
  completes nothing: another worker re-drove the request (River #1302). A heartbeat answered
  `cancelled` (someone cancelled the request) cancels the handler likewise and reports back,
  which ends the request `cancelled`.
- **Report**: success → `complete` with the result, only once the handler returned and its
  writes committed (a result too large for a completion's body is uploaded to the blob store
  first, and completed by its reference; one past the server's `max_result_bytes` completes
  with a `result_too_large` error payload); `ExpectedError`, or a downstream's final refusal
  (one of the stage's own writes refused for good, a provider's 4xx: `worker.outcome`) →
  `complete` with the error payload, after one attempt; any other exception → `fail` (the
  server applies the backoff, then poison at `max_dequeues`). Completions made together travel
  together (one call, one commit).
- **Share**: a stage with a `ttl` answers an identical request from the cache (`cache: "hit"`);
  identical requests running at once inside this worker share one run (single-flight).
- **Drain** on `stop()` (SIGTERM): stop claiming, let in-flight stages finish within 25 s and
  report them; past the deadline cancel them and report nothing — their rows re-drive after the
  lease. Nothing is released early.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cv_workspace_client._core.reconnect import ReconnectPolicy
from cv_workspace_client._io.retry import reconnect_policy_for
from cv_workspace_client._queue import holder as api
from cv_workspace_client._queue.channel import ChannelHost
from cv_workspace_client._queue.transport import config_of
from cv_workspace_client.errors import (
    AuthError,
    ForbiddenError,
    InvalidRequestError,
    WorkspaceError,
)
from cv_workspace_client.logs import log_context
from cv_workspace_client.providers import MeteredProvider, Provider
from cv_workspace_client.stage import (
    ExpectedError,
    Handler,
    LeaseLostError,
    LeaseState,
    RequestCancelledError,
    Stage,
    StageContext,
    StageRequest,
)
from cv_workspace_client.worker.feed import FALL_BACK, ChannelFeed
from cv_workspace_client.worker.io import ClaimAlong, Completer, Heartbeat
from cv_workspace_client.worker.outcome import (
    answer_payload,
    error_payload,
    expected_payload,
    is_final_answer,
)
from cv_workspace_client.worker.parts import RunMeter, SingleFlight, TtlCache, request_key
from cv_workspace_client.worker.report import Reporter
from cv_workspace_client.worker.stats import WorkerStats

if TYPE_CHECKING:
    from cv_workspace_client.client import WorkspaceClient

__all__ = ["TRANSPORT_ENV", "Worker", "WorkerConfig"]

#: The environment variable that picks `WorkerConfig.transport` (docs/configuration.md).
TRANSPORT_ENV = "CV_WORKER_TRANSPORT"

logger = logging.getLogger("cv_workspace_client.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The worker's constants (docs/configuration.md); tests shrink them."""

    #: Idle poll: first wait, doubling up to the ceiling (100 ms → 2 s).
    idle_initial_seconds: float = 0.1
    idle_max_seconds: float = 2.0
    #: Lease renewal while a stage runs (60 s under a 120 s lease).
    heartbeat_seconds: float = 60.0
    #: How long `stop()` lets in-flight stages finish (25 s, under Kubernetes' 30 s).
    drain_seconds: float = 25.0
    #: Stages run at once by this worker.
    concurrency: int = 1
    #: TTL-cache cap (500 entries, oldest first).
    cache_entries: int = 500
    #: A result larger than this (JSON bytes) is uploaded to the blob store first and completed
    #: by its reference (= the server's `blob_threshold_bytes`); smaller ones travel inline, in
    #: batches.
    batch_result_max_bytes: int = 64 * 1024
    #: Monotonic clock of the TTL cache (injectable).
    clock: Callable[[], float] = field(default=time.monotonic)
    #: How the worker claims and reports: over its worker channel (falling back to HTTP when
    #: the server has none), or over HTTP only; None: as `CV_WORKER_TRANSPORT` says when the
    #: worker is made (`http` forces HTTP), else the channel.
    transport: Literal["channel", "http"] | None = None
    #: Failed channel connects in a row after which the worker claims over HTTP instead.
    channel_attempts: int = 3

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not 0 < self.idle_initial_seconds <= self.idle_max_seconds:
            raise ValueError("need 0 < idle_initial_seconds <= idle_max_seconds")
        if self.transport not in (None, "channel", "http"):
            raise ValueError(f"transport must be 'channel' or 'http': {self.transport!r}")
        if self.channel_attempts < 1:
            raise ValueError("channel_attempts must be >= 1")
        if self.heartbeat_seconds <= 0 or self.drain_seconds < 0:
            raise ValueError("heartbeat_seconds must be > 0 and drain_seconds >= 0")


def _transport_from_env() -> Literal["channel", "http"]:
    """The transport of a worker whose config names none: `CV_WORKER_TRANSPORT` (`http`
    forces HTTP), else the channel."""
    return "http" if os.environ.get(TRANSPORT_ENV) == "http" else "channel"


Outcome = tuple[Literal["result", "error"], Any, Literal["hit", "miss"] | None, bool]


class Worker:
    """Runs stage handlers for queued requests. See the module docstring for the rules.

    Args:
        client: an open `WorkspaceClient` (its token decides which workspaces it may claim in).
        stages: stage name → handler (`async def handler(ctx) -> JSON`) or `Stage`.
        worker_class: claim this class for every stage instead of each stage's own class.
        worker_id: shown on claimed rows (`claimed_by`); defaults to host:pid:random.
        provider: the expensive-call provider handed to handlers as `ctx.provider`.
        config: `WorkerConfig`.
    """

    def __init__(
        self,
        client: WorkspaceClient,
        stages: Mapping[str, Handler | Stage],
        worker_class: str | None = None,
        *,
        worker_id: str | None = None,
        provider: Provider | None = None,
        config: WorkerConfig | None = None,
    ) -> None:
        if not stages:
            raise ValueError("a worker needs at least one stage")
        self.client = client
        self.stages: dict[str, Stage] = {
            name: s if isinstance(s, Stage) else Stage(s) for name, s in stages.items()
        }
        self.worker_classes: tuple[str, ...] = (
            (worker_class,)
            if worker_class is not None
            else tuple(dict.fromkeys(s.worker_class or name for name, s in self.stages.items()))
        )
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.provider = provider
        self.config = config or WorkerConfig()
        self.stats = WorkerStats()
        self._cache: TtlCache[str] = TtlCache(self.config.cache_entries, self.config.clock)
        self._flight: SingleFlight[str] = SingleFlight()
        along = _Along(self)
        #: Where the holder verbs go: the channel while one is open (`worker.feed`), else HTTP.
        transport = self.config.transport or _transport_from_env()
        self._channel_host = ChannelHost(client) if transport == "channel" else None
        self._host: api.QueueHost = self._channel_host or client
        self._completer = Completer(self._host, along)
        self._report = Reporter(
            self._host,
            self._completer,
            self.stats,
            batch_result_max_bytes=self.config.batch_result_max_bytes,
            along=along,
        )
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Stages running now (a stage whose outcome awaits the server's ack no longer counts:
        #: the next claim overlaps that ack; at most `concurrency` more await theirs).
        self._running = 0
        #: Slots promised to claims in flight (the claim loop's, or one sent with a report).
        self._reserved = 0
        #: A claim sent with a report found less work than it asked for: the loop waits for a
        #: push before it claims again (the same call would find the same nothing).
        self._came_back_short = False
        #: `time.monotonic()` of the first `stop()`: where the drain deadline starts.
        self._stop_requested_at: float | None = None

    # -- lifetime ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain: stop claiming; `run()` returns once in-flight stages finished (or the drain
        deadline cancelled them). Safe from a signal handler; idempotent."""
        if self._stop_requested_at is None:
            # The drain deadline counts from here, not from when the claim loop noticed: a
            # claim in flight may hold the loop for part of it (see `_claim`).
            self._stop_requested_at = time.monotonic()
        self._stopping.set()
        self._slot_freed.set()  # wakes a claim loop that waits for a free slot

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self) -> WorkerStats:
        """Claim and run stages until `stop()`; then drain. Raises `AuthError`/`ForbiddenError`
        (after draining) if the server refuses the token and the client has no fresh one: its
        `token_provider` (if any) gave none the server took (retrying cannot fix that). A
        token that expires while the worker runs is refreshed by the provider, unnoticed."""
        fatal: WorkspaceError | None = None
        try:
            fatal = await self._claims()
        finally:
            try:
                await self._drain()
            finally:
                await self._close_channel()
        if fatal is not None:
            raise fatal
        return self.stats

    async def _claims(self) -> WorkspaceError | None:
        """Claim over the channel (`worker.feed`), or over HTTP (`_claim_loop`)."""
        if self._channel_host is not None:
            policy = getattr(self.client, "reconnect", None)
            if not isinstance(policy, ReconnectPolicy):
                policy = reconnect_policy_for(config_of(self.client))
            feed = ChannelFeed(self, self._channel_host, policy, self.config.channel_attempts)
            fed = await feed.run()
            if fed != FALL_BACK:
                return fed if isinstance(fed, WorkspaceError) else None
            await self._close_channel()
        return await self._claim_loop()

    async def _close_channel(self) -> None:
        host = self._channel_host
        if host is not None and host.channel is not None:
            channel, host.channel = host.channel, None
            await channel.close()

    def _credit(self) -> int:
        """Slots the server holds for this worker on its channel (promised, like a claim)."""
        host = self._channel_host
        channel = None if host is None else host.open_channel()
        return 0 if channel is None else channel.credit

    async def _claim_loop(self) -> WorkspaceError | None:
        delay = self.config.idle_initial_seconds
        while not self._stopping.is_set():
            free = self._free_slots()
            # Completions about to go out claim the freed slots themselves (`_Along`).
            if free <= 0 or self._completer.holds_unsent:
                self._slot_freed.clear()
                await self._slot_freed.wait()  # a stage ended, a claim settled, or stop()
                await asyncio.sleep(0)  # let every stage finishing in this tick free its slot
                continue
            if self._came_back_short:
                self._came_back_short = False
                pushed = await self._idle_wait(delay)
                delay = (
                    self.config.idle_initial_seconds
                    if pushed
                    else min(delay * 2, self.config.idle_max_seconds)
                )
                continue
            try:
                self._reserved += free
                try:
                    claims = await self._claim(free)
                finally:
                    self._reserved -= free
            except (AuthError, ForbiddenError) as exc:
                logger.error("worker %s: the server refused the token: %s", self.worker_id, exc)
                return exc
            except WorkspaceError as exc:
                if not exc.retryable:
                    # A 4xx answer is final. A claim's body never changes (the same
                    # classes, worker id and limit), so the refusal (a class name or worker id
                    # over the server's limits, say) would repeat forever: the worker logged a
                    # warning every 2 s, ran nothing — not even its valid stages — and looked
                    # alive to its supervisor. Surface it like a refused token.
                    logger.error(
                        "worker %s: the server refused its claims: %s", self.worker_id, exc
                    )
                    return exc
                logger.warning("worker %s: claim failed (%s); retrying", self.worker_id, exc)
                await self._until(asyncio.sleep(delay))
                delay = min(delay * 2, self.config.idle_max_seconds)
                continue
            self._start(claims)
            if claims:
                delay = self.config.idle_initial_seconds
                continue
            pushed = await self._idle_wait(delay)
            delay = (
                self.config.idle_initial_seconds
                if pushed
                else min(delay * 2, self.config.idle_max_seconds)
            )
        return None

    def _free_slots(self) -> int:
        """Slots no stage holds and no claim in flight has promised: stages run at most
        `concurrency` at once, and at most `concurrency` more await their report's answer."""
        concurrency = self.config.concurrency
        promised = self._reserved + self._credit()
        return min(
            concurrency - self._running - promised,
            2 * concurrency - len(self._tasks) - promised,
        )

    def _start(self, claims: list[api.Claim]) -> None:
        """Run each claimed row now (even when stopping: a claimed row is ours to run, and is
        never held unstarted until its lease lapses)."""
        for claimed in claims:
            self.stats.claimed += 1
            slot = _Slot(self)
            task = asyncio.create_task(self._execute(claimed, slot))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._task_done, slot))

    def _drain_left(self) -> float:
        """Seconds left of the drain deadline (its full length before any `stop()`)."""
        if self._stop_requested_at is None:
            return self.config.drain_seconds
        elapsed = time.monotonic() - self._stop_requested_at
        return max(0.0, self.config.drain_seconds - elapsed)

    async def _claim(self, limit: int) -> list[api.Claim]:
        """One claim call; `stop()` bounds it by the drain deadline.

        A claim whose answer never comes (a stalled server or link) otherwise held `stop()` for
        the client's whole request timeout (5 min by default), far past the drain deadline
        (25 s, under the orchestrator's grace period). Its answer is still awaited
        until the deadline — it may lease rows to us, which we then run — and abandoned past
        it: rows it leased are then leased to nobody and re-drive after their lease, exactly
        like a claim whose answer was lost (never a row run twice, nor acknowledged unrun).
        """
        claiming = asyncio.ensure_future(
            api.claim(self.client, self.worker_classes, self.worker_id, limit=limit)
        )
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({claiming, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not claiming.done():
                await asyncio.wait({claiming}, timeout=self._drain_left())
        finally:
            for task in (claiming, stop):
                if not task.done():
                    task.cancel()
            await asyncio.gather(claiming, stop, return_exceptions=True)
        if claiming.cancelled():
            logger.warning(
                "worker %s: claim still unanswered at the drain deadline; abandoned (any row "
                "it leased re-drives after its lease)",
                self.worker_id,
            )
            return []
        return claiming.result()

    def _task_done(self, slot: _Slot, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        slot.release()
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None:
            logger.error("worker %s: stage task crashed", self.worker_id, exc_info=task.exception())

    async def _until(self, waiting: Awaitable[Any]) -> None:
        """Await `waiting`, cut short by `stop()`."""
        work = asyncio.ensure_future(waiting)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, stop):
                if not task.done():
                    task.cancel()
            await asyncio.gather(work, stop, return_exceptions=True)

    async def _idle_wait(self, delay: float) -> bool:
        """Wait up to `delay` for work: a long poll the server answers as soon as work of our
        classes is claimable (at once if some already is, else on a push). True if answered
        with work. A missed push costs at most one poll."""
        outcome: list[bool] = []

        async def poll() -> None:
            try:
                outcome.append(await api.wait_for_work(self.client, self.worker_classes, delay))
            except WorkspaceError as exc:
                logger.debug("worker %s: long poll failed (%s)", self.worker_id, exc)
                await asyncio.sleep(delay)

        await self._until(poll())
        return bool(outcome and outcome[0])

    async def _drain(self) -> None:
        """Finish in-flight work within the deadline; past it cancel (the rows
        re-drive after their lease — nothing is acknowledged that did not happen)."""
        loop = asyncio.get_running_loop()
        # From `stop()` on (a claim in flight may have used part of it), or from now.
        deadline = loop.time() + self._drain_left()
        # A report sent before `stop()` may bring rows its claim took: they start at once and
        # are drained like the others (`tests/worker/test_runner_claim_next.py` pins it), so
        # the drain goes round until no stage is left. No claim is sent once stopping.
        while True:
            await self._finish_stages(deadline)
            # The completions already handed to the completer get what is left of the same
            # deadline: one whose answer never comes (a stalled server or link) otherwise held
            # the drain for the client's whole request timeout and retries. Abandoned, it was
            # either committed (the row is done) or not (the lease lapses and the row
            # re-drives): never a completion of work that did not happen.
            await self._completer.close(max(0.0, deadline - loop.time()))
            if not self._tasks:
                return

    async def _finish_stages(self, deadline: float) -> None:
        """Wait for every stage (those started meanwhile too) until `deadline`; past it cancel
        what still runs (its request re-drives after the lease)."""
        loop = asyncio.get_running_loop()
        while self._tasks:
            _, pending = await asyncio.wait(
                set(self._tasks), timeout=max(0.0, deadline - loop.time())
            )
            if not pending:
                continue
            self.stats.cancelled_at_drain += len(pending)
            logger.warning(
                "worker %s: drain deadline passed; cancelling %d stage(s), their requests "
                "re-drive after the lease",
                self.worker_id,
                len(pending),
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- one request -------------------------------------------------------------------------------

    async def _execute(self, claimed: api.Claim, slot: _Slot) -> None:
        """One run, every log line of it (and every HTTP request it makes) carrying the queue
        request id: a run can be followed from the server's claim to the ops it wrote."""
        row = claimed.request
        with log_context(queue_request_id=row.request_id, stage=row.stage):
            logger.info(
                "run of %s started",
                row.request_id,
                extra={"event": "run_started", "worker": self.worker_id, "run": row.run},
            )
            started = time.perf_counter()
            try:
                await self._execute_run(claimed, slot)
            finally:
                logger.info(
                    "run of %s ended",
                    row.request_id,
                    extra={
                        "event": "run_ended",
                        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                    },
                )

    async def _execute_run(self, claimed: api.Claim, slot: _Slot) -> None:
        row = claimed.request
        stage = self.stages.get(row.stage)
        if stage is None:
            slot.release()
            # A class shared with stages this worker lacks: let a worker that has it retry.
            await self._report.failure(
                claimed, {"code": "unknown_stage", "message": f"no stage {row.stage!r} here"}
            )
            return
        request = StageRequest.from_row(row.raw)
        lease = LeaseState()
        provider = None if self.provider is None else MeteredProvider(self.provider)
        ctx = StageContext(
            request,
            self.client,
            provider=provider,
            worker_id=self.worker_id,
            lease=lease,
            claim_token=claimed.claim_token,
        )
        meter = RunMeter(request).start()
        current = asyncio.current_task()
        assert current is not None
        beat = Heartbeat(self._host, self._heartbeat_every(row), claimed, lease, current)
        failure: Exception | None = None
        try:
            kind, value, cache, shared = await self._produce(stage, ctx)
        except asyncio.CancelledError:
            if lease.lost:  # cancelled by the heartbeat, not by the drain deadline
                current.uncancel()
                self._report.lease_lost(row, "its heartbeat was refused")
                return
            if not lease.cancelled:
                raise
            current.uncancel()  # by the heartbeat, which heard the request was cancelled
        except LeaseLostError:
            self._report.lease_lost(row, "the stage stopped on a lost lease")
            return
        except RequestCancelledError:  # `ensure_lease` / `apply_op` after the heartbeat heard
            pass
        except ExpectedError as exc:
            kind, value, cache, shared = "error", expected_payload(exc), None, False
        except Exception as exc:
            failure = exc
        finally:
            beat.stop()
            slot.release()  # the stage is over; its report may overlap the next claim
        if lease.lost:  # the handler swallowed the cancellation: still report nothing
            self._report.lease_lost(row, "its heartbeat was refused")
            return
        if lease.cancelled:  # whatever the handler did once told to stop: it was cancelled
            await self._report.cancelled(claimed)
            return
        if failure is not None:
            answer = answer_payload(failure, ctx.refused_write(failure))
            if answer is None:
                logger.warning("stage %s failed on %s: %r", row.stage, row.request_id, failure)
                await self._report.failure(claimed, error_payload(failure))
                return
            # A final refusal: the same run would meet it again (docs/stages.md), so it is the
            # request's answer, not a failure to retry toward poison.
            logger.info("stage %s on %s answered %s", row.stage, row.request_id, answer["code"])
            kind, value, cache, shared = "error", answer, None, False
        if shared:
            self.stats.shared_runs += 1
        extra: dict[str, Any] = {"shared": True} if shared else {}
        if provider is not None:
            extra.update(provider_calls=provider.calls, provider_s=round(provider.seconds, 6))
        telemetry = meter.finish(**extra)
        try:
            reported = await self._report.success(claimed, kind, value, cache, telemetry)
            if reported is None:
                # It reported a failure instead (a result with no JSON form): nothing completed,
                # and nothing to cache — a cached non-answer would replay the same failure on
                # every retry without running the handler again.
                return
            kind = reported
        except LeaseLostError:
            self._report.lease_lost(row, "its completion was refused")
            return
        except InvalidRequestError as exc:
            # A final 4xx to the completion itself: sending it again cannot succeed, and
            # leaving it unacknowledged would park the request in progress for a whole lease
            # per attempt, then re-run it to poison. The refusal is the answer: complete with it.
            await self._report.refused_completion(claimed, exc)
            return
        except WorkspaceError as exc:
            # Not acknowledged: the lease lapses and the row re-drives; the stage's writes
            # dedupe under their derived op_ids, so the re-run is harmless.
            logger.warning("could not complete %s: %s", row.request_id, exc)
            return
        logger.info(
            "request %s done (%s)",
            row.request_id,
            "expected error" if kind == "error" else "result",
            extra={"event": "run_done", "cache": cache},
        )
        if kind == "error":
            self.stats.expected_errors += 1
            return
        self.stats.completed += 1
        if stage.ttl is not None and cache != "hit":
            key = request_key(request)
            if key is not None:  # Run, complete, then store under the TTL
                self._cache.put(key, value, stage.ttl)

    def _heartbeat_every(self, row: api.QueuedRequest) -> float:
        """Seconds between heartbeats: the configured interval, but at most half the lease the
        server granted this claim. The lease is the server's setting (`lease_seconds`, which an
        operator may shrink with `--set`); a worker beating every 60 s under a 30 s lease would
        lose every long stage to a second worker while it still runs (60 s under 120 s).
        """
        every = self.config.heartbeat_seconds
        if row.lease_expires_at is not None and row.claimed_at is not None:
            granted = row.lease_expires_at - row.claimed_at
            if granted > 0:
                every = min(every, granted / 2)
        return every

    async def _produce(self, stage: Stage, ctx: StageContext) -> Outcome:
        """Run the handler (or answer from the cache / a shared run); return once its writes
        committed."""
        key = request_key(ctx.request)
        if stage.ttl is not None and key is not None:
            hit, value = self._cache.get(key)
            if hit:
                self.stats.cache_hits += 1
                return "result", value, "hit", False
        cache: Literal["miss"] | None = "miss" if stage.ttl is not None else None

        async def run_handler() -> Any:
            try:
                value = await stage.handler(ctx)
            except ExpectedError:
                # An expected error completes the request (done, final, never retried): an
                # acknowledgement like a result, so it too waits for the run's writes, and a
                # write left unsettled fails the run instead (raised from here) — otherwise a
                # handler that wrote, then answered with an error, was acknowledged before
                # its write committed, and nothing would ever re-drive it.
                await ctx.writes_settled()
                raise
            except Exception as exc:
                if is_final_answer(exc):  # completes the request too: the same rule
                    await ctx.writes_settled()
                raise
            await ctx.writes_settled()
            return value

        if key is None:
            return "result", await run_handler(), cache, False
        value, shared = await self._flight.run(key, run_handler)
        return "result", value, cache, shared


class _Along(ClaimAlong):
    """The worker's next claim, sent with a report when the worker would claim anyway: the
    slots no stage holds nor any claim in flight has promised, none once stopping."""

    __slots__ = ("_worker",)

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def ask(self) -> api.ClaimNext | None:
        worker = self._worker
        free = worker._free_slots()
        if worker.stopping or free <= 0:
            return None
        worker._reserved += free
        return api.ClaimNext(worker.worker_classes, worker.worker_id, limit=free)

    def settle(self, ask: api.ClaimNext, claimed: list[api.Claim]) -> None:
        worker = self._worker
        worker._reserved -= ask.limit
        worker._start(claimed)
        if len(claimed) < ask.limit:
            worker._came_back_short = True
        worker._slot_freed.set()


class _Slot:
    """One claimed request's share of `concurrency`, given back once when its stage ends."""

    __slots__ = ("_released", "_worker")

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._released = False
        worker._running += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._worker._running -= 1
            self._worker._slot_freed.set()
