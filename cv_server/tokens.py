"""The unguessable tokens the stores mint, one rule for both backends.

A token is what a holder presents to prove it still holds what it was given: a claim token
fences heartbeat, complete and fail (`cv_server.queue.model.fence`); a lock token lets only the
acquirer release its compute lock. The pure cores never draw randomness themselves: the stores
take a `new_token` callable and default to these.
"""

from __future__ import annotations

import secrets

__all__ = ["new_claim_token", "new_lock_token"]

#: Bytes of randomness per token (128 bits, URL-safe base64 text).
TOKEN_BYTES = 16


def new_claim_token() -> str:
    """An unguessable token: only the claimer can present it to heartbeat, complete or fail."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def new_lock_token() -> str:
    """An unguessable token: only the acquirer can present it to release."""
    return secrets.token_urlsafe(TOKEN_BYTES)
