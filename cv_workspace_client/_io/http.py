"""The HTTP half of the transport (docs/protocol.md): one aiohttp session; `exchange` sends one
request and hands back its status, body and headers (a connection error as
`ConnectionFailedError`), and `_answers.read_answer` reads every answer the same way. No retry
logic here: the machine (ops) and tenacity (reads, queue verbs) decide about retries."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp.payload import TOO_LARGE_BYTES_BODY

from cv_mutations import SubDocState, parse_op
from cv_workspace_client._core.answers import not_an_answer, parse_retry_after, read_answer
from cv_workspace_client._core.wire import commit_time
from cv_workspace_client._io.auth import TokenRefresher, with_token
from cv_workspace_client.errors import ConnectionFailedError, ProtocolError
from cv_workspace_client.logs import context_fields
from cv_workspace_client.models import Committed

__all__ = [
    "HttpApi",
    "body_payload",
    "exchange",
    "log_answer",
    "not_an_answer",
    "parse_retry_after",
    "state_answer",
]


def body_payload(data: bytes) -> bytes | io.BytesIO:
    """What to hand aiohttp as a request body. Past aiohttp's own threshold (1 MiB) raw bytes
    make it warn (`ResourceWarning`); an app running with warnings as errors (`-W error`, a
    test suite) then saw the send fail, over and over under the same op_id, and the op wedged
    its sub-doc instead of getting the server's answer (`body_too_large`, say)."""
    return io.BytesIO(data) if len(data) > TOO_LARGE_BYTES_BODY else data


async def exchange(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    data: bytes | None = None,
    params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
) -> tuple[int, bytes, Mapping[str, str]]:
    """Send one request and read its whole answer: `(status, body, headers)`. A connection that
    fails before the answer is read (refused, reset, timed out) raises `ConnectionFailedError`:
    the request may have been applied, and the caller retries it under the same op_id /
    Idempotency-Key. Redirects are not followed: aiohttp turns a redirected POST into a GET,
    or sends it wherever the redirect points; the SDK talks to its URL only."""
    all_headers = dict(headers)
    if data is not None:
        all_headers["Content-Type"] = "application/json"
    try:
        async with session.request(
            method,
            url,
            data=None if data is None else body_payload(data),
            params=params,
            headers=all_headers,
            allow_redirects=False,
        ) as response:
            return response.status, await response.read(), response.headers
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ConnectionFailedError("connection_failed", f"{type(exc).__name__}: {exc}") from exc


class HttpApi:
    """Routes of the v1 wire contract over one `aiohttp.ClientSession`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str | None,
        *,
        refresher: TokenRefresher | None = None,
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.headers: dict[str, str] = {}
        #: Asked when the server refuses the token (`_io/auth.py`); None: a refusal is the answer.
        self.token_refresher = refresher
        self.set_token(token)

    def auth_headers(self) -> dict[str, str]:
        return dict(self.headers)

    def set_token(self, token: str | None) -> None:
        """Send `token` from the next request on (`WorkspaceClient.set_token`)."""
        self.headers.pop("Authorization", None)
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"

    def doc_path(self, workspace_id: str, sub_doc: str) -> str:
        return f"/v1/workspaces/{quote(workspace_id, safe='')}/docs/{quote(sub_doc, safe='')}"

    def socket_url(self, workspace_id: str) -> str:
        # batch=1: the server may pack the frames that queued up into one message (an array).
        return f"{self.base_url}/v1/workspaces/{quote(workspace_id, safe='')}/socket?batch=1"

    async def post_ops(self, workspace_id: str, sub_doc: str, body: str) -> Any:
        """POST a batch (`body` is the JSON text); return its `results` list."""
        return (await self.post_apply(workspace_id, sub_doc, body))["results"]

    async def post_apply(self, workspace_id: str, sub_doc: str, body: str) -> dict[str, Any]:
        """POST a batch (`body` is the JSON text); return the whole answer (`results`, and
        `enqueued` for an apply that enqueues)."""
        answer = await self.request(
            "POST",
            self.doc_path(workspace_id, sub_doc) + "/ops",
            data=body.encode(),
        )
        if not isinstance(answer, dict) or "results" not in answer:
            raise ProtocolError("bad_answer", "an ops answer without results")
        return answer

    async def get_state(self, workspace_id: str, sub_doc: str) -> Any:
        return await self.request("GET", self.doc_path(workspace_id, sub_doc))

    async def read_ops(self, workspace_id: str, sub_doc: str, since: int, limit: int) -> Any:
        return await self.request(
            "GET",
            self.doc_path(workspace_id, sub_doc) + "/ops",
            params={"since": str(since), "limit": str(limit)},
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """One request. 200 → decoded JSON; anything else → the typed `WorkspaceError`.

        Refused for its token (401 / 403) and given another one by the refresher (the app's
        provider, or a `set_token` while it was out), it goes once more with that one: a
        refused request was not looked at, so sending it again cannot apply anything twice."""
        return await with_token(
            self, lambda headers: self._request_once(method, path, headers, data, params)
        )

    async def _request_once(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        data: bytes | None,
        params: dict[str, str] | None,
    ) -> Any:
        # Inside a worker's stage run: the server's log lines of this request carry its queue
        # request id, as the worker's do (docs/observability.md, following a stage run).
        run = context_fields().get("queue_request_id")
        if run is not None:
            headers["X-Request-ID"] = run
        status, raw, answer_headers = await exchange(
            self.session, method, self.base_url + path, headers=headers, data=data, params=params
        )
        return read_answer(status, raw, answer_headers)


def state_answer(answer: Any) -> tuple[int, SubDocState]:
    """A `GET .../docs/{sub_doc}` answer as (head clock, state); else `ProtocolError`."""
    try:
        return int(answer["clock"]), SubDocState.from_json(answer["state"])
    # OverflowError: `int()` of the `Infinity` Python's JSON reader takes.
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("bad_answer", f"state answer: {exc}") from None


def log_answer(answer: Any) -> tuple[int, list[Committed]]:
    """A `GET .../ops` answer as (head clock, entries); `ProtocolError` if it is not one."""
    try:
        entries = [
            Committed(
                clock=int(e["clock"]),
                op_id=e.get("op_id"),
                op=parse_op(e["op"]),
                committed_at=commit_time(e.get("committed_at")),
            )
            for e in answer["ops"]
        ]
        return int(answer["clock"]), entries
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("bad_answer", f"ops answer: {exc}") from None
