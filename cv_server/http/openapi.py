"""The OpenAPI 3.1 document of the HTTP API, generated from the app's own routes and the pydantic
models they parse with (`cv_server.http.models`): served at `GET /openapi.json`, rendered for
people at `GET /docs`, checked in as `schemas/openapi.json` (`python -m cv_server.api_schema
--check` fails when it drifts; `--write` regenerates it).

A route is documented by decorating its handler with `@documented(...)`: its summary, body model,
answers and the problem codes it can answer beyond the ones every route of its kind can (see
`_common_problems`). `build_document` walks the app's router, so a new route appears in the
document as soon as it is decorated, and `undocumented_routes` (and the drift test) names any
route that is not. Every function here takes the app (or the document) as an argument: the app
imports this module for `@documented`, so this module never imports the app
(`cv_server.api_schema` is the shell that builds one).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cv_mutations.schema import PublishedJsonSchema
from cv_server.auth import TOKEN_ID_PATTERN
from cv_server.http.models import ProblemDetails
from cv_server.http.problems import CODES
from cv_server.http.ratelimit import ROUTE_CLASS_OF
from cv_server.http.security import BEARER_SUBPROTOCOL_PREFIX, SOCKET_SUBPROTOCOL
from cv_server.keys import ROUTE_SCOPE_TABLE
from cv_server.observe import REQUEST_ID_HEADER

__all__ = [
    "HEADERS",
    "OPENAPI_PATH",
    "Doc",
    "Media",
    "Param",
    "build_document",
    "documented",
    "render_docs_page",
    "undocumented_routes",
]

OPENAPI_PATH: Final = Path(__file__).resolve().parents[2] / "schemas" / "openapi.json"

H = TypeVar("H", bound=Callable[..., Any])

_ATTRIBUTE: Final = "__cv_openapi__"


@dataclass(frozen=True, slots=True)
class Media:
    """A body that is not a JSON model: its media type and schema."""

    media_type: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    description: str = ""


@dataclass(frozen=True, slots=True)
class Param:
    """A query (or header) parameter."""

    name: str
    schema: Mapping[str, Any]
    description: str = ""
    where: str = "query"
    required: bool = False


#: An answer: a model (JSON), several models (any of them), a `Media`, or None (no body).
Answer = type[BaseModel] | tuple[type[BaseModel], ...] | Media | None


@dataclass(frozen=True, slots=True)
class Doc:
    """A route's entry: `answers` by status; `answer_headers` names, per status, the headers of
    `HEADERS` its answer may carry."""

    summary: str
    answers: Mapping[int, Answer]
    body: type[BaseModel] | Media | None = None
    body_required: bool = True
    description: str = ""
    problems: Mapping[int, Sequence[str]] = field(default_factory=dict)
    params: Sequence[Param] = ()
    auth: bool = True
    tag: str = ""
    answer_headers: Mapping[int, Sequence[str]] = field(default_factory=dict)


def documented(doc: Doc) -> Callable[[H], H]:
    """Attach `doc` to a route handler (put it under the `@routes.get(...)` decorator)."""

    def attach(handler: H) -> H:
        setattr(handler, _ATTRIBUTE, doc)
        return handler

    return attach


def _doc_of(handler: Any) -> Doc | None:
    found = getattr(handler, _ATTRIBUTE, None)
    return found if isinstance(found, Doc) else None


def _routes(app: web.Application) -> list[tuple[str, str, Any]]:
    """(path template, method, handler) of every route, HEAD (aiohttp's shadow of GET) left out."""
    found = []
    for route in app.router.routes():
        resource = route.resource
        if resource is None or route.method in ("HEAD", "*"):
            continue
        found.append((resource.canonical, route.method.lower(), route.handler))
    return found


def undocumented_routes(app: web.Application) -> list[str]:
    return sorted(
        f"{method.upper()} {path}" for path, method, handler in _routes(app) if not _doc_of(handler)
    )


# -- parameters and problems ----------------------------------------------------------------------

_PATH_PARAMS: Final[Mapping[str, tuple[Mapping[str, Any], str]]] = {
    "ws": ({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "The workspace id"),
    "sub_doc": ({"type": "string", "pattern": "^[a-z0-9_.-]{1,64}$"}, "The sub-doc name"),
    "id": ({"type": "string"}, "The queue request id"),
    "ref": ({"type": "string"}, "The blob reference"),
    "token_id": (
        {"type": "string", "pattern": TOKEN_ID_PATTERN},
        "A token's id (`jti`), as `cv-server token` prints it",
    ),
}


def _common_problems(path: str, doc: Doc) -> dict[int, list[str]]:
    """What every route of its kind may answer: a request the HTTP parser refuses, a bad token,
    a workspace the token does not grant, a malformed workspace or sub-doc id, a body that is
    not JSON, not decodable or too large, the server's own failure (`internal`) and storage that
    refuses writes (`storage_unavailable`)."""
    problems: dict[int, list[str]] = {
        400: ["line_too_long", "malformed_request"],
        500: ["internal"],
    }
    if doc.auth:
        problems[401] = ["unauthorized", "token_revoked"]
        problems[403] = ["missing_scope"]
    if "{sub_doc}" in path:
        problems.setdefault(403, []).append("forbidden_sub_doc")
    if "{ws}" in path:
        problems.setdefault(403, []).append("forbidden_workspace")
        problems.setdefault(422, []).append("invalid_id")
        # A workspace route writes, or may (a read on SQLite runs on the writer): a disk that is
        # full or read-only refuses it (docs/operating.md, "Storage faults").
        problems.setdefault(503, []).append("storage_unavailable")
    if doc.body is not None:
        problems[400] += ["malformed_json", "malformed_body"]
        problems.setdefault(413, []).append("body_too_large")
        problems.setdefault(415, []).extend(
            ["unsupported_content_encoding", "unsupported_media_type"]
        )
        problems.setdefault(422, []).append("invalid_field")
    return problems


#: Response headers, declared once (`components.headers`) and referred to by the answers that
#: carry them (docs/protocol.md, "Headers").
HEADERS: Final[Mapping[str, Mapping[str, Any]]] = {
    REQUEST_ID_HEADER: {
        "description": "The request's id: the caller's own `X-Request-ID` when it is 1..128 of"
        " `[A-Za-z0-9._:@-]`, else one the server minted; its log line carries the same id",
        "schema": {"type": "string"},
    },
    "Retry-After": {
        "description": "Seconds to wait before sending the request again",
        "schema": {"type": "integer", "minimum": 0},
    },
    "Idempotency-Replayed": {
        "description": "`true` when this is the stored answer of an earlier request with the same"
        " `Idempotency-Key` (nothing was run again)",
        "schema": {"type": "string", "enum": ["true"]},
    },
    "Accept": {
        "description": "The media type a body must have: `application/json`",
        "schema": {"type": "string"},
    },
    "Accept-Encoding": {
        "description": "The content codings a body may carry",
        "schema": {"type": "string"},
    },
    "Sec-WebSocket-Protocol": {
        "description": f"The subprotocol the server speaks, `{SOCKET_SUBPROTOCOL}`, when the"
        " client offered it",
        "schema": {"type": "string", "enum": [SOCKET_SUBPROTOCOL]},
    },
}

#: The request header every operation takes (`components.parameters`).
_REQUEST_ID_PARAM: Final = {
    "name": REQUEST_ID_HEADER,
    "in": "header",
    "required": False,
    "description": "Your id for this request, echoed in the answer's `X-Request-ID` and logged"
    " with it (1..128 of `[A-Za-z0-9._:@-]`; anything else is replaced by a minted id)",
    "schema": {"type": "string"},
}

#: Headers a problem answer carries when it is one of these codes.
_CODE_HEADERS: Final[Mapping[str, Sequence[str]]] = {
    "rate_limited": ("Retry-After",),
    "idempotency_key_in_progress": ("Retry-After",),
    "storage_unavailable": ("Retry-After",),
    "unsupported_content_encoding": ("Accept-Encoding",),
    "unsupported_media_type": ("Accept",),
}

#: The response extension that lists a problem answer's codes (its `description` names them
#: too): the schema itself is a plain `$ref` to `ProblemDetails`, which every generator parses
#: (tests/outside/test_openapi_python_client.py).
PROBLEM_CODES_EXTENSION: Final = "x-problem-codes"


def _headers(names: Sequence[str]) -> dict[str, Any]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in sorted(names)}


def _problem_response(status: int, codes: Sequence[str]) -> dict[str, Any]:
    unique = sorted(dict.fromkeys(codes))
    titles = "; ".join(f"`{code}`: {CODES.get(code, code)}" for code in unique)
    extra = [header for code in unique for header in _CODE_HEADERS.get(code, ())]
    return {
        "description": f"Problem ({titles})",
        "headers": _headers([REQUEST_ID_HEADER, *dict.fromkeys(extra)]),
        "content": {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemDetails"}}
        },
        PROBLEM_CODES_EXTENSION: unique,
    }


# -- the document ---------------------------------------------------------------------------------

_STATUS_TEXT: Final = {
    101: "Switching Protocols: the websocket session",
    200: "OK",
    201: "Created",
    202: "Accepted",
    204: "No content",
}


def _collect_models(ops: list[tuple[str, str, Doc]]) -> list[type[BaseModel]]:
    models: dict[str, type[BaseModel]] = {"ProblemDetails": ProblemDetails}
    for _, _, doc in ops:
        if doc.body is not None and not isinstance(doc.body, Media):
            models[doc.body.__name__] = doc.body
        for answer in doc.answers.values():
            for model in _models_of(answer):
                models[model.__name__] = model
    return [models[name] for name in sorted(models)]


def _models_of(answer: Answer) -> tuple[type[BaseModel], ...]:
    if answer is None or isinstance(answer, Media):
        return ()
    if isinstance(answer, tuple):
        return answer
    return (answer,)


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _answer_object(status: int, answer: Answer, headers: Sequence[str]) -> dict[str, Any]:
    description = _STATUS_TEXT.get(status, str(status))
    found: dict[str, Any] = {"description": description, "headers": _headers(headers)}
    if answer is None:
        return found
    if isinstance(answer, Media):
        found["description"] = answer.description or description
        found["content"] = {answer.media_type: {"schema": dict(answer.schema)}}
        return found
    models = _models_of(answer)
    schema = _ref(models[0]) if len(models) == 1 else {"oneOf": [_ref(m) for m in models]}
    found["content"] = {"application/json": {"schema": schema}}
    return found


def _operation(
    path: str, method: str, doc: Doc, handler: Any, scopes: frozenset[str]
) -> dict[str, Any]:
    name = getattr(handler, "__name__", "handler")
    operation: dict[str, Any] = {"operationId": name, "summary": doc.summary}
    if doc.description:
        operation["description"] = doc.description
    if doc.tag:
        operation["tags"] = [doc.tag]
    params: list[dict[str, Any]] = []
    for segment in path.split("/"):
        if segment.startswith("{") and segment.endswith("}"):
            key = segment[1:-1]
            schema, description = _PATH_PARAMS.get(key, ({"type": "string"}, key))
            params.append(
                {
                    "name": key,
                    "in": "path",
                    "required": True,
                    "description": description,
                    "schema": dict(schema),
                }
            )
    for param in doc.params:
        params.append(
            {
                "name": param.name,
                "in": param.where,
                "required": param.required,
                "description": param.description,
                "schema": dict(param.schema),
            }
        )
    params.append({"$ref": f"#/components/parameters/{REQUEST_ID_HEADER}"})
    operation["parameters"] = params
    if isinstance(doc.body, Media):
        operation["requestBody"] = {
            "required": doc.body_required,
            "description": doc.body.description,
            "content": {doc.body.media_type: {"schema": dict(doc.body.schema)}},
        }
    elif doc.body is not None:
        operation["requestBody"] = {
            "required": doc.body_required,
            "content": {"application/json": {"schema": _ref(doc.body)}},
        }
    responses = {
        str(status): _answer_object(
            status, answer, [REQUEST_ID_HEADER, *doc.answer_headers.get(status, ())]
        )
        for status, answer in doc.answers.items()
    }
    problems = _common_problems(path, doc)
    if (method.upper(), path) in ROUTE_CLASS_OF:  # the rate limits' routes (docs/reliability.md)
        problems.setdefault(429, []).append("rate_limited")
    for status, codes in doc.problems.items():
        problems.setdefault(status, []).extend(codes)
    for status in sorted(problems):
        responses[str(status)] = _problem_response(status, problems[status])
    operation["responses"] = dict(sorted(responses.items()))
    operation["security"] = [{"bearer": sorted(scopes)}] if doc.auth else []
    if doc.auth:
        # Any one of them will do (docs/operating.md, "Tokens and scopes").
        operation["x-required-scope"] = sorted(scopes)
    return operation


def build_document(app: web.Application) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`'s documented routes."""
    ops = [
        (path, method, doc, handler)
        for path, method, handler in _routes(app)
        if (doc := _doc_of(handler)) is not None
    ]
    models = _collect_models([(p, m, d) for p, m, d, _ in ops])
    _, schemas = models_json_schema(
        [(model, "validation") for model in models],
        ref_template="#/components/schemas/{model}",
        schema_generator=PublishedJsonSchema,
    )
    scope_table = app.get(ROUTE_SCOPE_TABLE, {})
    paths: dict[str, dict[str, Any]] = {}
    for path, method, doc, handler in sorted(ops, key=lambda op: (op[0], op[1])):
        scopes = scope_table.get((method.upper(), path), frozenset())
        paths.setdefault(path, {})[method] = _operation(path, method, doc, handler, scopes)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "cv-workspace server",
            "version": "1",
            "description": (
                "Op-log, work queue and compute locks of cv-workspace. Every error is "
                "application/problem+json with a stable `code`. Authenticate with "
                "`Authorization: Bearer <token>` (`cv-server token`)."
            ),
            "license": {"name": "MIT", "identifier": "MIT"},
        },
        # Relative: the server that serves this document (a deployment's own URL is not known
        # when it is generated; a client resolves "/" against where it read the document).
        "servers": [{"url": "/", "description": "The server that serves this document"}],
        "paths": paths,
        "components": {
            "headers": {name: dict(header) for name, header in sorted(HEADERS.items())},
            "parameters": {REQUEST_ID_HEADER: dict(_REQUEST_ID_PARAM)},
            "schemas": dict(sorted(schemas.get("$defs", {}).items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`Authorization: Bearer <token>`. On the websocket route, a"
                    " client that cannot set headers (a browser) offers the subprotocol"
                    f" `{BEARER_SUBPROTOCOL_PREFIX}<token>` beside `{SOCKET_SUBPROTOCOL}`, or"
                    " passes `?token=` (docs/protocol.md)",
                }
            },
        },
    }


def render_document(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# -- /docs ----------------------------------------------------------------------------------------


def render_docs_page(document: Mapping[str, Any]) -> str:
    """A plain HTML page of the document (no script, no CDN: it works offline): every route,
    its parameters, body, answers and problem codes, and the schemas, linked."""
    out: list[str] = []
    esc = html.escape
    info = document.get("info", {})
    out.append(
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(info.get('title', 'API'))}</title><style>"
        "body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "code,pre{font:13px ui-monospace,monospace}pre{background:#f5f5f5;padding:.6rem;"
        "overflow:auto}h2{border-top:1px solid #ddd;padding-top:1rem}.m{font-weight:700;"
        "text-transform:uppercase}table{border-collapse:collapse}td,th{border:1px solid #ddd;"
        "padding:.2rem .5rem;text-align:left;vertical-align:top}</style></head><body>"
    )
    out.append(f"<h1>{esc(info.get('title', 'API'))}</h1><p>{esc(info.get('description', ''))}")
    out.append(" The machine-readable document: <a href='/openapi.json'>/openapi.json</a>.</p>")
    out.append("<h2>Routes</h2><ul>")
    paths: Mapping[str, Mapping[str, Any]] = document.get("paths", {})
    for path, methods in paths.items():
        for method, op in methods.items():
            anchor = esc(op.get("operationId", f"{method}{path}"))
            out.append(
                f"<li><a href='#{anchor}'><span class='m'>{esc(method)}</span> "
                f"<code>{esc(path)}</code></a> — {esc(op.get('summary', ''))}</li>"
            )
    out.append("</ul>")
    for path, methods in paths.items():
        for method, op in methods.items():
            out.append(_docs_operation(path, method, op))
    out.append("<h2 id='schemas'>Schemas</h2>")
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out.append(
            f"<h3 id='schema-{esc(name)}'>{esc(name)}</h3>"
            f"<pre>{esc(json.dumps(schema, indent=2, sort_keys=True))}</pre>"
        )
    out.append("</body></html>")
    return "".join(out)


def _schema_link(schema: Mapping[str, Any]) -> str:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        return f"<a href='#schema-{html.escape(name)}'>{html.escape(name)}</a>"
    if "oneOf" in schema:
        return " or ".join(_schema_link(s) for s in schema["oneOf"])
    return f"<code>{html.escape(json.dumps(schema, sort_keys=True))}</code>"


def _code(code: str) -> str:
    return f"<code>{html.escape(code)}</code>"


def _docs_operation(path: str, method: str, op: Mapping[str, Any]) -> str:
    esc = html.escape
    parts = [
        f"<h2 id='{esc(op.get('operationId', ''))}'><span class='m'>{esc(method)}</span> "
        f"<code>{esc(path)}</code></h2><p>{esc(op.get('summary', ''))}</p>"
    ]
    if op.get("description"):
        parts.append(f"<p>{esc(op['description'])}</p>")
    parts.append(f"<p>Authentication: {'bearer token' if op.get('security') else 'none'}</p>")
    params = [p for p in op.get("parameters", []) if "$ref" not in p]
    if params:
        parts.append("<table><tr><th>parameter</th><th>in</th><th>schema</th><th></th></tr>")
        for p in params:
            parts.append(
                f"<tr><td><code>{esc(p['name'])}</code>{' (required)' if p['required'] else ''}"
                f"</td><td>{esc(p['in'])}</td><td>{_schema_link(p['schema'])}</td>"
                f"<td>{esc(p.get('description', ''))}</td></tr>"
            )
        parts.append("</table>")
    body = op.get("requestBody")
    if body:
        for media, content in body["content"].items():
            parts.append(f"<p>Body ({esc(media)}): {_schema_link(content['schema'])}</p>")
    parts.append("<table><tr><th>status</th><th>answer</th></tr>")
    for status, answer in op.get("responses", {}).items():
        contents = answer.get("content", {})
        codes = answer.get(PROBLEM_CODES_EXTENSION)
        what = ", ".join(
            f"{esc(media)} {_schema_link(c['schema'])}"
            + (": codes " + ", ".join(_code(code) for code in codes) if codes else "")
            for media, c in contents.items()
        )
        parts.append(
            f"<tr><td>{esc(status)}</td><td>{esc(answer.get('description', ''))}"
            f"{'<br>' + what if what else ''}</td></tr>"
        )
    parts.append("</table>")
    return "".join(parts)
