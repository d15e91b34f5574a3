"""The SDK's HTTP path and its retry policy (docs/protocol.md, docs/client.md,
docs/configuration.md), with no websocket open: what an app sees from `apply_op` / `get_state` /
`read_ops` when the answer is a Retry-After in any form, something that is not the server's
problem+json, a final 4xx, a recorded rejection, or when the app itself gives up waiting mid-retry.

Against the real server on loopback (through `FaultProxy` where the network must fail) or, where a
misbehaviour must be injected, a small aiohttp server (`Misbehaving`). Tests of the same family that
are not repeated here: test_retry.py (429/503 Retry-After as delta-seconds, 5xx jitter, give-up
after 5 sends, 413 halving), test_protocol_violations.py (HTML, truncated JSON, wrong results,
2xx/3xx that are not answers, a cut body, a proxy's 408/413), tests/client/test_client_edges.py (an
`apply_op` cancelled while its request is in flight)."""

from __future__ import annotations

import ast
import asyncio
import email.utils
import math
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

import cv_server
from cv_mutations import NodeIncrement, NodeInsert
from cv_server.http import problems
from cv_server.http.queue import _ERROR_STATUS
from cv_server.queue.errors import QueueError
from cv_workspace_client import (
    AuthError,
    Commit,
    ConnectionFailedError,
    ForbiddenError,
    InvalidRequestError,
    LeaseLostError,
    LogCompactedError,
    NotFoundError,
    OpRejectedError,
    ProtocolError,
    RateLimitedError,
    RequestCancelledError,
    ServerError,
    StillPendingError,
    VersionConflictError,
    WorkspaceClient,
    WorkspaceError,
)
from cv_workspace_client._io.http import parse_retry_after
from cv_workspace_client._queue.transport import queue_error
from cv_workspace_client.errors import error_from_problem
from cv_workspace_client.testing import FaultProxy, restart_client

from ..helpers import WS, RecordingSleep, fast_config, server_log, server_state, token_for

TIMEOUT = 10
SUB = "tree"
MINE = "mine-op-1"
#: The jitter, made recognisable: a delay of exactly this is "no Retry-After was honoured".
JITTER = 0.25

ServerFactory = Callable[..., Awaitable[TestServer]]
Answer = Callable[[], web.StreamResponse]


def http_date(offset: float) -> str:
    return email.utils.formatdate(time.time() + offset, usegmt=True)


def raw(status: int, body: str | bytes = b"", content_type: str = "application/json") -> Answer:
    def answer() -> web.StreamResponse:
        data = body.encode() if isinstance(body, str) else body
        return web.Response(status=status, body=data, content_type=content_type)

    return answer


def unavailable(*retry_after: str) -> Answer:
    """A 503 problem with these `Retry-After` lines (several lines if several are given)."""

    def answer() -> web.StreamResponse:
        headers = CIMultiDict(("Retry-After", value) for value in retry_after)
        body = '{"code": "unavailable", "status": 503, "detail": "busy"}'
        return web.Response(
            status=503, text=body, content_type="application/problem+json", headers=headers
        )

    return answer


#: Nested past what Python's JSON reader takes (its recursion limit): `RecursionError`.
DEEP = "[" * 100_000 + "]" * 100_000


@dataclass
class Misbehaving:
    """The op-log's three HTTP routes: each answers with the next scripted answer of its route,
    then behaves (commits once per op_id, `duplicate: true` for a resend, like the server)."""

    posts: deque[Answer] = field(default_factory=deque)
    gets: deque[Answer] = field(default_factory=deque)
    sends: list[list[str]] = field(default_factory=list)
    reads: int = 0
    committed: dict[str, int] = field(default_factory=dict)

    async def post(self, request: web.Request) -> web.StreamResponse:
        ops = (await request.json())["ops"]
        self.sends.append([op["op_id"] for op in ops])
        if self.posts:
            return self.posts.popleft()()
        results = []
        for op in ops:
            duplicate = op["op_id"] in self.committed
            clock = self.committed.setdefault(op["op_id"], len(self.committed) + 1)
            results.append({"op_id": op["op_id"], "clock": clock, "duplicate": duplicate})
        return web.json_response({"results": results})

    async def get(self, request: web.Request) -> web.StreamResponse:
        self.reads += 1
        if self.gets:
            return self.gets.popleft()()
        if request.path.endswith("/ops"):
            return web.json_response({"clock": len(self.committed), "ops": []})
        state: dict[str, Any] = {"nodes": {"root": {"parent": None, "children": [], "fields": {}}}}
        return web.json_response({"clock": len(self.committed), "state": state})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.post)
        app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}", self.get)
        app.router.add_get("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.get)
        return app


async def serve(aiohttp_server: ServerFactory, fake: Misbehaving) -> str:
    server = await aiohttp_server(fake.app())
    return str(server.make_url("")).rstrip("/")


def http_client(
    url: str, sleep: Callable[[float], Awaitable[None]] | None = None, **config: Any
) -> WorkspaceClient:
    """HTTP only, the default cap (300 s) and attempts (5), a jitter of exactly `JITTER`."""
    options: dict[str, Any] = {
        "ops_over_websocket": False,
        "retry_cap_seconds": 300.0,
        "backoff": lambda failures: JITTER,
    }
    if sleep is not None:
        options["sleep"] = sleep
    options.update(config)
    return WorkspaceClient(url, token=token_for(WS), config=fast_config(**options))


async def increment(client: WorkspaceClient, op_id: str = MINE) -> Commit:
    op = NodeIncrement(node_id="n", field="c", op_id=op_id)
    return await asyncio.wait_for(client.apply_op(WS, SUB, op), TIMEOUT)


# -- Retry-After: what it is read as ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0", 0.0),
        ("7", 7.0),
        (" 120 ", 120.0),
        ("1.5", 1.5),
        ("86400000", 86_400_000.0),  # legal, however long: the cap applies where it is used
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: now
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
    ],
)
def test_every_legal_retry_after_is_read_as_seconds(value: str, seconds: float) -> None:
    assert parse_retry_after(value) == seconds


def test_a_retry_after_date_in_the_future_is_read_as_the_seconds_until_it() -> None:
    seconds = parse_retry_after(http_date(120))
    assert seconds is not None
    assert 115 <= seconds <= 121


@pytest.mark.parametrize(
    "value",
    [
        "-5",  # was 0: "retry at once", hammering the server that asked for a pause
        "-0.5",
        "nan",
        "inf",  # was inf
        "-inf",
        "Infinity",
        "1e3",  # was 1000: Python's float() reads far more than delta-seconds
        "1_000",
        "0x10",
        "soon",
        "",
        "5, 10",  # two values folded into one line
        "Wed, 21 Oct 2015 99999999999999999999:28:00 GMT",  # raised OverflowError
        "Wed, 21 Oct 99999999999999999999 07:28:00 GMT",
        "Wed, 21 Oct 2015 07:28:00 +99999999999999999999",
        "Wed, 32 Oct 2015 07:28:00 GMT",
    ],
)
def test_an_illegal_retry_after_is_ignored(value: str) -> None:
    """RFC 9110 §10.2.3: delta-seconds (digits) or an HTTP-date. Anything else is no Retry-After
    at all: the client falls back on its jitter, neither "now" nor "never" nor a crash."""
    assert parse_retry_after(value) is None


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -3, -0.5, True, "5", None],
    ids=["nan", "inf", "negative", "negative-fraction", "bool", "string", "null"],
)
def test_a_problem_bodys_unusable_retry_after_is_ignored(value: object) -> None:
    """A `retry_after` member in a problem document (or a websocket `error` frame). NaN (which
    Python's JSON reader takes) made the client sleep NaN seconds, i.e. forever."""
    for status in (429, 503, None):
        error = error_from_problem(status, {"code": "unavailable", "retry_after": value})
        assert error.retry_after is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_an_unusable_retry_after_given_to_a_retryable_error_is_dropped(value: float) -> None:
    """Whoever builds the error (HTTP, a websocket frame, the queue's calls)."""
    assert ServerError("internal", retry_after=value).retry_after is None
    assert RateLimitedError("rate_limited", retry_after=value).retry_after is None


def test_a_problem_bodys_huge_retry_after_is_kept_for_the_cap_to_bound() -> None:
    """An integer past a float's range raised `OverflowError` out of the error mapping."""
    error = error_from_problem(503, {"code": "unavailable", "retry_after": 10**400})
    assert error.retry_after == sys.float_info.max
    assert error_from_problem(429, {"code": "rate_limited", "retry_after": 2}).retry_after == 2.0


# -- Retry-After: what the client waits, ops and reads -------------------------------------------


#: (Retry-After lines, the delay the client must wait before the second attempt).
WAITS = [
    (("2",), 2.0),
    (("0",), 0.0),
    (("Wed, 21 Oct 2015 07:28:00 GMT",), 0.0),
    (("100000",), 300.0),  # The default cap, never past it
    (("Fri, 31 Dec 9999 23:59:59 GMT",), 300.0),
    (("-5",), JITTER),
    (("nan",), JITTER),
    (("soon",), JITTER),
    (("Wed, 21 Oct 2015 07:28:00 +99999999999999999999",), JITTER),
    (("7", "600"), 7.0),  # several lines: the first one, as any HTTP library reads a header
]
WAIT_IDS = ["2", "0", "past", "huge", "far-date", "negative", "nan", "word", "overflow", "two"]


@pytest.mark.parametrize(("lines", "delay"), WAITS, ids=WAIT_IDS)
async def test_an_ops_retry_waits_what_retry_after_says_within_the_cap(
    aiohttp_server: ServerFactory, lines: tuple[str, ...], delay: float
) -> None:
    fake = Misbehaving(posts=deque([unavailable(*lines)]))
    sleep = RecordingSleep()
    async with http_client(await serve(aiohttp_server, fake), sleep) as client:
        assert await increment(client) == Commit(clock=1, op_id=MINE)
    assert sleep.delays == [delay]
    assert fake.sends == [[MINE], [MINE]]


@pytest.mark.parametrize(("lines", "delay"), WAITS, ids=WAIT_IDS)
async def test_a_reads_retry_waits_what_retry_after_says_within_the_cap(
    aiohttp_server: ServerFactory, lines: tuple[str, ...], delay: float
) -> None:
    """The overflowing date reached the app as a bare `OverflowError` from `get_state`."""
    fake = Misbehaving(gets=deque([unavailable(*lines), unavailable(*lines)]))
    sleep = RecordingSleep()
    async with http_client(await serve(aiohttp_server, fake), sleep) as client:
        assert (await client.get_state(WS, SUB))[0] == 0
        assert await client.read_ops(WS, SUB) == (0, [])
    assert sleep.delays == [delay, delay]
    assert fake.reads == 4


@pytest.mark.parametrize(
    ("retry_after", "delay"),
    [("NaN", JITTER), ("Infinity", JITTER), ("-1", JITTER), ("1" + "0" * 400, 300.0)],
    ids=["nan", "infinity", "negative", "huge-int"],
)
async def test_a_problem_bodys_retry_after_neither_hangs_nor_crashes_nor_passes_the_cap(
    aiohttp_server: ServerFactory, retry_after: str, delay: float
) -> None:
    """`"retry_after": NaN` made the lane wait `asyncio.sleep(nan)`, which never returns: the op
    and every later op of its sub-doc hung, and so did `get_state`; `Infinity` waited the full
    cap; a huge integer raised a bare `OverflowError` from `get_state`."""
    body = f'{{"code": "unavailable", "retry_after": {retry_after}}}'
    fake = Misbehaving(
        posts=deque([raw(503, body, "application/problem+json")]),
        gets=deque([raw(503, body, "application/problem+json")]),
    )
    sleep = RecordingSleep()
    async with http_client(await serve(aiohttp_server, fake), sleep) as client:
        assert await increment(client) == Commit(clock=1, op_id=MINE)
        clock, _ = await asyncio.wait_for(client.get_state(WS, SUB), TIMEOUT)
    assert clock == 1
    assert fake.sends == [[MINE], [MINE]]
    assert sleep.delays == [delay, delay]
    assert all(not math.isnan(d) for d in sleep.delays)


async def test_a_nan_retry_after_does_not_hang_the_sub_doc(aiohttp_server: ServerFactory) -> None:
    """With the real `asyncio.sleep`: `sleep(nan)` never returns, and the op (with every later
    op of its sub-doc) and the read waited for good."""
    body = '{"code": "unavailable", "retry_after": NaN}'
    fake = Misbehaving(
        posts=deque([raw(503, body, "application/problem+json")]),
        gets=deque([raw(503, body, "application/problem+json")]),
    )
    async with http_client(await serve(aiohttp_server, fake), backoff=lambda n: 0.01) as client:
        assert await asyncio.wait_for(increment(client), 5) == Commit(clock=1, op_id=MINE)
        assert (await asyncio.wait_for(client.get_state(WS, SUB), 5))[0] == 1


# -- answers that are not the server's ------------------------------------------------------------


NOT_ANSWERS = [
    raw(502, "<html><body>502 Bad Gateway</body></html>", "text/html"),
    raw(502),
    raw(503, DEEP, "application/problem+json"),
    raw(200),
    raw(200, "<html>hello</html>", "text/html"),
    raw(200, '{"clock": 1, "st'),
    raw(200, DEEP),
    lambda: web.Response(status=302, headers={"Location": "/elsewhere"}),
]
NOT_ANSWER_IDS = [
    "html-502",
    "empty-502",
    "deep-503",
    "empty-200",
    "html-200",
    "truncated-200",
    "deep-200",
    "302",
]


@pytest.mark.parametrize("answer", NOT_ANSWERS, ids=NOT_ANSWER_IDS)
async def test_a_read_answered_by_something_else_is_retried_typed(
    aiohttp_server: ServerFactory, answer: Answer
) -> None:
    """A body nested past Python's JSON reader reached the app as a bare `RecursionError`."""
    fake = Misbehaving(gets=deque([answer, answer]))
    async with http_client(await serve(aiohttp_server, fake)) as client:
        assert (await client.get_state(WS, SUB))[0] == 0
        assert await client.read_ops(WS, SUB) == (0, [])
    assert fake.reads == 4


@pytest.mark.parametrize("answer", NOT_ANSWERS, ids=NOT_ANSWER_IDS)
async def test_an_op_answered_by_something_else_stays_in_the_outbox_and_is_resent(
    aiohttp_server: ServerFactory, answer: Answer
) -> None:
    fake = Misbehaving(posts=deque([answer]))
    async with http_client(await serve(aiohttp_server, fake)) as client:
        assert await increment(client) == Commit(clock=1, op_id=MINE)
    assert fake.sends == [[MINE], [MINE]]


@pytest.mark.parametrize(
    "body",
    ['{"clock": 3}', '{"state": {"nodes": {}}}', '{"clock": "x", "state": 1}', "null", "[1, 2]"],
    ids=["no-state", "no-clock", "wrong-types", "null", "not-an-object"],
)
async def test_a_read_whose_json_lacks_its_fields_fails_typed(
    aiohttp_server: ServerFactory, body: str
) -> None:
    """Valid JSON of the wrong shape (any content type), every time: a `ProtocolError` after
    the last attempt (each answer is one failed attempt), never a bare `KeyError` /
    `TypeError`."""
    fake = Misbehaving(gets=deque(raw(200, body) for _ in range(10)))
    async with http_client(await serve(aiohttp_server, fake)) as client:
        with pytest.raises(ProtocolError):
            await client.get_state(WS, SUB)
        with pytest.raises(ProtocolError):
            await client.read_ops(WS, SUB)
    assert fake.reads == 10  # 5 attempts each (docs/configuration.md)


async def test_a_read_that_never_gets_an_answer_fails_typed_after_the_last_attempt(
    aiohttp_server: ServerFactory,
) -> None:
    fake = Misbehaving(gets=deque(raw(502) for _ in range(10)))
    sleep = RecordingSleep()
    async with http_client(await serve(aiohttp_server, fake), sleep) as client:
        with pytest.raises(ServerError):
            await client.get_state(WS, SUB)
        with pytest.raises(ServerError):
            await client.read_ops(WS, SUB)
    assert fake.reads == 10  # 5 attempts each (docs/configuration.md)
    assert sleep.delays == [JITTER] * 8


# -- every server code maps to its typed error -----------------------------------------------------


#: The SDK type every server problem code must come back as, over HTTP (queue routes included).
EXPECTED: dict[str, type[WorkspaceError]] = {
    "bad_request": InvalidRequestError,
    "malformed_json": InvalidRequestError,
    "body_too_large": InvalidRequestError,
    "malformed_body": InvalidRequestError,
    "unsupported_content_encoding": InvalidRequestError,
    "unsupported_media_type": InvalidRequestError,
    "line_too_long": InvalidRequestError,
    "malformed_request": InvalidRequestError,
    "too_many_subscriptions": InvalidRequestError,
    "too_many_ops": InvalidRequestError,
    "unknown_op_type": InvalidRequestError,
    "invalid_id": InvalidRequestError,
    "invalid_field": InvalidRequestError,
    "unknown_message_type": InvalidRequestError,
    "unauthorized": AuthError,
    "forbidden_workspace": ForbiddenError,
    "missing_scope": ForbiddenError,
    "forbidden_sub_doc": ForbiddenError,
    "token_revoked": AuthError,
    "not_found": NotFoundError,
    "method_not_allowed": InvalidRequestError,
    "rate_limited": RateLimitedError,
    "idempotency_key_reuse": InvalidRequestError,
    "idempotency_key_in_progress": InvalidRequestError,
    "idempotency_key_lost": InvalidRequestError,
    "lease_lost": LeaseLostError,
    "invalid_transition": InvalidRequestError,
    "request_id_conflict": InvalidRequestError,
    "cancelled": RequestCancelledError,
    "not_cancellable": InvalidRequestError,
    "not_discardable": InvalidRequestError,
    "result_too_large": InvalidRequestError,
    "log_compacted": LogCompactedError,
    "version_conflict": VersionConflictError,
    "schedule_exists": InvalidRequestError,
    "schedule_not_found": NotFoundError,
    "grant_exceeded": ForbiddenError,
    "internal": ServerError,
    "unavailable": ServerError,
    "storage_unavailable": ServerError,
}
#: A websocket `error` frame (no status) maps each code as an HTTP answer does: one reading of
#: problems for every call (`error_from_problem`).
EXPECTED_FRAME = EXPECTED


def _string_args(node: ast.Call) -> list[object]:
    return [arg.value if isinstance(arg, ast.Constant) else None for arg in node.args]


def codes_the_server_sends() -> set[tuple[int | None, str]]:
    """Every (status, code) the server's source can answer with: `Problem(status, "code")`,
    websocket `error("code")` frames, the queue's errors and the op parser's codes."""
    found: set[tuple[int | None, str]] = set()
    root = Path(cv_server.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            args = _string_args(node)
            if name == "Problem" and len(args) >= 2 and isinstance(args[1], str):
                status = args[0]
                found.add((status if isinstance(status, int) else None, args[1]))
            elif name == "error" and args and isinstance(args[0], str):
                owner = getattr(node.func, "value", None)
                if getattr(owner, "id", None) in ("self", "session"):  # not `log.error(...)`
                    found.add((None, args[0]))
    queue_errors: list[type[QueueError]] = [QueueError]
    while queue_errors:
        cls = queue_errors.pop()
        queue_errors.extend(cls.__subclasses__())
        if cls is not QueueError:
            found.add((_ERROR_STATUS.get(cls.code, 409), cls.code))
    # `parse_op`'s codes (cv_mutations), answered as 422 with the op's index.
    found.update((422, code) for code in ("unknown_op_type", "invalid_id", "invalid_field"))
    # The middleware's own: aiohttp's refusals (`bad_request`, any 4xx), anything unexpected.
    found.update({(400, "bad_request"), (500, "internal"), (429, "rate_limited")})
    return found


def test_every_code_the_server_sends_is_listed_and_mapped_to_its_typed_error() -> None:
    """A new code in the server fails here until it is listed in `cv_server.http.problems.CODES`
    (with a title) and given its SDK type in `EXPECTED`."""
    sent = codes_the_server_sends()
    assert {code for _, code in sent} <= set(problems.CODES)
    assert set(EXPECTED) == set(problems.CODES)
    for status, code in sent | {(None, code) for code in problems.CODES}:
        body = problems.Problem(status or 400, code, "why").to_json()
        if status is None:
            error = error_from_problem(None, body)
            assert type(error) is EXPECTED_FRAME[code], (status, code)
        else:
            error = queue_error(status, body, None)
            assert type(error) is EXPECTED[code], (status, code)
            assert type(error_from_problem(status, body)) is EXPECTED_FRAME[code], (status, code)
        assert error.code == code
        assert error.retryable == (
            code in ("rate_limited", "internal", "unavailable", "storage_unavailable")
        )


def test_every_problem_the_server_answers_has_a_title_of_its_own() -> None:
    for code in problems.CODES:
        title = problems.Problem(400, code).to_json()["title"]
        assert title
        assert title != code


# -- final answers: typed, never retried, never left pending -------------------------------------


@pytest.mark.parametrize(
    ("where", "token", "expected"),
    [
        ("/nowhere", token_for(WS), NotFoundError),
        ("", token_for("other"), ForbiddenError),
        ("", "not-a-token", AuthError),
    ],
    ids=["not-found", "forbidden", "unauthorized"],
)
async def test_a_final_answer_of_the_real_server_is_raised_typed_without_a_retry(
    server_url: str, where: str, token: str, expected: type[WorkspaceError]
) -> None:
    sleep = RecordingSleep()
    config = fast_config(ops_over_websocket=False, sleep=sleep)
    async with WorkspaceClient(server_url + where, token=token, config=config) as client:
        with pytest.raises(expected):
            await asyncio.wait_for(client.get_state(WS, SUB), TIMEOUT)
        with pytest.raises(expected):
            await asyncio.wait_for(client.read_ops(WS, SUB), TIMEOUT)
        if expected is NotFoundError:
            with pytest.raises(expected):
                await increment(client)
            assert client.pending_count() == 0  # answered: out of the outbox, not replayed
        else:
            # A refused token is no answer about the op: it stays, for a token that may.
            with pytest.raises(StillPendingError) as pending:
                await increment(client)
            assert isinstance(pending.value.last_error, expected)
            assert client.pending_count() == 1
    assert sleep.delays == []


async def test_reads_through_a_network_that_fails_are_retried_then_fail_typed(
    server_url: str, token: str
) -> None:
    sleep = RecordingSleep()
    config = fast_config(ops_over_websocket=False, sleep=sleep, retry_attempts=3)
    async with (
        FaultProxy(server_url) as proxy,
        WorkspaceClient(proxy.url, token=token, config=config) as client,
    ):
        proxy.cut_next(2)  # the answers to the first two reads never arrive
        assert (await asyncio.wait_for(client.get_state(WS, SUB), TIMEOUT))[0] == 0
        assert proxy.stats.cuts == 2
        proxy.refuse = True
        proxy.drop_all()  # and the kept-alive connection with it
        before = len(sleep.delays)
        with pytest.raises(ConnectionFailedError):
            await asyncio.wait_for(client.read_ops(WS, SUB), TIMEOUT)
    # Three attempts, two waits. (aiohttp itself may resend a GET once on a connection that
    # closed under it: one attempt of the SDK's can be two connections.)
    assert len(sleep.delays) - before == 2


# -- a rejection is an answer: once, and the same on every resend ----------------------------------


async def test_an_op_rejected_over_http_leaves_the_outbox_once_and_a_resend_gets_the_rejection(
    server_url: str, token: str, tmp_path: Path
) -> None:
    ghost = NodeIncrement(node_id="ghost", field="c", op_id="rejected-1")
    config = fast_config(ops_over_websocket=False)
    async with FaultProxy(server_url) as proxy:
        client = WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox", config=config)
        await client.start()
        try:
            proxy.cut_next(1)  # the server records the rejection; its answer is lost
            with pytest.raises(OpRejectedError) as first:
                await asyncio.wait_for(client.apply_op(WS, SUB, ghost), TIMEOUT)
            assert (first.value.code, first.value.op_id) == ("node_not_found", "rejected-1")
            assert proxy.stats.cuts == 1
            assert client.pending_count() == 0
            # The node exists now: the same op_id still gets its recorded rejection, unapplied.
            await client.apply_op(WS, SUB, NodeInsert(node_id="ghost", parent_id="root"))
            with pytest.raises(OpRejectedError) as again:
                await asyncio.wait_for(client.apply_op(WS, SUB, ghost), TIMEOUT)
            assert (again.value.code, again.value.op_id) == ("node_not_found", "rejected-1")
            client = await restart_client(client)  # nothing of it is left to replay
            assert client.pending_count() == 0
        finally:
            await client.close()
    log = await server_log(server_url, SUB)
    assert [entry["op"]["type"] for entry in log] == ["node.insert"]
    assert (await server_state(server_url, SUB))["state"]["nodes"]["ghost"]["fields"] == {}


# -- the app gives up waiting mid-retry: the op does not ----------------------------------------


async def test_an_apply_op_timed_out_by_the_app_mid_retry_is_applied_once_under_its_op_id(
    server_url: str, token: str, tmp_path: Path
) -> None:
    """The app's deadline falls between two attempts (five, 0.2 s apart): the op stays pending
    under its op_id and is applied once, by this client when the network is back, or by the
    next one on the outbox if this one dies while still retrying."""
    config = fast_config(ops_over_websocket=False, backoff=lambda failures: 0.2)

    async def time_out(client: WorkspaceClient, proxy: FaultProxy, op_id: str) -> None:
        proxy.refuse = True
        proxy.drop_all()  # and the kept-alive connection with it
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await client.apply_op(WS, SUB, NodeIncrement(node_id="n", field="c", op_id=op_id))
        assert client.pending_count() == 1  # the app stopped waiting; the op did not
        # And it is being retried: refused by the proxy (however few attempts fit in 0.5 s on
        # this machine, it keeps trying after the app gave up).
        await asyncio.wait_for(proxy.wait_until(lambda stats: stats.refused >= 1), TIMEOUT)

    async with FaultProxy(server_url) as proxy:
        client = WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox", config=config)
        await client.start()
        try:
            await client.apply_op(WS, SUB, NodeInsert(node_id="n", parent_id="root"))
            await time_out(client, proxy, "timed-out-1")
            proxy.refuse = False
            await client.wait_synced(timeout=TIMEOUT)
            assert client.pending_count() == 0
            await time_out(client, proxy, "timed-out-2")
            client = await restart_client(client)  # dies mid-retry: the next process replays
            proxy.refuse = False
            await client.wait_synced(timeout=TIMEOUT)
            assert client.pending_count() == 0
        finally:
            await client.close()
    log = await server_log(server_url, SUB)
    assert [entry["op_id"] for entry in log][1:] == ["timed-out-1", "timed-out-2"]
    assert (await server_state(server_url, SUB))["state"]["nodes"]["n"]["fields"] == {"c": 2}


async def test_a_cancelled_apply_op_mid_retry_then_resubmitted_is_applied_once(
    aiohttp_server: ServerFactory,
) -> None:
    """The app cancels its call and tries again with the same op (its own op_id): one commit,
    and the resubmission gets it (`duplicate`), not a second apply."""
    fake = Misbehaving(posts=deque([raw(503), raw(503)]))
    backing_off = asyncio.Event()
    gate = asyncio.Event()

    async def gated_sleep(delay: float) -> None:
        backing_off.set()
        await gate.wait()

    async with http_client(await serve(aiohttp_server, fake), sleep=gated_sleep) as client:
        first = asyncio.ensure_future(increment(client))
        await asyncio.wait_for(backing_off.wait(), TIMEOUT)  # the first send failed: mid-retry
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert client.pending_count() == 1
        second = asyncio.ensure_future(increment(client))
        gate.set()
        commit = await asyncio.wait_for(second, TIMEOUT)
        assert commit.op_id == MINE
        assert client.pending_count() == 0
    assert set(fake.committed) == {MINE}
    assert all(ops and set(ops) == {MINE} for ops in fake.sends)
