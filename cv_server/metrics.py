"""The server's Prometheus metrics (`GET /metrics`), on one registry per application.

Per application, not the library's global default registry: a process may run several apps (the
tests run many; an embedding program may run two), and each must count only its own traffic.

Two kinds of figure (docs/observability.md lists every family):
- counters and histograms of what this process did (commits it made, requests it answered, queue
  transitions it committed): with N instances on one PostgreSQL database, each exports its own,
  and the deployment's total is their sum;
- gauges read at scrape time: `cv_queue_requests{status}` from the shared queue table (the same
  figure on every instance), the others from this process's memory (sockets, subscriptions).

Adding a counter is one line: `metrics.counter("cv_thing_total", "What it counts.")` returns a
`prometheus_client.Counter` on this app's registry (labels: `labelnames=("code",)`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from cv_server.oplog import Outcome, Rejected

__all__ = ["CONTENT_TYPE", "Metrics", "ScrapeHook"]

log = logging.getLogger(__name__)

#: The Prometheus text exposition format 0.0.4, which every scraper reads (Prometheus 2 and 3,
#: VictoriaMetrics, the OpenTelemetry collector). Every name here is a classic metric name, so
#: the text `generate_latest` writes is the same in that format and in 1.0.0.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

#: An async reader run before each scrape (the queue gauges read the store this way).
ScrapeHook = Callable[[], Awaitable[None]]

# Bucket bounds. prometheus_client's defaults (5 ms .. 10 s) suit request latencies; a group
# commit is often well under a millisecond on SQLite, and a stage or a provider call may run for
# minutes, so those get bounds of their own.
_FAST_SECONDS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
_SLOW_SECONDS: Final = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_OPS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class Metrics:
    """Every family the server exports, on its own `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._scrape_hooks: list[ScrapeHook] = []
        counter, histogram = self.counter, self.histogram
        # -- op-log
        self.ops_committed = counter("cv_ops_committed_total", "Ops committed to the op-log.")
        self.ops_duplicate = counter(
            "cv_ops_duplicate_total",
            "Ops answered from their recorded outcome (a retry of an op already decided).",
        )
        self.ops_rejected = counter(
            "cv_ops_rejected_total", "Ops rejected, by problem code.", labelnames=("code",)
        )
        self.commit_seconds = histogram(
            "cv_commit_seconds", "Duration of one op-log group commit.", buckets=_FAST_SECONDS
        )
        self.commit_batch_ops = histogram(
            "cv_commit_batch_ops", "Ops in one op-log group commit.", buckets=_BATCH_OPS
        )
        self.storage_writes_refused = counter(
            "cv_storage_writes_refused_total",
            "Writes refused for storage (disk full, read-only, I/O error): each answered 503"
            " storage_unavailable (docs/operating.md, Storage faults).",
        )
        # -- storage over time (docs/operating.md, cv_server/compaction.py)
        self.oplog_rows = Gauge(
            "cv_oplog_rows",
            "Op rows in the log as of the last compaction pass (SQLite: counted; PostgreSQL: the"
            " planner's estimate).",
            registry=self.registry,
        )
        #: When the oldest op still in the log committed (epoch seconds; None: empty log).
        self.oldest_op_committed_at: float | None = None
        self.gauge(
            "cv_oplog_oldest_op_age_seconds",
            "Age of the oldest op still in the log (the oldest horizon), as of the last"
            " compaction pass; 0 when the log is empty.",
            lambda: (
                0.0
                if self.oldest_op_committed_at is None
                else max(0.0, time.time() - self.oldest_op_committed_at)
            ),
        )
        self.compaction_deleted = counter(
            "cv_compaction_deleted_total",
            "Rows deleted by op-log compaction, by kind (ops, rejections).",
            labelnames=("kind",),
        )
        self.compaction_seconds = histogram(
            "cv_compaction_pass_seconds",
            "Duration of one compaction pass (every batch of it).",
            buckets=_SLOW_SECONDS,
        )
        # -- subscribers
        self.broadcast_lag = histogram(
            "cv_broadcast_lag_seconds",
            "From a commit to its op frame written to a live subscriber's socket.",
            buckets=_FAST_SECONDS,
        )
        self.ws_too_slow = counter(
            "cv_ws_closed_too_slow_total", "Websockets closed (4008) for falling too far behind."
        )
        self.rate_limited = counter(
            "cv_rate_limited_total",
            "Requests refused 429 rate_limited, by route class.",
            labelnames=("route_class",),
        )
        self.subscriptions_refused = counter(
            "cv_subscriptions_refused_total",
            "Subscribes refused because the socket already held its cap of subscriptions.",
        )
        # -- HTTP
        self.http_requests = counter(
            "cv_http_requests_total",
            "HTTP requests answered, by route template and status (websocket sessions: 101).",
            labelnames=("route", "status"),
        )
        self.http_seconds = histogram(
            "cv_http_request_seconds",
            "Time to answer an HTTP request, by route template (a websocket: its whole session).",
            labelnames=("route",),
        )
        # Children by label values, looked up once: `labels(...)` takes a lock and builds a
        # key on every call, which each request and each op paid. Bounded: route templates,
        # statuses and problem codes are finite sets.
        self._answered: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._rejected: dict[str, Any] = {}
        # -- work queue
        self.queue_requests = Gauge(
            "cv_queue_requests",
            "Queue requests by status, read from the (shared) queue table at scrape time.",
            labelnames=("status",),
            registry=self.registry,
        )
        self.queue_enqueued = counter(
            "cv_queue_enqueued_total", "Enqueues that created (or re-opened) a request."
        )
        self.queue_coalesced = counter(
            "cv_queue_coalesced_total", "Enqueues absorbed by an existing request of the same id."
        )
        self.queue_claimed = counter("cv_queue_claimed_total", "Requests handed to a worker.")
        self.channel_frames = counter(
            "cv_channel_frames_total",
            "Frames on worker channels, by direction (in, out) and type.",
            labelnames=("direction", "type"),
        )
        self.channel_claimed = counter(
            "cv_channel_claimed_total", "Requests handed to a worker over its channel."
        )
        self.queue_done = counter("cv_queue_done_total", "Requests completed (done).")
        self.queue_failed = counter(
            "cv_queue_failed_total", "Failures reported by workers (retried or poisoned)."
        )
        self.queue_lease_lapses = counter(
            "cv_queue_lease_lapses_total",
            "Leases that lapsed (the worker died or stalled), found by a later claim.",
        )
        self.queue_poisoned = counter(
            "cv_queue_poisoned_total", "Requests parked as poison (dequeue budget spent)."
        )
        self.queue_cancelled = counter(
            "cv_queue_cancelled_total", "Requests cancelled (at once, or when their holder let go)."
        )
        self.queue_replayed = counter(
            "cv_queue_replayed_total", "Poison requests put back in the queue by an operator."
        )
        self.queue_discarded = counter(
            "cv_queue_discarded_total", "Poison requests deleted by an operator (discard)."
        )
        self.queue_wait = histogram(
            "cv_queue_wait_seconds",
            "From a request becoming claimable (enqueue, retry, replay) to its claim.",
            buckets=_SLOW_SECONDS,
        )
        self.stage_seconds = histogram(
            "cv_stage_seconds",
            "From a claim to the request done, by stage.",
            labelnames=("stage",),
            buckets=_SLOW_SECONDS,
        )
        # -- schedules (`cv_server.schedules.firing`)
        self.schedule_firings = counter(
            "cv_schedule_firings_total",
            "Requests schedules enqueued (a due time another instance had fired not counted).",
        )
        self.schedule_skips = counter(
            "cv_schedule_skips_total",
            "Due times a schedule enqueued nothing for, by reason (overlap, missed).",
            labelnames=("reason",),
        )
        self.schedule_lateness = histogram(
            "cv_schedule_lateness_seconds",
            "From a schedule's due time to the enqueue of its request.",
            buckets=_SLOW_SECONDS,
        )
        # -- compute locks
        self.lock_acquired = counter("cv_lock_acquired_total", "Compute locks acquired.")
        self.lock_contended = counter(
            "cv_lock_contended_total", "Compute-lock acquisitions answered `locked`."
        )
        self.lock_expired = counter(
            "cv_lock_expired_total",
            "Compute-lock releases refused: the lock had expired and was no longer the holder's.",
        )
        # -- storage over time (the background pass, `cv_server.reaper`)
        self.reaped_rows = counter(
            "cv_reaped_rows_total",
            "Rows the background pass deleted, by kind (idempotency_keys, blobs, requests,"
            " compute_locks).",
            labelnames=("kind",),
        )
        self.reap_pass_rows = Gauge(
            "cv_reap_pass_rows",
            "Rows the last background pass of this process deleted, by kind.",
            labelnames=("kind",),
            registry=self.registry,
        )
        self.reap_pass_seconds = histogram(
            "cv_reap_pass_seconds", "Duration of one background pass.", buckets=_SLOW_SECONDS
        )
        # -- worker telemetry (sent with `complete`)
        self.provider_calls = counter(
            "cv_provider_calls_total",
            "Provider calls (LLM, maps) workers reported making, by stage.",
            labelnames=("stage",),
        )
        self.provider_seconds = histogram(
            "cv_provider_seconds",
            "Time workers reported spending in provider calls, per completed run.",
            buckets=_SLOW_SECONDS,
        )

    # -- making families --------------------------------------------------------------------------

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """A counter on this app's registry (`name` ends in `_total`, as exported)."""
        return Counter(name, documentation, labelnames=labelnames, registry=self.registry)

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        return Histogram(
            name, documentation, labelnames=labelnames, buckets=buckets, registry=self.registry
        )

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> Gauge:
        """A gauge whose value is `read()` at scrape time (a figure kept in memory)."""
        gauge = Gauge(name, documentation, registry=self.registry)
        gauge.set_function(read)
        return gauge

    def on_scrape(self, hook: ScrapeHook) -> None:
        """Run `hook` before each scrape: for figures that need I/O to read (the store's)."""
        self._scrape_hooks.append(hook)

    async def render(self) -> bytes:
        """The exposition text. A failed scrape hook leaves its gauges as last read (and logs):
        a database blip must not take the whole scrape, counters included, down with it."""
        for hook in self._scrape_hooks:
            try:
                await hook()
            except Exception:
                log.warning("a /metrics reader failed; its gauges keep their last value")
        return generate_latest(self.registry)

    # -- recording --------------------------------------------------------------------------------

    def record_outcomes(self, outcomes: Iterable[Outcome]) -> None:
        """Count the answers of one commit: duplicates (answered from the record) apart."""
        for outcome in outcomes:
            if outcome.duplicate:
                self.ops_duplicate.inc()
            elif isinstance(outcome, Rejected):
                child = self._rejected.get(outcome.code)
                if child is None:
                    child = self._rejected[outcome.code] = self.ops_rejected.labels(outcome.code)
                child.inc()
            else:
                self.ops_committed.inc()

    def record_request(self, route: str, status: int, seconds: float) -> None:
        """One HTTP request answered (a websocket session: 101), by its route template."""
        children = self._answered.get((route, status))
        if children is None:
            children = self._answered[route, status] = (
                self.http_requests.labels(route, str(status)),
                self.http_seconds.labels(route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def record_group_commit(self, seconds: float, ops: int) -> None:
        self.commit_seconds.observe(seconds)
        self.commit_batch_ops.observe(ops)

    def record_written(self, stamp: float) -> None:
        """An op frame stamped at commit (`time.perf_counter()`) was written to a socket."""
        self.broadcast_lag.observe(max(0.0, time.perf_counter() - stamp))

    def count_too_slow(self) -> None:
        self.ws_too_slow.inc()

    def count_rate_limited(self, route_class: str) -> None:
        self.rate_limited.labels(route_class).inc()

    def count_subscription_refused(self) -> None:
        self.subscriptions_refused.inc()

    def set_queue_counts(self, counts: Mapping[Any, int], statuses: Iterable[str]) -> None:
        """Every status in `statuses` is exported, 0 when absent from `counts`."""
        for status in {*statuses, *counts}:
            self.queue_requests.labels(status).set(counts.get(status, 0))

    def record_reap(self, deleted: Mapping[str, int], seconds: float) -> None:
        """One background pass: rows deleted per kind, and its duration."""
        for kind, rows in deleted.items():
            self.reaped_rows.labels(kind).inc(rows)
            self.reap_pass_rows.labels(kind).set(rows)
        self.reap_pass_seconds.observe(seconds)

    def record_telemetry(self, stage: str, telemetry: Any) -> None:
        """Export what a worker reported with `complete`. Fire-and-forget: telemetry of any
        shape is accepted by the route, and whatever is not a usable figure is ignored here."""
        if not isinstance(telemetry, dict):
            return
        calls = telemetry.get("provider_calls")
        if isinstance(calls, int) and not isinstance(calls, bool) and calls > 0:
            self.provider_calls.labels(stage).inc(calls)
        seconds = telemetry.get("provider_s")
        if (
            isinstance(seconds, int | float)
            and not isinstance(seconds, bool)
            and math.isfinite(seconds)
            and seconds >= 0
        ):
            self.provider_seconds.observe(seconds)
