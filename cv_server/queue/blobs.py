"""The result blob store (`surface_result_blobs`, bytea, 24 h expiry).

A stage whose result is too large for the request row stores it here and completes the request
with a `blob_ref` instead of the payload (claim check); the enqueuer fetches it by reference.
Blobs are scoped to their workspace — a reference is useless in any other workspace — and live
`ServerConfig.blob_retention_seconds` (24 h) from `put`; `sweep` deletes the expired ones.
"""

from __future__ import annotations

import abc

__all__ = ["BlobStore", "new_blob_ref"]


def new_blob_ref(random_hex: str) -> str:
    """A blob reference: `"b_"` + the caller's random hex (pass `secrets.token_hex(20)`)."""
    if not random_hex or any(c not in "0123456789abcdef" for c in random_hex):
        raise ValueError("random_hex must be lowercase hex")
    return "b_" + random_hex


class BlobStore(abc.ABC):
    """Result blobs of every workspace.

    Rules every implementation keeps:
    - `put` returns a fresh reference; `get` with it in the same workspace returns the very bytes
      until `retention` seconds after the `put`;
    - an expired blob is gone for `get` at once, even before `sweep` deleted it;
    - a reference from another workspace finds nothing.
    """

    @abc.abstractmethod
    async def put(self, workspace_id: str, data: bytes, now: float) -> str:
        """Store `data`; return its reference."""

    @abc.abstractmethod
    async def get(self, workspace_id: str, blob_ref: str, now: float) -> bytes | None:
        """The blob's bytes, or None if it is unknown, expired, or of another workspace."""

    @abc.abstractmethod
    async def size(self, workspace_id: str, blob_ref: str, now: float) -> int | None:
        """The blob's size in bytes without reading it, or None where `get` would find nothing
        (a completion naming a blob checks it exists this way)."""

    @abc.abstractmethod
    async def sweep(self, now: float, *, limit: int | None = None) -> int:
        """Delete up to `limit` (None: all) expired blobs; return how many were deleted."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the store's own resources (a shared database is closed by its owner)."""
