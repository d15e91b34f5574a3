"""Token revocation (docs/operating.md, "Revoking a token"): the storage seam every backend
implements, and the pure set of revoked ids each server checks tokens against.

A revocation is a token id (`jti`) and the moment its token would have expired anyway: after
that the entry is useless and the reaper sweeps it, so the list holds at most the revoked tokens
still alive. Each entry gets a sequence number when it is stored; a server reads the entries past
the last one it has seen (`revoked_since`): at start, at a bounded interval, and at once when
told (PostgreSQL: NOTIFY from the instance that revoked). Every backend passes
`tests/contract/revocations_contract.py`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Revocation", "RevocationStore", "RevokedTokens"]


@dataclass(frozen=True, slots=True)
class Revocation:
    """The token `token_id` is refused; the entry may go once `expires_at` (None: never) passed.
    `seq` orders entries as they were stored (strictly increasing)."""

    seq: int
    token_id: str
    expires_at: int | None


class RevocationStore(abc.ABC):
    """Where revocations are kept, shared by every instance and by `cv-server token revoke`."""

    @abc.abstractmethod
    async def revoke(self, token_id: str, expires_at: int | None) -> bool:
        """Record `token_id` as revoked; False if it already was (nothing changes). Announced to
        the other instances, where there are any, once committed."""

    @abc.abstractmethod
    async def revoked_since(self, seq: int) -> list[Revocation]:
        """Every entry with a sequence number above `seq`, in order (0: all of them)."""

    @abc.abstractmethod
    async def sweep(self, now: float, *, limit: int) -> int:
        """Delete at most `limit` entries whose token expired at or before `now`; how many."""

    async def close(self) -> None:  # noqa: B027  # optional hook, nothing to close by default
        """Release what the store holds."""


class RevokedTokens:
    """The revoked token ids one server refuses: pure, fed from `RevocationStore.revoked_since`.

    `add` the entries read (in order); `last_seq` is what to read past next time. Watchers are
    told of each id newly revoked (an open socket carrying it closes). Entries whose token has
    expired are forgotten by `forget_expired`: such a token is refused as expired anyway.
    """

    def __init__(self) -> None:
        self._expiry: dict[str, int | None] = {}
        self.last_seq = 0
        self._watchers: list[Callable[[str], None]] = []

    def __contains__(self, token_id: object) -> bool:
        return token_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, revocations: Iterable[Revocation]) -> list[str]:
        """Take entries read from the store; returns the ids that are new here (watchers told)."""
        new = []
        for entry in revocations:
            self.last_seq = max(self.last_seq, entry.seq)
            if entry.token_id not in self._expiry:
                new.append(entry.token_id)
            self._expiry[entry.token_id] = entry.expires_at
        for token_id in new:
            for watcher in list(self._watchers):
                watcher(token_id)
        return new

    def forget_expired(self, now: float) -> int:
        gone = [t for t, exp in self._expiry.items() if exp is not None and exp <= now]
        for token_id in gone:
            del self._expiry[token_id]
        return len(gone)

    def watch(self, watcher: Callable[[str], None]) -> Callable[[], None]:
        """Call `watcher(token_id)` for each id revoked from now on; returns the unwatch."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher)
