"""`authenticate` on one request: the middlewares and the handler each ask, the token is read
and verified once, and expiry and revocation are judged on every ask all the same."""

from __future__ import annotations

import time
import warnings

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from cv_server.auth import mint_token
from cv_server.http import security
from cv_server.http.problems import Problem
from cv_server.http.security import _verified, authenticate, authenticated_token
from cv_server.keys import REVOKED_TOKENS, TOKEN_SECRET
from cv_server.revocations import Revocation, RevokedTokens
from cv_server.secret import TokenSecret

SECRET = b"authenticate-once-secret-0123456789"


def _request(token: str) -> tuple[web.Request, RevokedTokens]:
    app = web.Application()
    revoked = RevokedTokens()
    with warnings.catch_warnings():  # an app's state set after its creation, as tests do
        warnings.simplefilter("ignore")
        app[TOKEN_SECRET] = TokenSecret(SECRET)
        app[REVOKED_TOKENS] = revoked
    request = make_mocked_request(
        "POST", "/v1/queue/claim", headers={"Authorization": f"Bearer {token}"}, app=app
    )
    return request, revoked


def test_a_request_reads_and_verifies_its_token_once_however_often_it_is_asked() -> None:
    token = mint_token(SECRET, ["ws1"], now=time.time())
    request, _ = _request(token)
    before = _verified.cache_info()
    claims = [authenticate(request) for _ in range(3)]
    after = _verified.cache_info()
    assert (after.hits + after.misses) - (before.hits + before.misses) == 1
    assert claims[0] == claims[1] == claims[2]
    assert authenticated_token(request) == (token, claims[0])


def test_a_token_revoked_between_two_asks_is_refused_at_the_second() -> None:
    token = mint_token(SECRET, ["ws1"], now=time.time(), token_id="never-0123456789abcdef01234567")
    request, revoked = _request(token)
    authenticate(request)
    revoked.add([Revocation(seq=1, token_id="never-0123456789abcdef01234567", expires_at=None)])
    with pytest.raises(Problem) as refused:
        authenticate(request)
    assert (refused.value.status, refused.value.code) == (401, "token_revoked")


def test_a_token_expiring_between_two_asks_is_refused_at_the_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = mint_token(SECRET, ["ws1"], now=time.time(), ttl=60)
    request, _ = _request(token)
    authenticate(request)
    monkeypatch.setattr(security, "now", lambda: time.time() + 120)
    with pytest.raises(Problem) as refused:
        authenticate(request)
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")


def test_a_refusal_is_not_kept_and_each_way_of_looking_finds_its_own_token() -> None:
    request, _ = _request("not-a-token")
    for _ in range(2):
        with pytest.raises(Problem):
            authenticate(request)
    query_token = mint_token(SECRET, ["ws1"], now=time.time())
    request = make_mocked_request(
        "GET", f"/v1/workspaces/ws1/socket?token={query_token}", app=request.app
    )
    with pytest.raises(Problem):
        authenticate(request)  # a token in the URL counts only where the route allows it
    assert authenticated_token(request, allow_query=True)[0] == query_token
