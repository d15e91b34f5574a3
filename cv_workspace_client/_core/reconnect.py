"""When the workspace websocket connects again, and when it stops trying: the pure policy the
socket's run loop asks (`_io/socket.py`). No I/O and no clock; the jitter source is a parameter.

As in websockets' `process_exception` + `backoff()`, the policy answers two questions:

- `is_final(status)`: a refused upgrade is an answer (stop; subscriptions raise, ops go over HTTP
  and get the same answer) for a 4xx other than 408 and 429; anything else is retried.
- how long to wait before the next connect: the run loop keeps a `Streak` (what happened since
  the waits last started over), moves it on with `refused` / `ended`, and asks `delay(streak)`.

The waits start over whenever a connection *proved the server up* (`resets`): it delivered data,
ended without a server error close (1011, 1013, 1014) and kept to the protocol — however short it
lived. After such a drop the waits follow the dropped-listener schedule: full jitter up to 2 s,
then up to 5 s, and they stay at 5 s while the server keeps accepting the upgrade (a lossy link
that cuts a connection before its first frame: the server is up, the link is not). Only
*setbacks* climb past the schedule, doubling up to the retry cap: connects refused, upgrades
refused, server error closes, protocol breaches — the server is failing, and a fleet of clients
must not hold it down. So a subscriber whose link recovers is current within seconds, and a server
that accepts, answers and drops is still never reconnected to in a tight loop.

Until a connection proves the server up (the first connect, connections that delivered nothing),
each failed attempt waits the client's retry backoff (full jitter, base 1 s, cap 300 s).

Pinned by `tests/client/core/test_reconnect.py` (the pure rules) and
`tests/client/io/test_socket_reconnects.py` (a real socket, and through `FaultProxy`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AFTER_DROP_SECONDS", "SERVER_ERROR_CLOSES", "ReconnectPolicy", "Streak"]

#: Full-jitter caps of the waits after a connection that delivered data dropped: 2 s, then 5 s
#: (the reconnect schedule of a dropped listener).
AFTER_DROP_SECONDS: tuple[float, ...] = (2.0, 5.0)
#: Closes that say the server is failing (internal error, try again later, bad gateway).
SERVER_ERROR_CLOSES = frozenset({1011, 1013, 1014})


@dataclass(frozen=True, slots=True)
class Streak:
    """The attempts since the waits last started over.

    `dropped`: they started over because a connection that proved the server up dropped (the
    dropped-listener schedule applies); False until one has. `failures`: attempts since then
    that did not prove the server up. `setbacks`: the latest of those in a row that said the
    server is failing (not merely a connection cut before its first frame).
    """

    dropped: bool = False
    failures: int = 0
    setbacks: int = 0


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """How the websocket paces its reconnects (`ClientConfig.reconnect_policy` injects one).

    Args:
        backoff: the wait before attempt `n + 1` after `n` failures while no connection has
            proved the server up (the client passes its retry backoff).
        after_drop: full-jitter caps of the waits after a connection that proved the server up
            dropped; the last one holds while the server keeps accepting upgrades, and doubles
            with each setback past the schedule, up to `cap`.
        cap: the longest wait after a drop.
        uniform: the jitter source, `uniform(low, high)`; tests pass a fixed one.
    """

    backoff: Callable[[int], float]
    after_drop: tuple[float, ...] = AFTER_DROP_SECONDS
    cap: float = 300.0
    uniform: Callable[[float, float], float] = random.uniform

    def __post_init__(self) -> None:
        if not self.after_drop or any(step < 0 for step in self.after_drop) or self.cap < 0:
            raise ValueError("after_drop needs at least one step; steps and cap must be >= 0")

    @staticmethod
    def is_final(status: int) -> bool:
        """True when a refused upgrade answered `status` ends the socket: a 4xx but 408 / 429
        (a bad token, a wrong path, a proxy that refuses upgrades). 408, 429 and 5xx are
        retried."""
        return 400 <= status < 500 and status not in (408, 429)

    @staticmethod
    def resets(*, delivered: bool, close_code: int | None, broke_protocol: bool) -> bool:
        """True when a connection that just ended proved the server up: it delivered data, was
        not closed with a server error, and the server kept to the protocol. How long it stayed
        up does not matter: on a lossy link every connection is short, and counting those as
        failures pushed the wait towards the cap while the data was flowing."""
        return delivered and close_code not in SERVER_ERROR_CLOSES and not broke_protocol

    @staticmethod
    def refused(streak: Streak) -> Streak:
        """The streak after a connect that failed before the upgrade (refused, reset, timed
        out, or an upgrade refused with a status that is not final): a setback."""
        return Streak(streak.dropped, streak.failures + 1, streak.setbacks + 1)

    @classmethod
    def ended(
        cls, streak: Streak, *, delivered: bool, close_code: int | None, broke_protocol: bool
    ) -> Streak:
        """The streak after a connection ended: started over if it proved the server up,
        otherwise one more failure (a setback if the server closed it with an error or broke
        the protocol; a cut before the first frame is not one)."""
        if cls.resets(delivered=delivered, close_code=close_code, broke_protocol=broke_protocol):
            return Streak(dropped=True, failures=1, setbacks=0)
        setback = close_code in SERVER_ERROR_CLOSES or broke_protocol
        return Streak(streak.dropped, streak.failures + 1, streak.setbacks + 1 if setback else 0)

    def delay(self, streak: Streak) -> float:
        """The wait before the next connect (0 for a streak with no failure)."""
        if streak.failures <= 0:
            return 0.0
        if not streak.dropped:
            return max(0.0, self.backoff(streak.failures))
        steps = len(self.after_drop)
        ceiling = self.after_drop[min(streak.failures, steps) - 1]
        if streak.setbacks > steps:  # the exponent bounded: 2 ** 64 is past any cap already
            ceiling *= 2.0 ** min(streak.setbacks - steps, 64)
        return self.uniform(0.0, min(ceiling, self.cap))
