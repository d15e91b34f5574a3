"""Client configuration. The retry constants are in docs/configuration.md; every one can be
overridden, and tests shrink them (or inject `sleep` / `backoff`) instead of waiting."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from cv_workspace_client._core.conflicts import ConflictRetryPolicy
from cv_workspace_client._core.reconnect import AFTER_DROP_SECONDS, ReconnectPolicy

__all__ = ["ClientConfig"]


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Everything `WorkspaceClient` can be tuned with."""

    # -- retries (full jitter, base 1 s, cap 300 s, 5 attempts, then stay pending) --
    #: Full jitter: the n-th wait is `random(0, min(cap, base * 2 ** (n - 1)))`.
    retry_base_seconds: float = 1.0
    retry_cap_seconds: float = 300.0
    #: Sends of one batch (and tries of one read) before giving up; a given-up op stays in the
    #: outbox and is resent on the next connect.
    retry_attempts: int = 5

    #: Deadline of one HTTP request or websocket ack. aiohttp's own default total timeout (5 min):
    #: a request that outlives it is treated as a lost connection and retried under its op_id.
    request_timeout_seconds: float = 300.0

    #: The websocket pings the server after this long without hearing from it, and drops the
    #: connection if no pong comes within half of it (aiohttp's heartbeat). A connection that
    #: died without closing (a NAT that forgot the flow, a server that lost power) is otherwise
    #: noticed only by the ack deadline above or by the OS, hours later, while a subscription
    #: waits on it. The default heartbeat (60 s); the pings also keep NAT flows from idling
    #: out. None switches it off.
    socket_heartbeat_seconds: float | None = 60.0

    #: Full-jitter caps of the websocket's first reconnects after a connection that delivered
    #: data dropped: up to 2 s, then up to 5 s, then doubling up to `retry_cap_seconds` (the
    #: reconnect schedule of a dropped listener). Before any connection delivered data, the
    #: reconnects wait the retry backoff above.
    reconnect_after_drop_seconds: tuple[float, ...] = AFTER_DROP_SECONDS

    #: How `read_modify_write` retries a `version_conflict`: 25, 50, 100 ms, each x random(0.5,
    #: 1.5), so the change runs at most four times (docs/ops.md#conflicts).
    conflict_retry: ConflictRetryPolicy = field(default_factory=ConflictRetryPolicy)

    # -- batching: stay under the server's request limits (ServerConfig defaults) --
    #: = the server's `max_ops_per_request`.
    max_batch_ops: int = 1000
    #: Op bytes per batch: under the server's 1 MiB body / websocket frame limit, with room for
    #: the envelope. A server that still says `body_too_large` makes the client halve its batches.
    max_batch_bytes: int = 1_000_000

    #: When a file outbox fsyncs an op: "alongside" its first send (the op is in the file, safe from
    #: the process dying, before it is sent; the fsync for power loss runs during the round trip,
    #: and the client never reports an op as waiting in the outbox before it), or "before_send"
    #: (the strict order: one fsync on every op's path).
    outbox_sync: Literal["alongside", "before_send"] = "alongside"

    #: Send ops over the workspace's websocket (pipelined) when it is open; HTTP otherwise.
    #: False: HTTP only (one request per in-flight batch).
    ops_over_websocket: bool = True

    # -- subscriptions --
    #: Live ops buffered per subscription before the client stops buffering and catches up from
    #: the log instead (= the server's `subscriber_queue_limit`): memory stays bounded, no op lost.
    subscription_buffer: int = 10_000
    #: Page size of HTTP catch-up reads (= the server's `catchup_page`).
    catchup_page: int = 1000

    # -- injection points for tests --
    #: How the client waits between attempts: tenacity's `sleep=`, retry timers, reconnects.
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)
    #: Delay before attempt `n + 1` after `n` failures; None = full jitter from the values above.
    backoff: Callable[[int], float] | None = None
    #: The websocket's reconnect policy (which refused upgrades are final, when the waits start
    #: over, how long they are); None = `ReconnectPolicy` from the values above.
    reconnect_policy: ReconnectPolicy | None = None

    def __post_init__(self) -> None:
        if self.retry_attempts < 1:
            raise ValueError("retry_attempts must be >= 1")
        if self.retry_base_seconds < 0 or self.retry_cap_seconds < 0:
            raise ValueError("retry delays must be >= 0")
        heartbeat = self.socket_heartbeat_seconds
        if heartbeat is not None and not 0 < heartbeat < math.inf:
            raise ValueError("socket_heartbeat_seconds must be a finite number > 0 or None")
        if not self.reconnect_after_drop_seconds or min(self.reconnect_after_drop_seconds) < 0:
            raise ValueError("reconnect_after_drop_seconds needs at least one step, each >= 0")
        if self.max_batch_ops < 1 or self.max_batch_bytes < 1:
            raise ValueError("batch limits must be >= 1")
        if self.outbox_sync not in ("alongside", "before_send"):
            raise ValueError("outbox_sync must be 'alongside' or 'before_send'")
        if self.subscription_buffer < 1 or self.catchup_page < 1:
            raise ValueError("subscription_buffer and catchup_page must be >= 1")
