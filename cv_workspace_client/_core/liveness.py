"""When to probe a quiet websocket, and when to give up on it (the SDK's heartbeat).

Sans-I/O: the socket calls `heard()` for every message that arrives (text, ping or pong) and
`tick()` when the delay the previous tick returned has passed, and does what it is told:

- `WAIT`: the peer spoke during the last interval; tick again after `interval`.
- `PING`: nothing for a whole interval; send a ping and tick again after `interval / 2`.
- `DEAD`: nothing, not even the pong, since: the connection died without closing (a NAT that
  forgot the flow, a server that lost power). Drop it and reconnect.

Why not aiohttp's own `heartbeat=`: it re-arms a timer as data arrives, one extra event-loop
callback per tick that received data (~7 µs of CPU per message here, `bench.ws_heartbeat`),
and a subscriber receives a message per op delivered. Here a message costs one attribute store;
a quiet peer is probed after one to two intervals of silence and dropped half an interval later.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Liveness", "Verdict"]


class Verdict(Enum):
    WAIT = "wait"
    PING = "ping"
    DEAD = "dead"


class Liveness:
    """The heartbeat's state for one connection (start a new one per connection)."""

    __slots__ = ("_heard", "_probing", "interval")

    def __init__(self, interval: float) -> None:
        if not interval > 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self._heard = True  # the handshake was just heard
        self._probing = False

    def heard(self) -> None:
        """Something arrived from the peer."""
        self._heard = True

    def tick(self) -> tuple[Verdict, float]:
        """The verdict now, and the delay until the next tick (0 once dead)."""
        if self._heard:
            self._heard = False
            self._probing = False
            return Verdict.WAIT, self.interval
        if not self._probing:
            self._probing = True
            return Verdict.PING, self.interval / 2
        return Verdict.DEAD, 0.0
