"""Clocks a test drives, for the places the product takes a clock: a lock, a lease or a token
lapses when the test says so, not when a few hundred milliseconds of wall time happen to pass
on a loaded machine."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import pytest

import cv_server.http.security

__all__ = ["SkippingClock", "TickingClock", "stop_token_clock"]


class _ClockedStore(Protocol):
    """A store that says which clock its times are on (`ComputeLockStore.clock`)."""

    def clock(self) -> Awaitable[float]: ...


class SkippingClock:
    """The wall clock plus every `skip` so far: time passes as usual, and a whole TTL passes at
    once when the test says so. The lapse of a lock (or token) judged on it is then an event the
    test places, while what must not lapse keeps its TTL of real time."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def now(self) -> float:
        """Epoch seconds, `skipped` ahead of the wall clock (for code that takes `now=`)."""
        return time.time() + self.skipped

    def skip(self, seconds: float) -> None:
        self.skipped += seconds

    def drive(self, store: _ClockedStore, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make `store` judge on its own clock plus the skipped seconds. On PostgreSQL its own is
        the database's: instances driven by the same `SkippingClock` still agree."""
        own: Callable[[], Awaitable[float]] = store.clock

        async def clock() -> float:
            return await own() + self.skipped

        monkeypatch.setattr(store, "clock", clock)


class TickingClock:
    """A monotonic clock that moves only when read, `step` seconds per reading. A rate limit on
    it sees requests `step` seconds apart however fast or slow the machine sends them, so which
    of them it refuses depends on their order alone."""

    def __init__(self, step: float) -> None:
        self.step = step
        self._now = 0.0

    def __call__(self) -> float:
        self._now += self.step
        return self._now


def stop_token_clock(monkeypatch: pytest.MonkeyPatch) -> float:
    """Stop the in-process server's token clock (`cv_server.http.security.now`) at the current whole
    second, and return it. A token minted at that second for `ttl` seconds is then accepted at
    any handshake, however long the machine took to get there, and the socket it opens is closed
    (4001) `ttl` seconds of real time after its handshake."""
    stopped = float(int(time.time()))
    monkeypatch.setattr(cv_server.http.security, "now", lambda: stopped)
    return stopped
