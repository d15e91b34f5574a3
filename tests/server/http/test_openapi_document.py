"""What the OpenAPI document tells a client's generator: problems it can parse, optional members
that are optional, every header and answer the server really sends, a server and a license
(docs/observability.md, "The API document"; docs/protocol.md, "Headers"). The generators and the
linter themselves run in tests/outside/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.http.openapi import build_document
from cv_server.http.ratelimit import ROUTE_CLASS_OF
from tests.server.conftest import SECRET, ClientFactory, auth
from tests.server.helpers import insert

REPO = Path(__file__).resolve().parents[3]
PROBLEM = {"$ref": "#/components/schemas/ProblemDetails"}
SUCCESS = {"101", "200", "201", "202", "204"}


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    db = tmp_path_factory.mktemp("openapi") / "cv.db"
    return build_document(create_app(ServerConfig(db_path=db, token_secret=SECRET)))


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def _problem_answers(operation: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for status, answer in operation["responses"].items():
        if status not in SUCCESS:
            yield status, answer


def test_every_problem_answer_is_plain_problem_details_with_its_codes_listed(
    document: dict[str, Any],
) -> None:
    # `allOf: [ProblemDetails, {status: const}, {code: enum}]` made openapi-python-client drop
    # every error answer (`int can't be merged with Literal[400]`): the codes go beside it.
    for path, method, operation in _operations(document):
        for status, answer in _problem_answers(operation):
            schema = answer["content"]["application/problem+json"]["schema"]
            assert schema == PROBLEM, (method, path, status)
            codes = answer["x-problem-codes"]
            assert codes, (method, path, status)
            assert all(f"`{code}`" in answer["description"] for code in codes)


def _properties(node: Any) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    if isinstance(node, list):
        for item in node:
            yield from _properties(item)
    elif isinstance(node, dict):
        for name, prop in (node.get("properties") or {}).items():
            yield node, name, prop
        for key, value in node.items():
            if key not in ("default", "const", "enum", "examples"):
                yield from _properties(value)


def test_no_optional_member_carries_a_default(document: dict[str, Any]) -> None:
    # openapi-typescript (default options) types a member with a `default` as always present:
    # an enqueue without `job_id`, or a `node.insert` without `index`, did not compile.
    optional = [
        (owner.get("title"), name)
        for owner, name, prop in _properties(document["components"]["schemas"])
        if name not in owner.get("required", ()) and "default" in prop
    ]
    assert optional == []
    enqueue = document["components"]["schemas"]["EnqueueBody"]
    assert enqueue["required"] == ["stage"]
    assert "When absent: `false`." in enqueue["properties"]["rerun"]["description"]


def test_the_apply_body_asks_for_at_least_one_op(document: dict[str, Any]) -> None:
    assert document["components"]["schemas"]["ApplyBody"]["properties"]["ops"]["minItems"] == 1


def test_every_rate_limited_route_declares_429_with_retry_after(document: dict[str, Any]) -> None:
    for method, path in ROUTE_CLASS_OF:
        answer = document["paths"][path][method.lower()]["responses"]["429"]
        assert answer["x-problem-codes"] == ["rate_limited"], (method, path)
        assert answer["headers"]["Retry-After"] == {"$ref": "#/components/headers/Retry-After"}
    assert "429" not in document["paths"]["/healthz"]["get"]["responses"]


def test_every_answer_declares_the_request_id_and_every_operation_takes_one(
    document: dict[str, Any],
) -> None:
    ref = {"$ref": "#/components/headers/X-Request-ID"}
    for path, method, operation in _operations(document):
        assert {"$ref": "#/components/parameters/X-Request-ID"} in operation["parameters"]
        for status, answer in operation["responses"].items():
            assert answer["headers"]["X-Request-ID"] == ref, (method, path, status)
    assert document["components"]["parameters"]["X-Request-ID"]["in"] == "header"


def test_the_enqueue_routes_declare_their_idempotency_headers(document: dict[str, Any]) -> None:
    for path in ("/v1/workspaces/{ws}/requests", "/v1/workspaces/{ws}/requests/batch"):
        operation = document["paths"][path]["post"]
        names = [p.get("name") for p in operation["parameters"]]
        assert "Idempotency-Key" in names
        assert "Idempotency-Replayed" in operation["responses"]["202"]["headers"]
        in_progress = operation["responses"]["409"]
        assert "idempotency_key_in_progress" in in_progress["x-problem-codes"]
        assert "Retry-After" in in_progress["headers"]


def test_the_socket_route_and_the_protocol_page_name_its_subprotocols(
    document: dict[str, Any],
) -> None:
    operation = document["paths"]["/v1/workspaces/{ws}/socket"]["get"]
    offered = next(p for p in operation["parameters"] if p.get("name") == "Sec-WebSocket-Protocol")
    assert offered["in"] == "header"
    assert "`cv-bearer.<token>`" in offered["description"]
    assert "cv-workspace.v1" in offered["description"]
    assert "Sec-WebSocket-Protocol" in operation["responses"]["101"]["headers"]
    assert "cv-bearer." in document["components"]["securitySchemes"]["bearer"]["description"]
    protocol = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert "`cv-bearer.<token>`" in protocol
    for header in ("Retry-After", "Idempotency-Key", "Idempotency-Replayed", "X-Request-ID"):
        assert f"| `{header}`" in protocol, header


def test_every_body_route_declares_415_unsupported_media_type(document: dict[str, Any]) -> None:
    for path, method, operation in _operations(document):
        if "requestBody" in operation:
            answer = operation["responses"]["415"]
            assert "unsupported_media_type" in answer["x-problem-codes"], (method, path)
            assert "Accept" in answer["headers"]


def test_the_document_names_its_server_and_its_license(document: dict[str, Any]) -> None:
    assert document["servers"] == [
        {"url": "/", "description": "The server that serves this document"}
    ]
    assert document["info"]["license"] == {"name": "MIT", "identifier": "MIT"}


async def test_a_429_the_server_answers_is_the_one_its_route_declares(
    aiohttp_client: ClientFactory, tmp_path: Path, document: dict[str, Any]
) -> None:
    config = ServerConfig(
        db_path=tmp_path / "cv.db",
        token_secret=SECRET,
        rate_limit_ops_per_second=0.001,
        rate_limit_burst_seconds=1000.0,  # one request's worth: the second is refused
    )
    client: TestClient[Any, Any] = await aiohttp_client(create_app(config))
    path = "/v1/workspaces/ws1/docs/tree/ops"
    headers = auth("ws1")  # one token: the buckets are per token, and a token minted a second
    # later is another one
    answers = [
        await client.post(path, json={"ops": [insert(f"n{i}")]}, headers=headers) for i in range(2)
    ]
    assert [answer.status for answer in answers] == [200, 429]
    refused = answers[1]
    declared = document["paths"]["/v1/workspaces/{ws}/docs/{sub_doc}/ops"]["post"]["responses"]
    body = await refused.json(content_type="application/problem+json")
    assert body["code"] in declared["429"]["x-problem-codes"]
    assert set(declared["429"]["headers"]) <= set(refused.headers)
