"""Bearer tokens: HMAC-SHA256 signed, naming the workspaces they may touch (docs/operating.md).

Format: `cvt1.<base64url(JSON payload)>.<base64url(signature)>`, payload
`{"ws": ["w1", ...], "iat": <epoch s>, "exp"?: <epoch s>}`; `"*"` in `ws` grants every workspace
(operators and shared workers). Pure functions: the secret and `now` are parameters.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cv_mutations import is_valid_workspace_id
from cv_server.errors import CvServerError

__all__ = [
    "ALL_WORKSPACES",
    "TokenClaims",
    "TokenError",
    "check_grant",
    "mint_token",
    "new_secret",
    "verify_token",
]

_PREFIX: Final = "cvt1"
ALL_WORKSPACES: Final = "*"


class TokenError(CvServerError):
    """The token is missing, malformed, forged or expired."""


@dataclass(frozen=True, slots=True)
class TokenClaims:
    workspaces: frozenset[str]
    issued_at: int
    expires_at: int | None

    def allows(self, workspace_id: str) -> bool:
        return ALL_WORKSPACES in self.workspaces or workspace_id in self.workspaces


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, signed_part: str) -> str:
    return _b64(hmac.new(secret, signed_part.encode(), hashlib.sha256).digest())


def check_grant(workspaces: Sequence[str], ttl: float | None) -> None:
    """Raise `ValueError` unless a token for `workspaces` with `ttl` can work.

    Refused rather than minted: a token naming no valid workspace (`ws1,ws2`, `ws 1`) grants
    nothing, and one whose ttl is not a positive finite number is expired on arrival (`--ttl
    -60`) or cannot be encoded at all (`--ttl inf` was a traceback): `cv-server token` printed
    the first two and exited 0, so the mistake surfaced only as 401/403 at use. At least 1 s:
    `exp` is in whole seconds, so a shorter ttl could be expired at once.
    """
    if not workspaces:
        raise ValueError("a token must name at least one workspace")
    for workspace in workspaces:
        if workspace != ALL_WORKSPACES and not is_valid_workspace_id(workspace):
            raise ValueError(f"workspace {workspace!r} must be '*' or match [A-Za-z0-9_-]{{1,64}}")
    if ttl is not None and not (math.isfinite(ttl) and ttl >= 1):
        raise ValueError(f"ttl must be a finite number of seconds >= 1, not {ttl!r}")


def mint_token(
    secret: bytes, workspaces: Sequence[str], *, now: float, ttl: float | None = None
) -> str:
    check_grant(workspaces, ttl)
    payload: dict[str, object] = {"ws": sorted(set(workspaces)), "iat": int(now)}
    if ttl is not None:
        payload["exp"] = int(now + ttl)
    body = _b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
    signed_part = f"{_PREFIX}.{body}"
    return f"{signed_part}.{_sign(secret, signed_part)}"


def verify_token(secret: bytes, token: str, *, now: float) -> TokenClaims:
    # A real token is ASCII. Anything else (a `?token=` with percent-encoded UTF-8, a header with
    # bytes aiohttp decodes with surrogateescape) made `compare_digest` raise TypeError, or the
    # signing `.encode()` UnicodeEncodeError: a 500 (on the socket, a failed handshake) instead
    # of 401 / close 4001.
    if not token.isascii():
        raise TokenError("malformed token")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _PREFIX:
        raise TokenError("malformed token")
    signed_part = f"{parts[0]}.{parts[1]}"
    if not hmac.compare_digest(_sign(secret, signed_part), parts[2]):
        raise TokenError("bad token signature")
    try:
        payload = json.loads(_unb64(parts[1]))
    except (ValueError, binascii.Error) as exc:
        raise TokenError("malformed token payload") from exc
    if not isinstance(payload, dict):
        raise TokenError("malformed token payload")
    workspaces, iat, exp = payload.get("ws"), payload.get("iat"), payload.get("exp")
    if not isinstance(workspaces, list) or not all(isinstance(w, str) for w in workspaces):
        raise TokenError("malformed token payload")
    if not isinstance(iat, int) or (exp is not None and not isinstance(exp, int)):
        raise TokenError("malformed token payload")
    if exp is not None and now >= exp:
        raise TokenError("token expired")
    return TokenClaims(frozenset(workspaces), iat, exp)
