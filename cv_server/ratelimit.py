"""Rate limits per bearer token and route class: a token bucket each (docs/reliability.md).

A bucket holds up to `burst` tokens and refills at `per_second`; a request takes one token or is
refused with the seconds until the next one (`429 rate_limited`, `Retry-After`). The core
(`TokenBuckets`) is pure: the clock is a parameter. The middleware is a thin shell: it finds the
route class of a request, the token it carries, and answers 429 when the bucket is empty.

Route classes: `ops` (`POST .../docs/{sub_doc}/ops`, and `apply` frames on an open websocket),
`reads` (sub-doc state and log, request rows and streams, blobs), `enqueue` (`POST
.../requests`), `claim` (claims, the pending count and the request list: what an idle worker
polls), `queue` (heartbeat, result upload, complete, fail, cancel, replay, discard: what
finishes work, in a bucket of its own so a worker's polling can never starve its own
completions and lose the lease), `locks` (compute lock acquire/release), `socket` (the
websocket handshake). Health, readiness and metrics are never limited.

Only requests with a valid token are counted, keyed by that token: one without (or with a forged
one) is answered 401 by its route and costs nothing, and keys cannot be made up without the
token secret.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from cv_server.config import ServerConfig

__all__ = [
    "ROUTE_CLASSES",
    "Rate",
    "RateLimits",
    "RouteClass",
    "TokenBuckets",
    "buckets_for",
    "rates_of",
    "retry_after_header",
]

RouteClass = Literal["ops", "reads", "enqueue", "claim", "queue", "locks", "socket"]
ROUTE_CLASSES: Final[tuple[RouteClass, ...]] = (
    "ops", "reads", "enqueue", "claim", "queue", "locks", "socket",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rate:
    """`per_second` tokens a second, at most `burst` saved up (at least one)."""

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_second) and self.per_second > 0):
            raise ValueError(f"a rate must be a finite number > 0, not {self.per_second!r}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ValueError(f"a burst must be a finite number >= 1, not {self.burst!r}")


class TokenBuckets:
    """One token bucket per key, all at the same `rate`. Pure: `now` is a parameter (any
    monotonic clock in seconds).

    A key never seen, or not seen for long enough to have refilled, has a full bucket: such
    buckets are dropped once more than `max_keys` are held, so memory is bounded by the keys
    active within one refill time, and dropping loses nothing."""

    def __init__(self, rate: Rate, *, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.max_keys = max_keys
        #: key -> (tokens left, when they were counted).
        self._buckets: dict[Hashable, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: Hashable, now: float) -> float:
        """Take one token for `key`: 0.0 if it was there, else the seconds until one will be
        (nothing is taken then: a refused request does not push the next one back)."""
        rate = self.rate
        tokens, then = self._buckets.get(key, (rate.burst, now))
        tokens = min(rate.burst, tokens + max(0.0, now - then) * rate.per_second)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            if len(self._buckets) > self.max_keys:
                self._drop_full(now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / rate.per_second

    def _drop_full(self, now: float) -> None:
        rate = self.rate
        full = [
            key
            for key, (tokens, then) in self._buckets.items()
            if tokens + (now - then) * rate.per_second >= rate.burst
        ]
        for key in full:
            del self._buckets[key]


def retry_after_header(seconds: float) -> str:
    """`Retry-After` in whole seconds (the header's form), rounded up, at least 1: a client
    that waits what it says finds a token."""
    return str(max(1, math.ceil(seconds)))


def buckets_for(rates: Mapping[RouteClass, Rate | None]) -> dict[RouteClass, TokenBuckets]:
    """A `TokenBuckets` per limited class (a class whose rate is None is not limited)."""
    return {cls: TokenBuckets(rate) for cls, rate in rates.items() if rate is not None}


def rates_of(config: ServerConfig) -> dict[RouteClass, Rate | None]:
    """Each class's rate from `config.rate_limit_<class>_per_second` (None: not limited); a
    bucket holds `rate_limit_burst_seconds` of its rate, at least one request."""
    rates: dict[RouteClass, Rate | None] = {}
    for cls in ROUTE_CLASSES:
        per_second: float | None = getattr(config, f"rate_limit_{cls}_per_second")
        rates[cls] = (
            None
            if per_second is None
            else Rate(per_second, max(1.0, per_second * config.rate_limit_burst_seconds))
        )
    return rates


class RateLimits:
    """The buckets of one server process, one `TokenBuckets` per limited class."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets: dict[RouteClass, TokenBuckets] = buckets_for(rates_of(config))
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return bool(self._buckets)

    def take(self, route_class: RouteClass, token: str) -> float:
        """0.0 when `token` may make one more request of `route_class`, else the seconds until
        it may."""
        buckets = self._buckets.get(route_class)
        return 0.0 if buckets is None else buckets.take(token, self._clock())
