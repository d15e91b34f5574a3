"""`TokenSecret`: the secret the server checks bearer tokens with, replaceable while it runs.

A leaf: the app state keys (`cv_server.keys`) name its type, and the HTTP edge reads it, so it
imports neither (tests/test_architecture.py fails on any import cycle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["TokenSecret"]

log = logging.getLogger(__name__)


class TokenSecret:
    """The secret bearer tokens are checked with, replaceable while the server runs.

    `cv-server rotate-secret` replaces the one in the database; on PostgreSQL every running
    instance then calls `replace` (see `Stores.follow_secret`). This is the one place the
    server's secret lives at runtime: HTTP reads `value` on each request, and each open socket
    `watch`es it, so that one whose token the new secret refuses is closed (4001).
    """

    def __init__(self, value: bytes) -> None:
        self._value = value
        self._watchers: set[Callable[[bytes], None]] = set()

    @property
    def value(self) -> bytes:
        return self._value

    def replace(self, value: bytes) -> None:
        """Check tokens with `value` from now on, and tell every watcher (a new value only)."""
        if value == self._value:  # a re-read after a reconnect usually finds the same one
            return
        self._value = value
        for watcher in list(self._watchers):
            try:
                watcher(value)
            except Exception:  # one broken watcher must not keep the others on the old secret
                log.exception("a watcher of the token secret failed")

    def watch(self, watcher: Callable[[bytes], None]) -> Callable[[], None]:
        """Call `watcher(new_value)` on each replacement; returns the function that stops it."""
        self._watchers.add(watcher)
        return lambda: self._watchers.discard(watcher)
