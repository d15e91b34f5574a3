"""The hostile-input fuzz, turned on tokens: Hypothesis draws (route or socket frame, token, sub-doc
grant, target sub-doc) against one real server on loopback per backend, and each answer is held
to the least-privilege matrix of docs/operating.md ("Tokens and scopes"), as
tests/server/http/test_scopes.py writes it out by hand (not the server's own table, which it
would only agree with).

The tokens are what a confused or hostile client holds: one scope or several, an empty scope
set, mixed-case and unknown scope names (signed with the server's secret, as a newer or careless
minter could), sub-doc grants whose prefix another id shares (`notes*` against `notesx`,
`note`), an empty grant, a token of another workspace, none, a forged one, an expired one, a
revoked one. Asserted for every draw: never a 5xx; where the table says no, the refusal and
its code are the stable ones (`unauthorized`, `token_revoked`, `missing_scope`,
`forbidden_sub_doc`, `forbidden_workspace`, or a socket closed 4001 / 4003); where it says
yes, none of those codes; and a refusal changes nothing (the sub-docs' heads, the queue's rows,
the locks, the revocation list are as they were).

Bounded: `EXAMPLES` draws per backend, well under a minute each.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cv_mutations import new_op_id
from cv_server import ServerConfig
from cv_server.auth import mint_token
from cv_server.cli import _with_schema
from cv_server.http.routes import SOCKET_ROUTE
from cv_server.scopes import ALL_SCOPES
from tests.pg.helpers import fresh_schema
from tests.server.conftest import BACKENDS, SECRET
from tests.server.http.test_scopes import EXPECTED_FRAME_SCOPES as FRAME_SCOPES
from tests.server.http.test_scopes import EXPECTED_SCOPES as ROUTE_SCOPES
from tests.server.wire import served

EXAMPLES = 200
WS = "ws1"
#: Target sub-docs: ids that share prefixes with the grants below, and one no grant names.
SUB_DOCS = ("notes", "notesx", "notes.a", "note", "n", "todo", "todo2", "tree")
#: Scope names as a token may carry them: the known ones, and what a server must not read as one.
SCOPE_NAMES = (*sorted(ALL_SCOPES), "READ", "Write", "admin", "*", "")
#: Sub-doc grants as a token may carry them: the minter's forms and what it would refuse.
GRANTS = ("notes*", "notes", "note", "n*", "todo", "*", "NOTES*", "notes.*", "", "todo2*")
#: The refusals a token gets (docs/problems.md).
REFUSALS = {"unauthorized", "token_revoked", "missing_scope", "forbidden_sub_doc"}
REFUSALS_ALL = REFUSALS | {"forbidden_workspace"}
BOUND = 10.0


# -- tokens --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenSpec:
    """A token as drawn. `how`: `minted` (by `mint_token`), `signed` (a payload the minter would
    refuse, signed with the server's secret), `forged`, `expired`, `revoked`, `absent`."""

    how: str
    scopes: tuple[str, ...] | None = None
    grants: tuple[str, ...] | None = None
    workspaces: tuple[str, ...] = (WS,)

    def effective_scopes(self) -> frozenset[str]:
        # A name the server does not know (case included) grants nothing (cv_server.auth).
        return ALL_SCOPES if self.scopes is None else frozenset(self.scopes) & ALL_SCOPES

    def grants_sub_doc(self, sub_doc: str) -> bool:
        if self.grants is None:
            return True
        return any(
            sub_doc == g or (g.endswith("*") and sub_doc.startswith(g[:-1])) for g in self.grants
        )

    def grants_workspace(self, workspace: str) -> bool:
        return "*" in self.workspaces or workspace in self.workspaces


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(payload: dict[str, Any], secret: bytes = SECRET) -> str:
    """A token of the documented format (`cvt1.<payload>.<signature>`, cv_server.auth) for a
    payload `mint_token` would refuse to write."""
    signed_part = "cvt1." + _b64(json.dumps(payload, separators=(",", ":")).encode())
    signature = hmac.new(secret, signed_part.encode(), hashlib.sha256).digest()
    return f"{signed_part}.{_b64(signature)}"


#: A full token whose id the run revokes before the first draw.
REVOKED = mint_token(SECRET, ["*"], now=time.time(), ttl=3600, token_id="never-" + "ab" * 12)
ADMIN = mint_token(SECRET, ["*"], now=time.time(), ttl=3600)


def token_text(spec: TokenSpec) -> str | None:
    now = int(time.time())
    if spec.how == "absent":
        return None
    if spec.how == "revoked":
        return REVOKED
    payload: dict[str, Any] = {"ws": list(spec.workspaces), "iat": now, "exp": now + 3600}
    if spec.scopes is not None:
        payload["sc"] = list(spec.scopes)
    if spec.grants is not None:
        payload["sd"] = list(spec.grants)
    if spec.how == "minted":
        return mint_token(
            SECRET,
            list(spec.workspaces),
            now=now,
            ttl=3600,
            scopes=spec.scopes,
            sub_docs=spec.grants,
        )
    if spec.how == "forged":
        return _signed(payload, secret=b"not-the-servers-secret-0123456789")
    if spec.how == "expired":
        payload["exp"] = now - 5
    return _signed(payload)


#: The grants `mint_token` writes (`cv_server.scopes.SUB_DOC_GRANT_PATTERN`).
_VALID_GRANTS = ("notes*", "notes", "note", "n*", "todo", "*", "todo2*")
_workspaces = st.sampled_from([(WS,), ("*",), ("ws2",)])
_minted = st.builds(
    TokenSpec,
    how=st.just("minted"),
    scopes=st.none() | st.sets(st.sampled_from(sorted(ALL_SCOPES)), min_size=1).map(tuple),
    grants=st.none() | st.sets(st.sampled_from(_VALID_GRANTS), min_size=1).map(tuple),
    workspaces=_workspaces,
)
_signed_spec = st.builds(
    TokenSpec,
    how=st.just("signed"),
    scopes=st.none() | st.lists(st.sampled_from(SCOPE_NAMES), max_size=4).map(tuple),
    grants=st.none() | st.lists(st.sampled_from(GRANTS), max_size=3).map(tuple),
    workspaces=_workspaces,
)
_broken = st.builds(TokenSpec, how=st.sampled_from(["forged", "expired", "revoked", "absent"]))
TOKENS = st.one_of(_minted, _minted, _signed_spec, _signed_spec, _broken)


# -- what the table says -------------------------------------------------------------------------


def expected_http(spec: TokenSpec, method: str, template: str, sub_doc: str) -> str | None:
    """The refusal code the table gives this call, or None where it allows it."""
    required = ROUTE_SCOPES[(method, template)]
    if not required:
        return None
    if spec.how in ("absent", "forged", "expired"):
        return "unauthorized"
    if spec.how == "revoked":
        return "token_revoked"
    if not spec.effective_scopes() & required:
        return "missing_scope"
    if "{sub_doc}" in template and not spec.grants_sub_doc(sub_doc):
        return "forbidden_sub_doc"
    if template == "/v1/tokens/{token_id}/revoke" and "*" not in spec.workspaces:
        return "forbidden_workspace"
    # The listing asks for `?workspace=ws1` and the batch completion names a ws1 request.
    named_ws = "{ws}" in template or template in ("/v1/queue/requests", "/v1/queue/complete")
    if named_ws and not spec.grants_workspace(WS):
        return "forbidden_workspace"
    return None


def expected_frame(spec: TokenSpec, kind: str, sub_doc: str) -> int | str | None:
    """The socket's answer to one frame: a close code (the handshake's), an error frame's code,
    or None (allowed)."""
    if spec.how in ("absent", "forged", "expired", "revoked"):
        return 4001
    scopes = spec.effective_scopes()
    if not spec.grants_workspace(WS) or not scopes & frozenset(FRAME_SCOPES.values()):
        return 4003
    if FRAME_SCOPES[kind] not in scopes:
        return "missing_scope"
    if not spec.grants_sub_doc(sub_doc):
        return "forbidden_sub_doc"
    return None


# -- the server and its state --------------------------------------------------------------------


@dataclass
class Fixture:
    """What each draw aims at: a queued request (worker class `q`) and one claimed (with its
    claim token), fresh for the draw."""

    queued: str
    claimed: str
    claim_token: str


class Run:
    def __init__(self, loop: asyncio.AbstractEventLoop, base: str) -> None:
        self.loop = loop
        self.base = base
        self.session: aiohttp.ClientSession | None = None
        self.serial = 0

    def call(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, 60))

    async def http(
        self,
        method: str,
        path: str,
        token: str | None,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, str | None, Any]:
        assert self.session is not None
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        kwargs: dict[str, Any] = {"headers": sent, "timeout": aiohttp.ClientTimeout(BOUND)}
        if body is not None:
            kwargs["json"] = body
        async with self.session.request(method, self.base + path, **kwargs) as answer:
            raw = await answer.read()
            data: Any = json.loads(raw) if answer.content_type.endswith("json") and raw else None
            problem = answer.content_type == "application/problem+json"
            code = data["code"] if problem else None
            return answer.status, code, data

    async def fixture(self) -> Fixture:
        self.serial += 1
        n = self.serial
        base = f"/v1/workspaces/{WS}/requests"
        status, _, queued = await self.http(
            "POST", base, ADMIN, {"stage": "s", "worker_class": "q"}
        )
        assert status == 202, queued
        status, _, claimed = await self.http(
            "POST", base, ADMIN, {"stage": "s", "worker_class": f"c{n}"}
        )
        assert status == 202, claimed
        status, _, got = await self.http(
            "POST", "/v1/queue/claim", ADMIN, {"worker_classes": [f"c{n}"], "worker_id": "w"}
        )
        assert status == 200, got
        assert got["request"]["request_id"] == claimed["request_id"]
        return Fixture(queued["request_id"], claimed["request_id"], got["request"]["claim_token"])

    async def state(self) -> Any:
        """Everything a wrongly allowed call could change, read with a full token."""
        _, _, docs = await self.http("GET", f"/v1/workspaces/{WS}/docs?limit=1000", ADMIN)
        _, _, rows = await self.http("GET", f"/v1/queue/requests?workspace={WS}&limit=1000", ADMIN)
        _, _, locks = await self.http("GET", f"/v1/workspaces/{WS}/locks?limit=1000", ADMIN)
        # What only the clock changes is left out.
        for row in rows["requests"]:
            row.pop("unclaimed_seconds", None)
        for lock in locks["locks"]:
            lock.pop("expires_in", None)
        return docs, rows["requests"], locks


def _call_of(
    method: str, template: str, sub_doc: str, target: str, fx: Fixture, serial: int
) -> tuple[str, Any, dict[str, str]]:
    """The path, body and headers a client that means it would send."""
    request_id = fx.claimed if target == "claimed" else fx.queued
    path = (
        template.replace("{ws}", WS)
        .replace("{sub_doc}", sub_doc)
        .replace("{id}", request_id)
        .replace("{ref}", "blob-1")
        .replace("{token_id}", f"never-{serial:024x}")
        .replace("{name}", "dashboard.js")
    )
    holder = {"claim_token": fx.claim_token}
    body: Any = {}
    headers: dict[str, str] = {}
    if method == "GET":
        query = {
            "/v1/queue/pending": "?worker_classes=q&timeout=0",
            "/v1/queue/requests": f"?workspace={WS}",
        }
        return path + query.get(template, "?timeout=0"), None, headers
    if template.endswith("/docs/{sub_doc}/ops"):
        body = {"ops": [{"type": "node.insert", "node_id": new_op_id(), "parent_id": "root"}]}
    elif template.endswith("/requests"):
        body = {"stage": "s", "worker_class": "q"}
    elif template.endswith("/requests/batch"):
        body = {"requests": [{"stage": "s", "worker_class": "q"}]}
    elif template == "/v1/queue/claim":
        body = {"worker_classes": ["q"], "worker_id": "w"}
    elif template == "/v1/queue/complete":
        body = {"completions": [{"request_id": fx.claimed, **holder, "result": 1}]}
    elif template.endswith(("/heartbeat", "/complete")):
        body = {**holder, "result": 1}
    elif template.endswith("/fail"):
        body = {**holder, "error": "x"}
    elif template.endswith("/result"):
        body, headers = {"k": 1}, {"Claim-Token": fx.claim_token}
    elif "/locks/" in template:
        body = {"job_id": "j", "task": f"t{serial}", "holder": "h"}
    return path, body, headers


async def _frame_answer(
    run: Run, token: str | None, kind: str, sub_doc: str
) -> tuple[int | str | None, Any]:
    """Send one frame on a fresh socket: the close code, or the error frame's code, or None for
    the frame's own answer (`synced` / `ack`)."""
    assert run.session is not None
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with run.session.ws_connect(
        f"{run.base}/v1/workspaces/{WS}/socket", headers=headers
    ) as ws:
        frame: dict[str, Any] = {"type": kind, "sub_doc": sub_doc, "req": "r"}
        if kind == "apply":
            frame["ops"] = [{"type": "node.insert", "node_id": new_op_id(), "parent_id": "root"}]
        if not ws.closed:
            with suppress(ConnectionResetError):
                await ws.send_json(frame)
        async with asyncio.timeout(BOUND):
            while True:
                msg = await ws.receive()
                if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    return ws.close_code, msg.extra
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                answer = msg.json()
                if answer["type"] == "synced" and answer["sub_doc"] == sub_doc:
                    return None, answer  # a subscription's answer names its sub-doc, no req
                if answer.get("req") != "r":
                    continue
                if answer["type"] == "error":
                    return answer["code"], answer
                assert answer["type"] in ("synced", "ack"), answer
                if answer["type"] == "ack":
                    assert all("clock" in r for r in answer["results"]), answer
                return None, answer


# -- the run -------------------------------------------------------------------------------------


@contextmanager
def _served(config_of: Callable[[AsyncExitStack], Any]) -> Iterator[Run]:
    """One real server on loopback for the whole Hypothesis run, on an event loop that runs while
    a draw waits on it."""
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        config = loop.run_until_complete(config_of(stack))
        server = loop.run_until_complete(stack.enter_async_context(served(config)))
        run = Run(loop, f"http://127.0.0.1:{server.port}")

        async def session() -> aiohttp.ClientSession:
            return await stack.enter_async_context(aiohttp.ClientSession())

        run.session = loop.run_until_complete(session())
        yield run
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_token_is_allowed_what_the_scope_table_refuses_it_and_a_refusal_changes_nothing(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    async def config_of(stack: AsyncExitStack) -> ServerConfig:
        if backend == "sqlite":
            return ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET)
        url: str = request.getfixturevalue("postgres_url")
        schema = await stack.enter_async_context(fresh_schema(url))
        return ServerConfig(database_url=_with_schema(url, schema), token_secret=SECRET)

    with _served(config_of) as run:
        document = run.call(run.http("GET", "/openapi.json", None))[2]
        operations = sorted(
            (method.upper(), path)
            for path, item in document["paths"].items()
            for method in item
            if (method.upper(), path) != SOCKET_ROUTE and ROUTE_SCOPES[(method.upper(), path)]
        )
        # The document was read, and every scoped route of the table is drawn from.
        assert set(operations) == {k for k, v in ROUTE_SCOPES.items() if v} - {SOCKET_ROUTE}
        revoked = run.call(run.http("POST", "/v1/tokens/never-" + "ab" * 12 + "/revoke", ADMIN))
        assert revoked[0] == 200, revoked
        targets = st.sampled_from(operations) | st.sampled_from(
            [("frame", kind) for kind in ("subscribe", "apply")]
        )
        seen: dict[str, int] = {}

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(
            target=targets,
            spec=TOKENS,
            sub_doc=st.sampled_from(SUB_DOCS),
            aim=st.sampled_from(["queued", "claimed"]),
        )
        def draw(target: tuple[str, str], spec: TokenSpec, sub_doc: str, aim: str) -> None:
            fx = run.call(run.fixture())
            before = run.call(run.state())
            token = token_text(spec)
            where = f"{target} {spec} {sub_doc} {aim}"
            if target[0] == "frame":
                want = expected_frame(spec, target[1], sub_doc)
                got, detail = run.call(_frame_answer(run, token, target[1], sub_doc))
                assert got == want, (where, detail)
                refused = want is not None
            else:
                method, template = target
                path, body, headers = _call_of(method, template, sub_doc, aim, fx, run.serial)
                status, code, data = run.call(run.http(method, path, token, body, headers))
                assert status < 500, (where, status, data)
                want_code = expected_http(spec, method, template, sub_doc)
                if want_code is None:
                    assert code not in REFUSALS_ALL, (where, status, data)
                else:
                    want_status = 401 if want_code in ("unauthorized", "token_revoked") else 403
                    assert (status, code) == (want_status, want_code), (where, data)
                refused = want_code is not None
                if refused and template == "/v1/tokens/{token_id}/revoke":
                    again = run.call(run.http("POST", path, ADMIN))
                    assert again[2]["newly"] is True, (where, again)  # it was not revoked
            outcome = "refused" if refused else "allowed"
            seen[outcome] = seen.get(outcome, 0) + 1
            if refused:
                assert run.call(run.state()) == before, where

        draw()
        # The draws exercised both sides of the table.
        assert seen.get("refused", 0) > EXAMPLES // 4, seen
        assert seen.get("allowed", 0) > 5, seen
