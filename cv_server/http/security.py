"""Bearer-token checks for routes and the socket (docs/operating.md), and the secret they check
with."""

from __future__ import annotations

import functools
import logging
import time
from typing import Final

from aiohttp import web

from cv_server.auth import TokenClaims, TokenError, verify_token
from cv_server.http.problems import Problem
from cv_server.keys import REVOKED_TOKENS, TOKEN_SECRET

__all__ = [
    "BEARER_SUBPROTOCOL_PREFIX",
    "SOCKET_SUBPROTOCOL",
    "authenticate",
    "authenticated_token",
    "authorize",
    "bearer_token",
    "check_sub_doc",
    "missing_scope",
    "seconds_left",
    "signed_with",
]

log = logging.getLogger(__name__)


#: The websocket subprotocol the server speaks, and answers a browser's handshake with.
SOCKET_SUBPROTOCOL = "cv-workspace.v1"
#: How a browser passes its token on the websocket handshake, where it cannot set headers:
#: `new WebSocket(url, ["cv-workspace.v1", "cv-bearer." + token])`. A token is ASCII letters,
#: digits, `-`, `_` and `.`, all valid in a subprotocol name. Unlike `?token=`, the header stays
#: out of URLs, so out of access logs, proxies' logs and the browser's history; the server never
#: echoes it (its answer names `cv-workspace.v1`).
BEARER_SUBPROTOCOL_PREFIX = "cv-bearer."


def bearer_token(
    request: web.Request, *, allow_query: bool = False, allow_subprotocol: bool = False
) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    if allow_subprotocol:
        for offered in request.headers.getall("Sec-WebSocket-Protocol", ()):
            for protocol in offered.split(","):
                protocol = protocol.strip()
                if protocol.startswith(BEARER_SUBPROTOCOL_PREFIX):
                    return protocol.removeprefix(BEARER_SUBPROTOCOL_PREFIX) or None
    if allow_query:  # older clients only: a token never travels in a URL (docs/protocol.md)
        return request.query.get("token")
    return None


#: The clock expiry is checked against (a module attribute so tests can move it).
now = time.time


@functools.lru_cache(maxsize=4096)
def _verified(secret: bytes, token: str) -> TokenClaims:
    """Signature and payload checks, cached: a client sends the same token on every request,
    and decoding + HMAC was ~14% of a single-op request's CPU. Expiry is checked on every use
    (below), never cached; failures are not cached, so forged tokens cannot evict good ones."""
    return verify_token(secret, token, now=float("-inf"))


#: The token each way of looking found on this request, and its verified claims: the scope and
#: rate-limit middlewares and the handler each authenticate, and the header's parse and the
#: signature cache's lookup are paid once per request. Expiry and revocation are checked on
#: every call all the same; a refusal is never kept.
_FOUND: Final = web.RequestKey("authenticated_tokens", dict)


def authenticate(
    request: web.Request, *, allow_query: bool = False, allow_subprotocol: bool = False
) -> TokenClaims:
    """The claims of the request's bearer token; 401 problem if it has none that holds."""
    return authenticated_token(
        request, allow_query=allow_query, allow_subprotocol=allow_subprotocol
    )[1]


def authenticated_token(
    request: web.Request, *, allow_query: bool = False, allow_subprotocol: bool = False
) -> tuple[str, TokenClaims]:
    """`authenticate`, with the token it took."""
    found: dict[tuple[bool, bool], tuple[str, TokenClaims]] | None = request.get(_FOUND)
    known = None if found is None else found.get((allow_query, allow_subprotocol))
    if known is None:
        token = bearer_token(request, allow_query=allow_query, allow_subprotocol=allow_subprotocol)
        if token is None:
            raise Problem(401, "unauthorized", "a bearer token is required")
        try:
            claims = _verified(request.app[TOKEN_SECRET].value, token)
        except TokenError as exc:
            raise Problem(401, "unauthorized", str(exc)) from None
    else:
        token, claims = known
    if claims.expires_at is not None and now() >= claims.expires_at:
        raise Problem(401, "unauthorized", "token expired")
    if claims.token_id is not None and claims.token_id in request.app[REVOKED_TOKENS]:
        raise Problem(401, "token_revoked", f"token {claims.token_id} was revoked")
    if known is None:
        if found is None:
            found = request[_FOUND] = {}
        found[allow_query, allow_subprotocol] = (token, claims)
    return token, claims


def signed_with(secret: bytes, token: str) -> bool:
    """Whether `token` carries a valid signature (and payload) of `secret`; expiry aside."""
    try:
        _verified(secret, token)
    except TokenError:
        return False
    return True


def authorize(request: web.Request, workspace_id: str) -> TokenClaims:
    """Authenticate and check the token grants `workspace_id`; raises 401/403 problems."""
    claims = authenticate(request)
    if not claims.allows(workspace_id):
        raise Problem(403, "forbidden_workspace", f"the token does not grant {workspace_id!r}")
    return claims


def seconds_left(claims: TokenClaims) -> float | None:
    """Seconds until `claims` expire, on the clock `authenticate` checks (None: never). For
    what outlives one check, as a socket outlives its handshake."""
    return None if claims.expires_at is None else claims.expires_at - now()


def missing_scope(accepted: frozenset[str]) -> Problem:
    """The refusal of a token holding none of `accepted`."""
    names = sorted(accepted)
    return Problem(
        403,
        "missing_scope",
        f"the token lacks the {' or '.join(repr(n) for n in names)} scope this needs",
        required_scopes=names,
    )


def check_sub_doc(claims: TokenClaims, sub_doc: str) -> None:
    """Raise `403 forbidden_sub_doc` unless the token's grant covers `sub_doc`."""
    if not claims.allows_sub_doc(sub_doc):
        raise Problem(
            403,
            "forbidden_sub_doc",
            f"the token does not grant sub-doc {sub_doc!r}",
            sub_doc=sub_doc,
        )
