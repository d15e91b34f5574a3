"""The order-sensitive digest both op-log benchmarks' subscribers keep of what they saw: equal to
the digest of the acknowledged (clock, op_id) pairs only if every op arrived once, in order."""

from __future__ import annotations

import hashlib

__all__ = ["digest_of", "digest_step", "new_digest"]


def new_digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def digest_step(digest: hashlib.blake2b, clock: int, op_id: str | None) -> None:
    digest.update(f"{clock}:{op_id}\n".encode())


def digest_of(entries: list[tuple[int, str]]) -> str:
    """The digest a subscriber holds after seeing `entries` ((clock, op_id), clock order)."""
    digest = new_digest()
    for clock, op_id in entries:
        digest_step(digest, clock, op_id)
    return digest.hexdigest()
