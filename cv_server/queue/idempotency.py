"""Idempotency keys for requests that must not run twice but have no natural key (docs/queue.md).

A client sends `Idempotency-Key: <opaque>` with a non-deterministic request (an enqueue whose
stage does not declare a deterministic id). The server:

1. `begin(ws, key, fingerprint, now)` — the insert is the lock:
   - `Owned`: first time (or the old row expired, or its owner died): do the work, then complete
     the key with the response **in the same transaction as the effect** (`KeyCompletion`, or
     `finish` when the effect is not a store write); on failure `abandon` the key so a genuine
     retry can proceed; in every case `await owned.release()` when done (in a `finally`);
   - `StoredAnswer(status_code, body)`: answered before with the same request: send that answer
     verbatim with `Idempotency-Replayed: true`;
   - `InProgress`: the first request is still running: 409 with `Retry-After: 1`, run nothing;
   - `Mismatch`: the key was used for a different request: 422 `idempotency_key_reuse`.
2. Keys are scoped to the workspace (tenant B's `abc` is not tenant A's `abc`: a global key space
   would give A's stored answer to B) and, within it, to the enqueuer's grant (`grant_scoped_key`:
   a token limited to `notes*` never gets back what a full token's `abc` answered), and live
   `ServerConfig.idempotency_retention_seconds` (24 h) from their first use; `sweep` deletes the
   expired ones.

The decision itself (`decide_begin`) and the fingerprint are pure.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

__all__ = [
    "BeginOutcome",
    "IdempotencyStore",
    "InProgress",
    "KeyCompletion",
    "KeyRecord",
    "Mismatch",
    "Owned",
    "StoredAnswer",
    "StoredResponse",
    "check_sweep_limit",
    "decide_begin",
    "grant_scoped_key",
    "request_fingerprint",
]

R = TypeVar("R")


def request_fingerprint(method: str, path: str, body: bytes) -> str:
    """sha256 (hex) of method | path | raw body, as received (docs/queue.md).

    The raw bytes, before parsing: hashing the parsed request after defaults are applied would
    turn every in-flight retry into a mismatch the day a default changes. Each part is
    length-prefixed, so no part can bleed into the next (a decoded path may contain any byte).
    Pass the path with its query string.
    """
    digest = hashlib.sha256()
    for part in (method.upper().encode("utf-8"), path.encode("utf-8"), body):
        digest.update(f"{len(part)}:".encode("ascii"))
        digest.update(part)
    return digest.hexdigest()


#: Joins a client's key to its grant's key. A header value never holds a newline (`_once_per_key`
#: takes printable keys only), so a client's key can never spell another grant's stored key.
_GRANT_SEPARATOR = "\n"


def grant_scoped_key(key: str, grant_key: str | None) -> str:
    """The key as stored: the client's `key` itself for a full-grant token (`grant_key` None,
    so its keys stay where they always were), else `key` joined to the grant's
    `cv_server.scopes.grant_scope_key`, so that the same key and body sent under two grants are
    two keys with two answers (tests/server/http/test_idempotency_grants.py)."""
    if grant_key is None:
        return key
    if not grant_key or _GRANT_SEPARATOR in grant_key:
        raise ValueError(f"a grant key is a non-empty line: {grant_key!r}")
    return f"{key}{_GRANT_SEPARATOR}{grant_key}"


def check_sweep_limit(limit: int | None) -> None:
    """A sweep deletes at most `limit` rows (None: all): a bound keeps one write job short."""
    if limit is not None and limit < 0:
        raise ValueError(f"sweep limit must be >= 0 or None: {limit!r}")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The answer a retry gets back verbatim."""

    status_code: int
    body: Any


async def _nothing_to_release() -> None:
    """The `release` of a backend whose ownership holds nothing beyond the row."""


@dataclass(frozen=True, slots=True)
class Owned:
    """The caller owns the key: run the work, then complete or abandon the key, then
    `await release()` — in a `finally`, so every error path releases too.

    `release` lets go of whatever the backend holds to prove the owner alive (on PostgreSQL a
    pooled connection and its advisory lock, so a retry can tell a dead owner from a running
    one). It is idempotent, and `finish`/`abandon` on the same store release as well. It is not
    part of equality: `Owned() == begin(...)` reads as "the caller owns the key".
    """

    release: Callable[[], Awaitable[None]] = field(
        default=_nothing_to_release, compare=False, repr=False
    )


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """Answered before: send `status_code` and `body` again, with `Idempotency-Replayed: true`."""

    status_code: int
    body: Any


@dataclass(frozen=True, slots=True)
class InProgress:
    """The first request with this key is still running: 409, `Retry-After: 1`."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key was used for a different request: 422 `idempotency_key_reuse`."""


BeginOutcome = Owned | StoredAnswer | InProgress | Mismatch


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A stored key, as `decide_begin` sees it."""

    fingerprint: str
    state: Literal["in_progress", "completed"]
    status_code: int | None
    body: Any
    expires_at: float


def decide_begin(existing: KeyRecord | None, fingerprint: str, now: float) -> BeginOutcome:
    """What `begin` answers given the stored row (None when there is none).

    An expired row counts as absent, even before the sweep deleted it: the caller takes the key
    over. A mismatch wins over the state, as in the IETF `Idempotency-Key` draft.
    """
    if existing is None or existing.expires_at <= now:
        return Owned()
    if existing.fingerprint != fingerprint:
        return Mismatch()
    if existing.state == "completed":
        if existing.status_code is None:
            raise ValueError("a completed idempotency key must carry its status code")
        return StoredAnswer(existing.status_code, existing.body)
    return InProgress()


# No `slots=True`: a frozen slotted generic dataclass breaks `KeyCompletion[X](...)` (CPython's
# frozen __setattr__ then refers to the pre-slots class).
@dataclass(frozen=True)
class KeyCompletion(Generic[R]):
    """Complete an owned key inside another store's write: the store calls `respond(result)`
    with its verb's result, inside the transaction, and stores the answer under the key.

    `respond` runs inside the transaction (on SQLite, on the writer thread): it must be a pure
    function of the result — build the response body, touch no event loop, no I/O. If the key is
    no longer in progress under `fingerprint`, the store raises `IdempotencyKeyLost` and its own
    write is rolled back too.
    """

    workspace_id: str
    key: str
    fingerprint: str
    respond: Callable[[R], StoredResponse]


class IdempotencyStore(abc.ABC):
    """Idempotency keys of every workspace (docs/queue.md).

    Rules every implementation keeps:
    - `begin` is atomic: of concurrent `begin`s on a free key exactly one gets `Owned`;
    - a key is scoped to its workspace: nothing about workspace A's key is visible from B;
    - a key lives `retention` seconds from the `begin` that created it;
    - a key whose owner died (its process, or on PostgreSQL its database session) does not stay
      in progress: a retry takes it over (docs/queue.md: a crashed request must not turn honest
      retries into 24 hours of 409), and of concurrent retries exactly one does.
    """

    @abc.abstractmethod
    async def begin(
        self, workspace_id: str, key: str, fingerprint: str, now: float
    ) -> BeginOutcome:
        """Claim the key for a request with `fingerprint`, or say how it was used before.

        An `Owned` answer must be released (`Owned.release`) once the work is done or abandoned.
        """

    @abc.abstractmethod
    async def finish(
        self, workspace_id: str, key: str, fingerprint: str, response: StoredResponse, now: float
    ) -> None:
        """Store the response of an owned key (when its effect is not a write of a store that
        accepts a `KeyCompletion`; prefer that, so the answer commits with its effect).

        Raises `IdempotencyKeyLost` if the key is not in progress under `fingerprint`. Releases
        the key's ownership (as `Owned.release`) either way.
        """

    @abc.abstractmethod
    async def abandon(self, workspace_id: str, key: str, now: float) -> bool:
        """Release an owned key whose work failed, so a retry can run; True if a row was
        deleted. A completed key is never abandoned (its effect happened). Releases the key's
        ownership (as `Owned.release`)."""

    @abc.abstractmethod
    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        """Delete up to `limit` (None: all) expired keys; return how many were deleted."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the store's own resources (a shared database is closed by its owner), the
        ownership of keys still owned included: they become free to a retry, as if their
        owner had died."""
