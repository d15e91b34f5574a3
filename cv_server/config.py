"""Server configuration. Every constant is in docs/configuration.md and can be overridden."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

__all__ = ["ServerConfig"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `create_app` needs. Tests shrink the durations; nothing else should."""

    #: Embedded SQLite file (the default backend).
    db_path: Path | None = None
    #: PostgreSQL DSN (the scale-out backend); wins over `db_path` when set. Not in the repr:
    #: it may carry a password.
    database_url: str | None = field(default=None, repr=False)
    #: HMAC secret for bearer tokens; read from (or created in) the database when None. Not in
    #: the repr: whoever holds it mints tokens for every workspace.
    token_secret: bytes | None = field(default=None, repr=False)
    #: Prefix of every problem document's `type`; the problem's code is appended. The default,
    #: `about:blank`, is the `type` itself (the code is in `code`); a deployment that publishes
    #: the docs points it at them, docs/problems.md having one anchor per code.
    problem_type_base: str = "about:blank"

    # -- request limits (docs/limits.md) --
    max_body_bytes: int = 1024 * 1024
    max_ops_per_request: int = 1000
    max_ws_frame_bytes: int = 1024 * 1024
    #: Subscriptions one socket may hold at once; a subscribe past it is refused with an
    #: `error` frame `too_many_subscriptions` naming its sub-doc. An app follows a handful of
    #: sub-docs per socket; each subscription holds server memory and a task.
    max_subscriptions_per_socket: int = 1000
    #: Live ops a subscriber may have queued before it is closed (4008) to resume by catch-up.
    subscriber_queue_limit: int = 10_000
    #: The server pings a websocket peer after this long without hearing from it and closes the
    #: connection if no pong comes within half of it (aiohttp's heartbeat): a peer gone without
    #: a goodbye (power lost, a NAT that forgot the flow) otherwise keeps its connection, its
    #: subscriptions and their queues until the OS gives up on the TCP connection, hours later.
    #: The default heartbeat (60 s). None switches it off.
    socket_heartbeat_seconds: float | None = 60.0
    #: Page size of catch-up reads.
    catchup_page: int = 1000
    #: Ops between two state snapshots (a cache of the log; bounds the rebuild after a restart).
    snapshot_every: int = 1000
    #: Sub-doc states kept in memory, least recently used evicted first (a memory bound: an
    #: evicted sub-doc is rebuilt from its snapshot plus at most `snapshot_every` log entries).
    subdoc_cache_limit: int = 10_000

    # -- storage over time and exactly-once (docs/configuration.md, docs/operating.md,
    # docs/ops.md#exactly-once) --
    #: Ops older than this (and below their sub-doc's latest snapshot) are deleted with their
    #: op_id records, and recorded rejections older than this too; 0 keeps everything. It is the
    #: one dedupe window of an op that carries only `op_id` (its record goes with its log row or
    #: rejection record); an SDK op stays provable forever through its lane mark (`client_id` /
    #: `seq`: one row per client and sub-doc). Seven days because the SDK's outbox keeps an unsent
    #: op seven days: an op any outbox may still resend keeps its op_id record at least that long.
    oplog_retention_seconds: float = 7 * 24 * 3600.0
    #: A compaction pass starts this often. Its own cadence, not the hourly reaper's: a pass
    #: deletes what became old since the last one, and ten minutes' worth of a busy log is a
    #: short pass, where an hour's backlog would be six times longer.
    compact_seconds: float = 600.0
    #: Rows one compaction transaction deletes at most: each batch holds the SQLite writer (or a
    #: PostgreSQL transaction) for milliseconds, so appends never queue behind a long delete.
    compact_batch_rows: int = 1000
    #: How far a client's clock may be off the server's when an op's `minted_at` is judged: an op
    #: without a lane is `op_expired` once minted more than `oplog_retention_seconds` minus this
    #: ago with no record, and a `minted_at` more than this in the future is refused
    #: (`invalid_field`). Five minutes: clocks set by NTP are within a second; a device's clock
    #: left to drift gains minutes a month, and one further off is wrong, not skewed.
    minted_at_skew_seconds: float = 300.0

    # -- queue (docs/configuration.md, docs/queue.md) --
    #: A claim's lease. The heartbeat that renews it is the worker's (`WorkerConfig`, 60 s),
    #: which beats at least twice per lease the server grants (a shorter lease set here is
    #: honoured by every worker without their configs changing).
    lease_seconds: float = 120.0
    failure_backoff_seconds: float = 30.0
    max_dequeues: int = 5
    waiter_deadline_seconds: float = 60.0
    #: Request waiters re-read their rows this often; on PostgreSQL the LISTEN connection must
    #: also answer a trivial query this often (a silently dead one is replaced). Also the
    #: `Retry-After` of `503 storage_unavailable` (docs/operating.md, "Storage faults"): the
    #: server's own re-check cadence, since a full disk or a read-only file is fixed by an
    #: operator, not within a second, and 5 s keeps every client's retries from hammering it.
    sweep_seconds: float = 5.0
    blob_retention_seconds: float = 24 * 3600.0
    #: `done` and `cancelled` request rows (and the result blobs they name) are deleted this
    #: long after they finished; 0 keeps them forever. `poison` rows stay until an operator
    #: replays or discards them. Seven days, the SDK outbox's retention, not the 24 h of blobs
    #: and idempotency keys: a row is small (a large result lives in a blob, which still goes
    #: after 24 h) and it is what a client that comes back reads to learn how its request
    #: ended, so it lasts as long as the client's own record of what it sent. It is also the
    #: coalescing window of a deterministic re-enqueue (docs/queue.md): after it, the same
    #: enqueue runs the stage again, and the compute lock's pre-flight check is what keeps the
    #: expensive call from repeating (docs/stages.md).
    request_retention_seconds: float = 7 * 24 * 3600.0
    #: Expired blobs, idempotency keys, request rows past their retention and dead compute
    #: locks are reaped this often (hourly). A pass deletes in batches until one comes back
    #: short; one that is still behind after a minute starts its next pass at once.
    reap_seconds: float = 3600.0
    #: How often a server reads token revocations it was not told of (docs/operating.md,
    #: "Revoking a token"): the bound on how long a token revoked with `cv-server token revoke`
    #: on SQLite (another process writing the file) stays accepted, and on PostgreSQL the
    #: fallback for a lost NOTIFY. One second: each poll is one index seek past the last entry
    #: seen, and "revoked" should mean now, not at the next sweep (`sweep_seconds`, 5 s).
    revocation_poll_seconds: float = 1.0
    #: Rows one reaping batch deletes at most (one short transaction each). 1,000: on SQLite a
    #: batch holds the single writer (and the op-log commits queued behind it) for a few
    #: milliseconds; on PostgreSQL each batch commits on its own, so no long transaction holds
    #: back autovacuum's horizon, and a pass still deletes an hour's worth of a busy queue
    #: (thousands of rows) in seconds (docs/operating.md, "Queue rows").
    reap_batch_size: int = 1000
    #: A result whose JSON is larger than this goes to the blob store; the row keeps a reference.
    blob_threshold_bytes: int = 64 * 1024
    #: The largest result a stage may complete with (its JSON, uploaded to the blob store, see
    #: docs/queue.md); a larger one completes the request at once with a `result_too_large`
    #: error payload. Not a seed constant: 32 MiB bounds what one upload (and one download)
    #: holds in server memory, the blob store taking and giving whole byte strings, while
    #: leaving room for the reports and PDFs stages produce; `--set` raises it.
    max_result_bytes: int = 32 * 1024 * 1024
    idempotency_retention_seconds: float = 24 * 3600.0

    # -- schedules (docs/configuration.md, docs/queue.md "Schedules") --
    #: The instance holding the scheduler lease renews it this often; the others try for it
    #: when it would lapse. Together: with N instances one fires, and a dead holder is replaced
    #: within one lease of its last renewal.
    scheduler_heartbeat_seconds: float = 60.0
    #: How long the scheduler lease lasts unrenewed: at least 3x the heartbeat, so a renewal
    #: delayed by a slow database or a paused process does not hand the lease over. Five
    #: minutes: a holder that stopped renewing is replaced after at most that long.
    scheduler_lease_seconds: float = 300.0
    #: The most due times one firing of a schedule with missed-run policy `all` enqueues (the
    #: latest ones kept): the most one batch enqueue may carry (docs/limits.md), so a schedule
    #: due every second, caught up after an hour down, adds one batch, not 3,600 requests.
    schedule_catch_up_limit: int = 1000

    # -- compute lock (docs/configuration.md, docs/stages.md) --
    compute_lock_ttl_seconds: float = 60.0

    # -- shutdown (docs/operating.md) --
    drain_seconds: float = 25.0

    # -- rate limits per token and route class (docs/reliability.md) --
    # Off by default (None): the right budget depends on the deployment (one worker token may
    # claim for a whole fleet, one app token carry every user of a tenant), and a default the
    # server cannot know would refuse legitimate traffic. Requests per second per token; a
    # refused request is answered 429 `rate_limited` with Retry-After, which the SDK and
    # workers wait out.
    rate_limit_ops_per_second: float | None = None
    rate_limit_reads_per_second: float | None = None
    rate_limit_enqueue_per_second: float | None = None
    rate_limit_claim_per_second: float | None = None
    rate_limit_queue_per_second: float | None = None
    rate_limit_locks_per_second: float | None = None
    rate_limit_socket_per_second: float | None = None
    #: Seconds of its rate a bucket saves up (at least one request): a client idle that long
    #: may send that much at once, as an outbox replaying its backlog after a reconnect does.
    #: Ten seconds: long enough for such a replay, short enough that a budget means per second.
    rate_limit_burst_seconds: float = 10.0

    def __post_init__(self) -> None:
        # A setting that cannot work is refused here, at start-up, in one line naming it, rather
        # than served: `compute_lock_ttl_seconds=0` answered 500 to every lock acquisition,
        # `max_dequeues=0` refused every enqueue and `max_ops_per_request=0` every apply as if
        # the client had sent something wrong.
        if not self.problem_type_base or not self.problem_type_base.isprintable():
            raise ValueError(
                f"problem_type_base must be printable, non-empty text: {self.problem_type_base!r}"
            )
        heartbeat = self.socket_heartbeat_seconds
        if heartbeat is not None and not (math.isfinite(heartbeat) and heartbeat > 0):
            raise ValueError(
                f"socket_heartbeat_seconds must be a finite number > 0 or None, not {heartbeat!r}"
            )
        retention = self.oplog_retention_seconds
        if retention and math.isfinite(retention) and self.minted_at_skew_seconds >= retention:
            raise ValueError(
                "minted_at_skew_seconds must be below oplog_retention_seconds (or retention 0)"
            )
        if self.scheduler_lease_seconds < 3 * self.scheduler_heartbeat_seconds:
            raise ValueError(
                "scheduler_lease_seconds must be at least 3x scheduler_heartbeat_seconds"
            )
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.name.startswith("rate_limit_") and setting.type == "float | None":
                if value is not None and not (math.isfinite(value) and value > 0):
                    raise ValueError(
                        f"{setting.name} must be a finite number > 0 or None, not {value!r}"
                    )
                continue
            if setting.name in _MAY_BE_ZERO:
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"{setting.name} must be a finite number >= 0, not {value!r}")
            elif setting.type in ("int", "float") and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{setting.name} must be a finite number > 0, not {value!r}")


#: Settings for which 0 means something: retry a failed request at once, keep no result inline
#: (every result to the blob store), drain nothing at shutdown, keep finished requests or the
#: whole op-log forever.
_MAY_BE_ZERO = frozenset(
    {
        "failure_backoff_seconds",
        "blob_threshold_bytes",
        "drain_seconds",
        "request_retention_seconds",
        "oplog_retention_seconds",
    }
)
