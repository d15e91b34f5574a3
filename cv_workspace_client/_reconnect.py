"""When the workspace websocket connects again, and when it stops trying: the pure policy the
socket's run loop asks (`_socket.py`). No I/O and no clock; the jitter source is a parameter.

The policy is a pair, as in websockets' `process_exception` + `backoff()`:

- `is_final(status)`: a refused upgrade is an answer (stop; subscriptions raise, ops go over HTTP
  and get the same answer) for a 4xx other than 408 and 429; anything else is retried.
- `delays(dropped=...)`: the waits before each next connect. A fresh sequence starts whenever a
  connection *proved the server up* (`resets`): it delivered data, ended without a server error
  close (1011, 1013, 1014) and kept to the protocol. After such a drop the waits follow the
  dropped-listener schedule, full jitter up to 2 s, then up to 5 s, then doubling from there up to
  the retry cap; so a subscriber whose link recovers is current within seconds, however many short
  connections came before, and a server that accepts, answers and drops is still never
  reconnected to in a tight loop. Until a connection proves the server up (the first connect,
  a connection that delivered nothing), the waits are the client's retry backoff (full jitter,
  base 1 s, cap 300 s by default).

Pinned by `tests/client/test_reconnect_policy.py` (the pure rules) and
`tests/client/test_reconnect_backoff.py` (a real socket through `FaultProxy`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["AFTER_DROP_SECONDS", "SERVER_ERROR_CLOSES", "ReconnectPolicy"]

#: Full-jitter caps of the waits after a connection that delivered data dropped: 2 s, then 5 s
#: (the reconnect schedule of a dropped listener).
AFTER_DROP_SECONDS: tuple[float, ...] = (2.0, 5.0)
#: Closes that say the server is failing (internal error, try again later, bad gateway).
SERVER_ERROR_CLOSES = frozenset({1011, 1013, 1014})


def _uniform(low: float, high: float) -> float:
    return random.uniform(low, high)


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """How the websocket paces its reconnects (`ClientConfig.reconnect_policy` injects one).

    Args:
        backoff: the wait before attempt `n + 1` after `n` failures while no connection has
            proved the server up (the client passes its retry backoff).
        after_drop: full-jitter caps of the first waits after a connection that proved the
            server up dropped; past them each cap doubles, up to `cap`.
        cap: the longest wait after a drop.
        uniform: the jitter source, `uniform(low, high)`; tests pass a fixed one.
    """

    backoff: Callable[[int], float]
    after_drop: tuple[float, ...] = AFTER_DROP_SECONDS
    cap: float = 300.0
    uniform: Callable[[float, float], float] = _uniform

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
        """True when a connection that just ended proved the server up, so the waits start
        over from the dropped-listener schedule: it delivered data, was not closed with a
        server error, and the server kept to the protocol. How long it stayed up does not
        matter: on a lossy link every connection is short, and counting those as failures
        pushed the wait towards the cap while the data was flowing."""
        return delivered and close_code not in SERVER_ERROR_CLOSES and not broke_protocol

    def delays(self, *, dropped: bool) -> Iterator[float]:
        """The waits before each next connect: after a drop of a connection that proved the
        server up (`dropped`), the dropped-listener schedule; otherwise the retry backoff."""
        if not dropped:
            failures = 0
            while True:
                failures += 1
                yield max(0.0, self.backoff(failures))
        ceiling = 0.0
        for step in self.after_drop:
            ceiling = min(step, self.cap)
            yield self.uniform(0.0, ceiling)
        while True:
            ceiling = min(ceiling * 2, self.cap)
            yield self.uniform(0.0, ceiling)
