"""The HTTP half of the transport (docs/protocol.md): one aiohttp session, answers turned into JSON
or typed errors. No retry logic here: the machine (ops) and tenacity (reads) decide about
retries."""

from __future__ import annotations

import email.utils
import io
import json
import re
import sys
import time
from datetime import UTC
from typing import Any, Final
from urllib.parse import quote

import aiohttp
from aiohttp.payload import TOO_LARGE_BYTES_BODY

from cv_mutations import SubDocState, parse_op
from cv_workspace_client._auth import TokenRefresher, with_token
from cv_workspace_client.errors import (
    ConnectionFailedError,
    ProtocolError,
    WorkspaceError,
    error_from_problem,
)
from cv_workspace_client.logs import context_fields
from cv_workspace_client.models import Committed

__all__ = [
    "HttpApi",
    "body_payload",
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


def not_an_answer(status: int, location: str | None) -> ProtocolError:
    """A status below 400 no route of the API answers (a 201, a 204, a 3xx that is not
    followed): it comes from something in between and says nothing of the request, so it is
    retried like a lost answer (under the same op_id / Idempotency-Key), never final."""
    where = f" to {location}" if location else ""
    return ProtocolError("bad_answer", f"HTTP {status}{where} is not an answer of the API")


#: What a bare status from a proxy means, in the server's own codes. A 413 (nginx's
#: `client_max_body_size`) is the server's `body_too_large`: the SDK halves the batch, and
#: only an op too large alone fails (`http_413` failed every op of the batch for good).
_PROXY_PROBLEMS: dict[int, dict[str, Any]] = {413: {"code": "body_too_large"}}

#: Bare 4xx statuses (no problem document) that are answers whoever sent them: a refused token
#: (an auth proxy's 401 / 403: the lane parks for a new one), a body too large (the batch is
#: halved), too many requests (retried after its wait). Any other bare 4xx is not an answer.
_PROXY_ANSWERS = frozenset({401, 403, 413, 429})


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
        #: Asked when the server refuses the token (`_auth.py`); None: a refusal is the answer.
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
        answer = await self.request(
            "POST",
            self.doc_path(workspace_id, sub_doc) + "/ops",
            data=body.encode(),
        )
        if not isinstance(answer, dict) or "results" not in answer:
            raise ProtocolError("bad_answer", "an ops answer without results")
        return answer["results"]

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
        if data is not None:
            headers["Content-Type"] = "application/json"
        # Inside a worker's stage run: the server's log lines of this request carry its queue
        # request id, as the worker's do (docs/observability.md, following a stage run).
        run = context_fields().get("queue_request_id")
        if run is not None:
            headers["X-Request-ID"] = run
        try:
            # Redirects are not followed: aiohttp turned a redirected POST of ops into a GET
            # (whose 404 then failed the ops for good), or sent them wherever the redirect
            # pointed and took that host's answer for the commit. The SDK talks to its URL only.
            async with self.session.request(
                method,
                self.base_url + path,
                data=None if data is None else body_payload(data),
                params=params,
                headers=headers,
                allow_redirects=False,
            ) as response:
                raw = await response.read()
                if response.status == 200:
                    try:
                        return json.loads(raw)
                    # RecursionError: nested past what the JSON reader takes. It reached the
                    # app bare from `get_state` / `read_ops` instead of being retried.
                    except (ValueError, RecursionError) as exc:
                        raise ProtocolError("bad_answer", f"invalid JSON: {exc}") from None
                if response.status < 400:
                    # Every route answers 200 or a problem (docs/protocol.md); `http_204` used to
                    # fail an op for good.
                    raise not_an_answer(response.status, response.headers.get("Location"))
                problem: Any = None
                try:
                    problem = json.loads(raw) if raw else None
                except (ValueError, RecursionError):  # not a problem document: read the status
                    problem = None
                if not isinstance(problem, dict) or not problem.get("code"):
                    # Not the server's problem+json: a proxy's page, read by its status alone.
                    if response.status == 408:
                        # The request was not received in time: nothing was applied, and it
                        # may well go through next time (`http_408` failed the op for good).
                        raise ConnectionFailedError("timeout", "HTTP 408 before an answer")
                    if response.status < 500 and response.status not in _PROXY_ANSWERS:
                        # Something in between answered for the server (a proxy's 404 for a
                        # route it was not told about, its 400 or 421): the server never saw
                        # the request, so this says nothing about the ops. Taken as final, a
                        # misconfigured proxy made every op leave the outbox unapplied, and
                        # replayed ones silently. Retried, then kept pending, like a lost answer.
                        raise ProtocolError(
                            "bad_answer",
                            f"HTTP {response.status} without the server's problem document "
                            "(from something in between?): not an answer of the API",
                        )
                    problem = _PROXY_PROBLEMS.get(response.status)
                raise error_from_problem(
                    response.status,
                    problem,
                    retry_after=parse_retry_after(response.headers.get("Retry-After")),
                )
        except WorkspaceError:
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # The request may have been applied: the caller retries it under the same op_id.
            raise ConnectionFailedError(
                "connection_failed", f"{type(exc).__name__}: {exc}"
            ) from exc


#: delta-seconds (RFC 9110 §10.2.3: digits; a fraction is taken too). Python's `float()` reads
#: far more ("-5", "nan", "inf", "1e3", "1_000", other scripts' digits).
_DELTA_SECONDS: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3); a date in the
    past is 0 (now). Anything else is no Retry-After (None: the caller's jitter applies). A
    negative value read as 0 made the client retry at once a server that asked for a pause, and
    a date past what `datetime` holds raised `OverflowError` (bare, from `get_state`).
    A huge value is kept: the retry policy's cap (docs/configuration.md) bounds the wait where it is
    used."""
    if not value:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return min(float(value), sys.float_info.max)  # a digit string past a float is inf
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:  # "-0000" or no zone: HTTP dates are GMT, not local time
            when = when.replace(tzinfo=UTC)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


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
            Committed(clock=int(e["clock"]), op_id=e.get("op_id"), op=parse_op(e["op"]))
            for e in answer["ops"]
        ]
        return int(answer["clock"]), entries
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("bad_answer", f"ops answer: {exc}") from None
