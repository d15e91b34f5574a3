"""The one reading of an HTTP answer, for every call the SDK makes: op batches, state and log
reads, the queue's verbs, blobs and the refusal of an SSE stream. Pure: status, body bytes and
headers in; the decoded JSON or the typed `WorkspaceError` out.

- An accepted status (`accept`: 200 for the op-log routes, any 2xx for the queue's) → the JSON
  body, None for an empty 204. JSON the reader cannot take → `ProtocolError("bad_answer")`,
  retried like a lost answer.
- Any other status below 400 (a 201 or 204 a route does not send, a 3xx that is not followed) →
  `not_an_answer`: it came from something in between and says nothing of the request.
- The server's problem+json (a document with a `code`) → `error_from_problem`, with the
  `Retry-After` header read as seconds.
- A 4xx / 5xx without it (a proxy's page) is read by its status alone: 408 is a timeout, 401,
  403, 413 and 429 are answers whoever sent them, a 5xx is a server error; any other bare 4xx
  never reached the server, so it is `bad_answer` (retried), not a final refusal.

Pinned by `tests/client/core/test_answers.py` and the HTTP path tests of each caller.
"""

from __future__ import annotations

import email.utils
import json
import re
import sys
import time
from collections.abc import Collection, Mapping
from datetime import UTC
from typing import Any, Final

from cv_workspace_client.errors import (
    ConnectionFailedError,
    ProtocolError,
    WorkspaceError,
    error_from_problem,
)

__all__ = [
    "ANY_SUCCESS",
    "OK",
    "answer_error",
    "not_an_answer",
    "parse_retry_after",
    "read_answer",
]

#: The op-log routes answer 200 or a problem.
OK: Final = frozenset({200})
#: The queue's routes also answer 202 (an enqueue) and 204 (no work, nothing pending).
ANY_SUCCESS: Final = range(200, 300)

#: What a bare status from a proxy means, in the server's own codes. A 413 (nginx's
#: `client_max_body_size`) is the server's `body_too_large`: the SDK halves the batch, and
#: only an op too large alone fails.
_PROXY_PROBLEMS: dict[int, dict[str, Any]] = {413: {"code": "body_too_large"}}

#: Bare 4xx statuses (no problem document) that are answers whoever sent them: a refused token
#: (an auth proxy's 401 / 403: the lane parks for a new one), a body too large (the batch is
#: halved), too many requests (retried after its wait). Any other bare 4xx is not an answer.
_PROXY_ANSWERS = frozenset({401, 403, 413, 429})

#: delta-seconds (RFC 9110 §10.2.3: digits; a fraction is taken too). Python's `float()` reads
#: far more ("-5", "nan", "inf", "1e3", "1_000", other scripts' digits).
_DELTA_SECONDS: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def read_answer(
    status: int,
    raw: bytes,
    headers: Mapping[str, str],
    *,
    accept: Collection[int] = OK,
) -> Any:
    """The decoded JSON of an answer with an `accept`ed status; otherwise raise its error."""
    if status not in accept:
        raise answer_error(status, raw, headers)
    if not raw and status == 204:
        return None
    try:
        return json.loads(raw)
    # RecursionError: nested past what the JSON reader takes; retried, never raised bare.
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("bad_answer", f"invalid JSON: {exc}") from None


def answer_error(status: int, raw: bytes, headers: Mapping[str, str]) -> WorkspaceError:
    """The typed error an answer that is not a success stands for (see the module docstring)."""
    if status < 400:
        return not_an_answer(status, headers.get("Location"))
    problem: Any = None
    try:
        problem = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # not a problem document: read the status
        problem = None
    if not isinstance(problem, dict) or not problem.get("code"):
        if status == 408:
            # The request was not received in time: nothing was applied, and it may well go
            # through next time.
            return ConnectionFailedError("timeout", "HTTP 408 before an answer")
        if status < 500 and status not in _PROXY_ANSWERS:
            # Something in between answered for the server (a proxy's 404 for a route it was not
            # told about, its 400 or 421): the server never saw the request, so this says
            # nothing about it. Retried, then kept pending, like a lost answer.
            return ProtocolError(
                "bad_answer",
                f"HTTP {status} without the server's problem document "
                "(from something in between?): not an answer of the API",
            )
        problem = _PROXY_PROBLEMS.get(status)
    return error_from_problem(
        status, problem, retry_after=parse_retry_after(headers.get("Retry-After"))
    )


def not_an_answer(status: int, location: str | None) -> ProtocolError:
    """A status below 400 no route of the API answers (a 201, a 204, a 3xx that is not
    followed): it comes from something in between and says nothing of the request, so it is
    retried like a lost answer (under the same op_id / Idempotency-Key), never final."""
    where = f" to {location}" if location else ""
    return ProtocolError("bad_answer", f"HTTP {status}{where} is not an answer of the API")


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3); a date in the
    past is 0 (now). Anything else is no Retry-After (None: the caller's jitter applies): a
    negative value is not "at once", and a date past what `datetime` holds is not an error.
    A huge value is kept: the retry policy's cap bounds the wait where it is used."""
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
