"""The OpenAPI document: generated from the routes and their models, every route in it with
its answers and problem codes, checked in without drift, served as JSON and as an offline page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from jsonschema import Draft202012Validator

from cv_server import ServerConfig, create_app
from cv_server.api_schema import main
from cv_server.http.openapi import (
    OPENAPI_PATH,
    Doc,
    build_document,
    documented,
    render_document,
    undocumented_routes,
)
from cv_server.http.problems import CODES


def _app(tmp_path: Path) -> web.Application:
    return create_app(ServerConfig(db_path=tmp_path / "cv.db", token_secret=b"s" * 32))


def test_the_checked_in_document_is_what_the_routes_generate(tmp_path: Path) -> None:
    assert OPENAPI_PATH.read_text("utf-8") == render_document(build_document(_app(tmp_path)))


def test_the_check_command_reports_drift_and_write_repairs_it(tmp_path: Path) -> None:
    target = tmp_path / "openapi.json"
    assert main(["--check", "--path", str(target)]) == 1  # missing
    assert main(["--write", "--path", str(target)]) == 0
    assert main(["--check", "--path", str(target)]) == 0
    target.write_text(target.read_text("utf-8").replace('"3.1.0"', '"3.0.0"'), "utf-8")
    assert main(["--check", "--path", str(target)]) == 1


def test_every_route_is_documented_and_a_new_one_is_named_until_it_is(tmp_path: Path) -> None:
    app = _app(tmp_path)
    assert undocumented_routes(app) == []

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({})

    app.router.add_get("/v1/new/{ws}/thing", handler)
    assert undocumented_routes(app) == ["GET /v1/new/{ws}/thing"]
    documented(Doc("A new thing", {200: None}))(handler)
    assert undocumented_routes(app) == []
    operation = build_document(app)["paths"]["/v1/new/{ws}/thing"]["get"]
    # the codes every route under a workspace can answer come with it
    assert _codes(operation, "403") == ["forbidden_workspace", "missing_scope"]
    assert _codes(operation, "401") == ["token_revoked", "unauthorized"]
    assert operation["parameters"][0]["name"] == "ws"


def _codes(operation: dict[str, Any], status: str) -> list[str]:
    answer = operation["responses"][status]
    schema = answer["content"]["application/problem+json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ProblemDetails"}
    codes: list[str] = answer["x-problem-codes"]
    return codes


def test_every_operation_has_answers_problems_and_valid_schemas(tmp_path: Path) -> None:
    document = build_document(_app(tmp_path))
    assert document["openapi"] == "3.1.0"
    for schema in document["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    seen: set[str] = set()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            statuses = set(operation["responses"])
            assert statuses & {"101", "200", "201", "202", "204"}, (method, path)
            assert "500" in statuses, (method, path)
            for status in statuses - {"101", "200", "201", "202", "204"}:
                codes = _codes(operation, status)
                assert set(codes) <= set(CODES), (method, path, codes)
                seen.update(codes)
            if "requestBody" in operation:
                assert {"400", "413", "415", "422"} <= statuses, (method, path)
    # Every HTTP code the server answers with is on some route (the websocket's own frame
    # codes and ones no route answers yet aside).
    websocket_frames_only = {"unknown_message_type", "too_many_subscriptions"}
    assert set(CODES) - seen <= {*websocket_frames_only, "method_not_allowed"}


async def test_the_document_and_the_page_are_served(aiohttp_client: Any, tmp_path: Path) -> None:
    client: TestClient[Any, Any] = await aiohttp_client(_app(tmp_path))
    resp = await client.get("/openapi.json")
    assert resp.status == 200
    served = await resp.json()
    assert served == json.loads(OPENAPI_PATH.read_text("utf-8"))
    resp = await client.get("/docs")
    assert resp.status == 200
    assert resp.content_type == "text/html"
    page = await resp.text()
    for path in served["paths"]:
        assert f"<code>{path}</code>" in page
    assert "<script" not in page
    # offline: nothing fetched from elsewhere (its only link is the document itself)
    assert "src=" not in page
    assert "href='http" not in page
    assert 'href="http' not in page
