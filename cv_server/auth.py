"""Bearer tokens: HMAC-SHA256 signed, naming the workspaces they may touch, what they may do
there and to which sub-docs (docs/operating.md, "Tokens and scopes").

Format: `cvt1.<base64url(JSON payload)>.<base64url(signature)>`, payload
`{"ws": ["w1", ...], "iat": <epoch s>, "exp"?: <epoch s>, "jti"?: <id>, "sc"?: [scopes],
"sd"?: [sub-doc grants]}`; `"*"` in `ws` grants every workspace (operators and shared workers).
A token without `sc` carries every scope and one without `sd` every sub-doc: tokens minted
before scopes existed keep working as they did. One without `jti` cannot be revoked alone (only
by rotating the secret). Pure functions: the secret and `now` are parameters.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from cv_mutations import is_valid_workspace_id
from cv_server.errors import CvServerError
from cv_server.scopes import (
    ALL_SCOPES,
    check_scopes,
    check_sub_doc_grants,
    sub_doc_granted,
)

__all__ = [
    "ALL_WORKSPACES",
    "TOKEN_ID_PATTERN",
    "TokenClaims",
    "TokenError",
    "check_grant",
    "mint_token",
    "new_secret",
    "new_token_id",
    "token_id_expiry",
    "token_id_of",
    "verify_token",
]

_PREFIX: Final = "cvt1"
ALL_WORKSPACES: Final = "*"


class TokenError(CvServerError):
    """The token is missing, malformed, forged or expired."""


#: A token's id: its expiry (epoch seconds, or `never`), `-`, 24 hex digits of randomness. The
#: expiry is in the id so that a revocation by id alone knows when its entry may go.
TOKEN_ID_PATTERN: Final = r"^(never|[0-9]{1,12})-[0-9a-f]{24}$"
_TOKEN_ID_RE: Final = re.compile(TOKEN_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class TokenClaims:
    workspaces: frozenset[str]
    issued_at: int
    expires_at: int | None
    #: What the token may do (`cv_server.scopes.Scope`); every scope for a token minted
    #: before scopes existed.
    scopes: frozenset[str] = ALL_SCOPES
    #: The sub-docs it may read, subscribe to and write (ids and `prefix*`); None: all.
    sub_docs: frozenset[str] | None = None
    #: Its id (`jti`), which `cv-server token revoke` names; None for a token minted before ids.
    token_id: str | None = None

    def allows(self, workspace_id: str) -> bool:
        return ALL_WORKSPACES in self.workspaces or workspace_id in self.workspaces

    def allows_sub_doc(self, sub_doc: str) -> bool:
        return sub_doc_granted(self.sub_docs, sub_doc)

    def has_any_scope(self, accepted: frozenset[str]) -> bool:
        return not self.scopes.isdisjoint(accepted)


def new_token_id(expires_at: int | None) -> str:
    """A fresh token id carrying `expires_at` (`TOKEN_ID_PATTERN`)."""
    return f"{'never' if expires_at is None else expires_at}-{secrets.token_hex(12)}"


def token_id_expiry(token_id: str) -> int | None:
    """The expiry a token id carries (None: never). Raises `ValueError` for a malformed id."""
    if _TOKEN_ID_RE.fullmatch(token_id) is None:
        raise ValueError(f"a token id looks like 1767225600-<24 hex digits>, not {token_id!r}")
    head = token_id.partition("-")[0]
    return None if head == "never" else int(head)


def token_id_of(token: str) -> str:
    """The id inside `token`, read without checking its signature (to revoke it: whoever
    holds the token may name it). Raises `ValueError` for a token without one."""
    parts = token.split(".")
    try:
        payload = json.loads(_unb64(parts[1])) if len(parts) == 3 else None
    except (ValueError, binascii.Error):
        payload = None
    token_id = payload.get("jti") if isinstance(payload, dict) else None
    if not isinstance(token_id, str):
        raise ValueError(
            "this token has no id (minted before ids): only `cv-server rotate-secret` withdraws it"
        )
    return token_id


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, signed_part: str) -> str:
    return _b64(hmac.new(secret, signed_part.encode(), hashlib.sha256).digest())


def check_grant(
    workspaces: Sequence[str],
    ttl: float | None,
    *,
    scopes: Sequence[str] | None = None,
    sub_docs: Sequence[str] | None = None,
) -> None:
    """Raise `ValueError` unless a token for `workspaces` with `ttl`, `scopes` (None: all) and
    `sub_docs` (None: all) can work.

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
    if scopes is not None:
        check_scopes(scopes)
    if sub_docs is not None:
        check_sub_doc_grants(sub_docs)


def mint_token(
    secret: bytes,
    workspaces: Sequence[str],
    *,
    now: float,
    ttl: float | None = None,
    scopes: Iterable[str] | None = None,
    sub_docs: Iterable[str] | None = None,
    token_id: str | None = None,
) -> str:
    """A signed token for `workspaces`: every scope unless `scopes` names some, every sub-doc
    unless `sub_docs` limits it, expiring after `ttl` seconds (None: never).

    Its id is `token_id` (`cv-server token` passes a fresh `new_token_id`), else one derived
    from the rest of the payload: a grant minted twice in one second is the same token, as it
    was before tokens had ids (a caller's per-token state, such as its rate-limit bucket, stays
    one).

    Raises:
        ValueError: a grant that could not work (`check_grant`).
    """
    scope_list = None if scopes is None else sorted(set(scopes))
    grant_list = None if sub_docs is None else sorted(set(sub_docs))
    check_grant(workspaces, ttl, scopes=scope_list, sub_docs=grant_list)
    expires_at = None if ttl is None else int(now + ttl)
    payload: dict[str, object] = {"ws": sorted(set(workspaces)), "iat": int(now)}
    if expires_at is not None:
        payload["exp"] = expires_at
    if scope_list is not None:
        payload["sc"] = scope_list
    if grant_list is not None:
        payload["sd"] = grant_list
    if token_id is None:
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        token_id = f"{'never' if expires_at is None else expires_at}-{digest[:24]}"
    elif _TOKEN_ID_RE.fullmatch(token_id) is None:
        raise ValueError(f"token id {token_id!r} must match {TOKEN_ID_PATTERN}")
    payload["jti"] = token_id
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
    return TokenClaims(
        frozenset(workspaces),
        iat,
        exp,
        scopes=_scopes(payload.get("sc", None)),
        sub_docs=_sub_docs(payload.get("sd", None)),
        token_id=_token_id(payload.get("jti", None)),
    )


def _strings(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TokenError("malformed token payload")
    return value


def _scopes(value: object) -> frozenset[str]:
    # A scope this server does not know grants nothing here (a newer server's token).
    return ALL_SCOPES if value is None else frozenset(_strings(value)) & ALL_SCOPES


def _sub_docs(value: object) -> frozenset[str] | None:
    return None if value is None else frozenset(_strings(value))


def _token_id(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TokenError("malformed token payload")
    return value
