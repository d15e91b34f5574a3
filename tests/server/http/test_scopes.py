"""Every route and every websocket frame kind, walked with a token of each single scope and with
a sub-doc-limited token, on both backends: allowed, or 403 with a stable code
(docs/operating.md, "Tokens and scopes"). Routes come from the live OpenAPI document, so a new
route is walked as soon as it is served."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient

from cv_server.app import create_app
from cv_server.auth import mint_token
from cv_server.config import ServerConfig
from cv_server.http.routes import ROUTE_SCOPES, SOCKET_ROUTE, render_scope_table, unscoped_routes
from cv_server.http.socket import FRAME_SCOPES
from cv_server.scopes import ALL_SCOPES
from tests.server.conftest import SECRET
from tests.server.helpers import insert

WS = "ws1"
#: A value for each path parameter: `{sub_doc}` is `tree` (outside the limited token's grant).
_VALUES = {
    "ws": WS,
    "sub_doc": "tree",
    "id": "req-1",
    "ref": "blob-1",
    "token_id": "never-" + "0" * 24,
    "name": "dashboard.js",
}


_W = "/v1/workspaces/{ws}"
#: The least-privilege matrix of docs/operating.md ("Tokens and scopes"), written out by hand:
#: the walks below hold the server to it, not to its own table, so a route given a wider scope
#: (a `read` token that may replay, an `enqueue` token that may claim) fails here even when the
#: rendered page and the OpenAPI document were regenerated with it.
EXPECTED_SCOPES: dict[tuple[str, str], frozenset[str]] = {
    **dict.fromkeys(
        [("GET", f"{_W}/docs/{{sub_doc}}"), ("GET", f"{_W}/docs/{{sub_doc}}/ops")],
        frozenset({"read"}),
    ),
    ("GET", f"{_W}/docs"): frozenset({"read"}),
    ("POST", f"{_W}/docs/{{sub_doc}}/ops"): frozenset({"write"}),
    ("GET", f"{_W}/socket"): frozenset({"read", "write"}),
    **dict.fromkeys(
        [("POST", f"{_W}/requests"), ("POST", f"{_W}/requests/batch")], frozenset({"enqueue"})
    ),
    **dict.fromkeys(
        [
            ("GET", f"{_W}/requests/{{id}}"),
            ("GET", f"{_W}/requests/{{id}}/stream"),
            ("POST", f"{_W}/requests/{{id}}/cancel"),
            ("GET", f"{_W}/blobs/{{ref}}"),
        ],
        frozenset({"enqueue", "operate"}),
    ),
    **dict.fromkeys(
        [("POST", f"{_W}/schedules"), ("POST", f"{_W}/schedules/{{name}}/run")],
        frozenset({"enqueue"}),
    ),
    **dict.fromkeys(
        [
            ("GET", f"{_W}/schedules"),
            ("GET", f"{_W}/schedules/{{name}}"),
            ("DELETE", f"{_W}/schedules/{{name}}"),
            ("POST", f"{_W}/schedules/{{name}}/pause"),
            ("POST", f"{_W}/schedules/{{name}}/resume"),
        ],
        frozenset({"enqueue", "operate"}),
    ),
    **dict.fromkeys(
        [
            ("POST", "/v1/queue/claim"),
            ("GET", "/v1/queue/pending"),
            ("GET", "/v1/queue/channel"),  # the worker channel (a websocket)
            ("POST", "/v1/queue/complete"),
            *[
                ("POST", f"{_W}/requests/{{id}}/{verb}")
                for verb in ("heartbeat", "complete", "fail", "result")
            ],
            ("POST", f"{_W}/requests/{{id}}/docs/{{sub_doc}}/ops"),  # a stage's writes
            ("POST", f"{_W}/locks/acquire"),
            ("POST", f"{_W}/locks/release"),
        ],
        frozenset({"work"}),
    ),
    **dict.fromkeys(
        [
            ("GET", "/v1/queue/requests"),
            ("POST", f"{_W}/requests/{{id}}/replay"),
            ("POST", f"{_W}/requests/{{id}}/discard"),
            ("GET", f"{_W}/locks"),
            ("POST", "/v1/tokens/{token_id}/revoke"),
        ],
        frozenset({"operate"}),
    ),
    **dict.fromkeys(
        [
            ("GET", path)
            for path in (
                "/healthz",
                "/readyz",
                "/metrics",
                "/openapi.json",
                "/docs",
                "/dashboard",
                "/dashboard/{name}",
            )
        ],
        frozenset(),
    ),
}
EXPECTED_FRAME_SCOPES = {"subscribe": "read", "unsubscribe": "read", "apply": "write"}


def _token(*scopes: str, sub_docs: list[str] | None = None, ws: str = WS) -> str:
    return mint_token(
        SECRET, [ws], now=time.time(), ttl=600, scopes=scopes or None, sub_docs=sub_docs
    )


def _path(template: str, **values: str) -> str:
    path = template
    for name, value in {**_VALUES, **values}.items():
        path = path.replace("{" + name + "}", value)
    return path


async def _operations(server: TestClient[Any, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    document = await (await server.get("/openapi.json")).json()
    return [
        (method.upper(), path, op)
        for path, item in document["paths"].items()
        for method, op in item.items()
        if (method.upper(), path) != SOCKET_ROUTE
    ]


async def _call(server: TestClient[Any, Any], method: str, path: str, token: str) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    kwargs: dict[str, Any] = {"headers": headers}
    if method == "POST":
        kwargs["json"] = {}
    async with server.request(method, path, **kwargs) as answer:
        body = await answer.read()
        code = None
        if answer.content_type == "application/problem+json":
            code = (await answer.json())["code"]
        return answer.status, code, body


def test_every_route_of_the_app_has_a_scope_and_the_socket_matches_its_frames() -> None:
    app = create_app(ServerConfig(token_secret=SECRET))
    assert unscoped_routes(app) == []
    assert dict(ROUTE_SCOPES) == EXPECTED_SCOPES
    assert FRAME_SCOPES == EXPECTED_FRAME_SCOPES
    assert ROUTE_SCOPES[SOCKET_ROUTE] == frozenset(FRAME_SCOPES.values())
    assert all(scopes <= ALL_SCOPES for scopes in ROUTE_SCOPES.values())


async def test_every_route_allows_exactly_its_scopes_and_refuses_others_with_missing_scope(
    server: TestClient[Any, Any],
) -> None:
    operations = await _operations(server)
    assert {(m, t) for m, t, _ in operations} | {SOCKET_ROUTE} == set(EXPECTED_SCOPES)
    for method, template, op in operations:
        required = set(EXPECTED_SCOPES[(method, template)])
        assert set(op.get("x-required-scope", [])) == required, (method, template)
        assert op["security"] == ([{"bearer": sorted(required)}] if required else [])
        assert (not required) == (ROUTE_SCOPES[(method, template)] == frozenset())
        for scope in sorted(ALL_SCOPES):
            status, code, body = await _call(server, method, _path(template), _token(scope))
            where = f"{method} {template} with {scope}: {status} {body[:200]!r}"
            assert status < 500, where
            if required and scope not in required:
                assert (status, code) == (403, "missing_scope"), where
            else:
                assert code not in ("missing_scope", "forbidden_sub_doc", "unauthorized"), where


async def test_a_sub_doc_limited_token_is_refused_outside_its_grant_on_every_sub_doc_route(
    server: TestClient[Any, Any],
) -> None:
    limited = _token(*sorted(ALL_SCOPES), sub_docs=["notes*", "todo"])
    for method, template, _op in await _operations(server):
        if "{sub_doc}" not in template:
            continue
        status, code, body = await _call(server, method, _path(template), limited)
        assert (status, code) == (403, "forbidden_sub_doc"), f"{method} {template}: {body!r}"
        for granted in ("notes.2024", "notes", "todo"):
            path = _path(template, sub_doc=granted)
            status, code, body = await _call(server, method, path, limited)
            assert status < 500, (path, body)
            assert code not in ("forbidden_sub_doc", "missing_scope"), (path, body)


async def test_a_listing_shows_a_limited_token_only_its_granted_sub_docs(
    server: TestClient[Any, Any],
) -> None:
    full = {"Authorization": f"Bearer {_token()}"}
    for sub_doc in ("alpha", "notes.a", "notes.b", "todo"):
        answer = await server.post(
            f"/v1/workspaces/{WS}/docs/{sub_doc}/ops", json={"ops": [insert("n")]}, headers=full
        )
        assert answer.status == 200
    limited = {"Authorization": f"Bearer {_token('read', sub_docs=['notes*'])}"}
    listing = await (await server.get(f"/v1/workspaces/{WS}/docs", headers=limited)).json()
    assert [d["sub_doc"] for d in listing["docs"]] == ["notes.a", "notes.b"]


async def _frame(ws: Any) -> dict[str, Any]:
    msg = await ws.receive(timeout=10)
    assert msg.type == WSMsgType.TEXT, msg
    frame: dict[str, Any] = msg.json()
    return frame


async def test_every_socket_frame_kind_needs_its_scope_and_a_refusal_keeps_the_socket(
    server: TestClient[Any, Any],
) -> None:
    path = f"/v1/workspaces/{WS}/socket"
    for scope in sorted(ALL_SCOPES):
        ws = await server.ws_connect(path, headers={"Authorization": f"Bearer {_token(scope)}"})
        if scope not in EXPECTED_SCOPES[SOCKET_ROUTE]:
            msg = await ws.receive(timeout=10)
            assert (msg.type, ws.close_code) == (WSMsgType.CLOSE, 4003), (scope, msg)
            continue
        for kind, needed in EXPECTED_FRAME_SCOPES.items():
            frame: dict[str, Any] = {"type": kind, "sub_doc": "tree", "req": kind}
            if kind == "apply":
                frame["ops"] = [insert(f"n-{scope}")]
            await ws.send_json(frame)
            if scope != needed:
                answer = await _frame(ws)
                assert answer["type"] == "error", (scope, kind, answer)
                assert answer["code"] == "missing_scope", (scope, kind, answer)
                assert answer["req"] == kind
                assert answer["sub_doc"] == "tree"
            elif kind == "apply":
                answer = await _frame(ws)
                assert (answer["type"], answer["req"]) == ("ack", "apply"), answer
        await ws.send_json({"type": "unsubscribe", "sub_doc": "nothing"})
        assert not ws.closed
        await ws.close()


async def test_a_socket_with_several_subscriptions_loses_only_the_one_outside_its_grant(
    server: TestClient[Any, Any],
) -> None:
    full = {"Authorization": f"Bearer {_token()}"}
    for sub_doc in ("notes.a", "tree"):
        await server.post(
            f"/v1/workspaces/{WS}/docs/{sub_doc}/ops", json={"ops": [insert("n")]}, headers=full
        )
    limited = _token("read", "write", sub_docs=["notes*"])
    ws = await server.ws_connect(
        f"/v1/workspaces/{WS}/socket", headers={"Authorization": f"Bearer {limited}"}
    )
    await ws.send_json({"type": "subscribe", "sub_doc": "notes.a", "req": 1})
    await ws.send_json({"type": "subscribe", "sub_doc": "tree", "req": 2})
    await ws.send_json({"type": "apply", "sub_doc": "tree", "req": 3, "ops": [insert("m")]})
    seen: list[dict[str, Any]] = []
    while not any(f.get("type") == "error" and f.get("req") == 3 for f in seen):
        seen.append(await _frame(ws))
    errors = [(f["req"], f["code"], f["sub_doc"]) for f in seen if f["type"] == "error"]
    assert errors == [(2, "forbidden_sub_doc", "tree"), (3, "forbidden_sub_doc", "tree")]
    # The granted subscription lives on: a write to it arrives on this socket.
    await ws.send_json({"type": "apply", "sub_doc": "notes.a", "req": 4, "ops": [insert("x")]})
    kinds: set[str] = set()
    while not {"ack", "op"} <= kinds:
        frame = await _frame(ws)
        kinds.add(frame["type"])
        assert frame["type"] != "error", frame
    assert not ws.closed
    await ws.close()


def test_the_scope_table_of_docs_operating_is_the_servers_own() -> None:
    page = Path(__file__).resolve().parents[3] / "docs" / "operating.md"
    text = page.read_text("utf-8")
    generated = text.split("<!-- scopes:begin -->\n", 1)[1].split("<!-- scopes:end -->", 1)[0]
    assert generated == render_scope_table()
