"""A bounded, seeded fuzz of hostile input over every route that reads a body and over the
websocket, against the server as `cv-server serve` runs it, on real loopback sockets.

Garbled and mutated JSON and bytes, content codings (right, wrong, unknown, bombs), huge and deep
values in every field, floods of ops and frames. Throughout: never a 5xx; every 4xx is
problem+json with a listed `code` (every websocket `error` frame too); a socket is closed only
for a frame its reader refuses (1009, 1007, 1002); `/healthz` answers; a well-behaved client on
another connection gets an ack for each of its applies and every broadcast, in order, once. At
the end the op-log holds exactly the ops some answer acknowledged: none applied without its
answer, none acknowledged and lost.

Bounded: a fixed number of cases (`CASES_HTTP`, `CASES_WS`) and one overall deadline. A failure
names its seed and case; `CV_FUZZ_SEED=<n>` replays it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import random
import sqlite3
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cv_mutations import new_op_id
from cv_server import ServerConfig
from cv_server.http.problems import CODES
from tests.server.conftest import SECRET, auth
from tests.server.wire import RawAnswer, RawSocket, Served, frame, post, raw_http, served

SEED = int(os.environ.get("CV_FUZZ_SEED", "2026"))
CASES_HTTP = 320
CASES_WS = 160
#: The whole run, well within the suite's budget on a loaded 2-core machine.
DEADLINE = 150.0
SUB_DOCS = ("tree", "fz")

LIMITS: dict[str, Any] = {
    "max_body_bytes": 32 * 1024,
    "max_ws_frame_bytes": 32 * 1024,
    "max_ops_per_request": 40,
    "max_subscriptions_per_socket": 16,
}

# -- values --------------------------------------------------------------------------------------


def _deep(rng: random.Random) -> Any:
    value: Any = rng.choice([1, "x", None, []])
    for _ in range(rng.choice([100, 254, 256, 300, 600, 800])):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


HOSTILE_SCALARS: list[Any] = [
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**400,
    1e308,
    -0.0,
    "",
    "\x00",
    "é" * 5,
    "\ud800",
    "a" * 70,
    True,
    False,
    None,
    [],
    {},
    -1,
    0,
]


def _hostile(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.15:
        return _deep(rng)
    if roll < 0.25:
        return "x" * rng.choice([1000, 20_000, 40_000])
    if roll < 0.3:
        return [rng.choice(HOSTILE_SCALARS) for _ in range(rng.randint(1, 50))]
    return rng.choice(HOSTILE_SCALARS)


def _op(rng: random.Random, tag: str) -> dict[str, Any]:
    node = rng.choice(["a", "b", "c", f"n{rng.randint(0, 9)}"])
    kind = rng.choice(["node.insert", "node.increment", "node.update", "node.delete", "node.move"])
    op: dict[str, Any] = {"type": kind, "node_id": node, "op_id": f"{tag}{new_op_id()[:12]}"}
    if kind in ("node.insert", "node.move"):
        op["parent_id"] = "root"
    if kind == "node.move":
        op["index"] = 0
    if kind == "node.increment":
        op.update(field="count", by=rng.randint(-5, 5))
    if kind == "node.update":
        op["fields"] = {"f": rng.randint(0, 9)}
    return op


def _mutate(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """`value` with one member (somewhere in it) replaced, removed or joined by a hostile one."""
    if isinstance(value, dict) and value and depth < 4:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.45:
            out[key] = _mutate(rng, out[key], depth + 1)
        elif roll < 0.75:
            out[key] = _hostile(rng)
        elif roll < 0.9:
            del out[key]
        else:
            out[rng.choice(["extra", "🙂", "\x00", key.upper()])] = _hostile(rng)
        return out
    if isinstance(value, list) and value and depth < 4:
        out_list = list(value)
        index = rng.randrange(len(out_list))
        if rng.random() < 0.7:
            out_list[index] = _mutate(rng, out_list[index], depth + 1)
        else:
            out_list.insert(index, _hostile(rng))
        return out_list
    return _hostile(rng)


def _garble(rng: random.Random, data: bytes) -> bytes:
    """Byte-level damage: truncation, flipped or inserted bytes, a repeated slice."""
    if not data:
        return bytes(rng.randrange(256) for _ in range(8))
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        at = rng.randrange(len(buf)) if buf else 0
        if roll < 0.3:
            del buf[at:]
        elif roll < 0.6 and buf:
            buf[at] = rng.randrange(256)
        elif roll < 0.8:
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        else:
            buf[at:at] = buf[at : at + rng.randint(1, 40)] * rng.randint(2, 5)
    return bytes(buf)


def _encode(value: Any) -> bytes:
    """JSON as the standard library writes it (integers of any size, lone surrogates, no NaN)."""
    return json.dumps(value, allow_nan=False).encode("utf-8", "surrogatepass")


# -- the routes ----------------------------------------------------------------------------------


@dataclass
class Context:
    request_id: str
    #: The request's claim token: the result upload reads its body only for its holder.
    claim_token: str = ""
    ops_answered: set[str] = field(default_factory=set)
    #: Requests an apply's `enqueue` was answered with (enqueued now or before).
    requests_answered: set[str] = field(default_factory=set)
    statuses: dict[int, int] = field(default_factory=dict)
    closes: dict[int, int] = field(default_factory=dict)


#: Compare-and-set clocks: some that may match a head, some stale, some not clocks at all.
_IF_CLOCKS: list[Any] = [0, 1, 2, 5, 10**6, -1, 2**62 + 1, 2**64, "1", 1.0, True, None, [], {}]
#: An apply's `enqueue` items: job-less (ids derived from the op_ids), deterministic, reruns.
_ENQUEUE_ITEMS: list[dict[str, Any]] = [
    {"stage": "e"},
    {"stage": "e", "job_id": "fz-j", "input": {"n": 1}},
    {"stage": "e", "job_id": "fz-j", "deterministic": False},
    {"stage": "e", "job_id": "fz-r", "rerun": True, "max_dequeues": 3},
]


def _enqueue(rng: random.Random) -> list[dict[str, Any]]:
    return [rng.choice(_ENQUEUE_ITEMS) for _ in range(rng.choice([1, 1, 2, 3]))]


def _routes(ctx: Context) -> list[tuple[str, Callable[[random.Random], Any]]]:
    rid = ctx.request_id

    def ops_body(rng: random.Random) -> Any:
        count = rng.choice([1, 1, 2, 5, LIMITS["max_ops_per_request"] + 1])
        body: dict[str, Any] = {"ops": [_op(rng, "h") for _ in range(count)]}
        if rng.random() < 0.3:
            body["atomic"] = rng.random() < 0.5
        if rng.random() < 0.3:
            body["if_clock"] = rng.choice(_IF_CLOCKS)
        if rng.random() < 0.3:
            body["enqueue"] = _enqueue(rng)
        return body

    def holder(rng: random.Random) -> Any:
        return {"claim_token": rng.choice(["t", "x" * 300]), "result": {"k": 1}, "error": None}

    return [(f"/v1/workspaces/ws1/docs/{rng_doc}/ops", ops_body) for rng_doc in SUB_DOCS] + [
        ("/v1/workspaces/ws1/requests", lambda rng: {"stage": "s", "job_id": "j", "input": {}}),
        ("/v1/queue/claim", lambda rng: {"worker_classes": ["default"], "worker_id": "w"}),
        (
            "/v1/queue/complete",
            lambda rng: {"completions": [{"request_id": rid, "claim_token": "t", "result": 1}]},
        ),
        (f"/v1/workspaces/ws1/requests/{rid}/heartbeat", holder),
        (f"/v1/workspaces/ws1/requests/{rid}/complete", holder),
        (f"/v1/workspaces/ws1/requests/{rid}/fail", holder),
        (f"/v1/workspaces/ws1/requests/{rid}/result", lambda rng: {"k": [1, "x"]}),
        ("/v1/workspaces/ws1/locks/acquire", lambda rng: {"job_id": "j", "task": "t"}),
        ("/v1/workspaces/ws1/locks/release", lambda rng: {"job_id": "j", "task": "t"}),
    ]


def _http_case(rng: random.Random, ctx: Context) -> tuple[str, bytes, dict[str, str]]:
    path, make = rng.choice(_routes(ctx))
    value = make(rng)
    roll = rng.random()
    if roll < 0.45:
        body = _encode(_mutate(rng, value))
    elif roll < 0.65:
        body = _garble(rng, _encode(value))
    elif roll < 0.75:
        body = _encode(value)  # as sent by a client that means it
    else:
        body = _encode(value if rng.random() < 0.5 else _mutate(rng, value))
    headers: dict[str, str] = {}
    coding = rng.random()
    if coding < 0.15:
        headers["Content-Encoding"] = "gzip"
        body = gzip.compress(body)
        if rng.random() < 0.4:
            body = _garble(rng, body)
    elif coding < 0.22:
        headers["Content-Encoding"] = "deflate"
        body = zlib.compress(body)
    elif coding < 0.27:
        headers["Content-Encoding"] = rng.choice(["br", "zstd", "compress", "gzip, gzip", "*"])
    elif coding < 0.3:
        headers["Content-Encoding"] = "gzip"
        body = gzip.compress(b" " * (8 * 1024 * 1024))  # a bomb, well under the wire limit
    elif coding < 0.33:
        body = b" " * (LIMITS["max_body_bytes"] + 1)
    if rng.random() < 0.05:
        headers["Idempotency-Key"] = rng.choice(["k" * 300, "k\x7f", "ok-key"])
    if path.endswith("/result") and rng.random() < 0.9:
        headers["Claim-Token"] = ctx.claim_token
    return path, body, headers


def _check_http(answer: RawAnswer, where: str, ctx: Context) -> None:
    ctx.statuses[answer.status] = ctx.statuses.get(answer.status, 0) + 1
    assert answer.status < 500, (where, answer)
    if answer.status >= 400:
        assert answer.headers.get("content-type", "").startswith("application/problem+json"), (
            where,
            answer,
        )
        problem = answer.json()
        assert problem["code"] in CODES, (where, problem)
        assert problem["status"] == answer.status, (where, problem)
    elif answer.status == 200 and "/docs/" in where:
        applied = answer.json()
        for result in applied["results"]:
            if "clock" in result:
                ctx.ops_answered.add(result["op_id"])
        for item in applied.get("enqueued") or []:
            if item["status"] is not None:
                ctx.requests_answered.add(item["request_id"])


# -- the websocket -------------------------------------------------------------------------------


def _ws_message(rng: random.Random) -> tuple[bytes, int]:
    """One hostile message: (the frame's bytes, its opcode)."""

    def one(rng: random.Random) -> dict[str, Any]:
        kind = rng.choice(["apply", "apply", "subscribe", "unsubscribe", "nope"])
        base: dict[str, Any] = {
            "type": kind,
            "sub_doc": rng.choice(SUB_DOCS),
            "req": rng.randint(0, 9),
        }
        if kind == "apply":
            base["ops"] = [_op(rng, "w") for _ in range(rng.choice([1, 2, 3]))]
            if rng.random() < 0.3:
                base["if_clock"] = rng.choice(_IF_CLOCKS)
            if rng.random() < 0.1:
                base["enqueue"] = _enqueue(rng)  # HTTP only: refused on the socket
        if kind == "subscribe":
            base["since"] = rng.choice([0, 0, 1, 10**6])
        return _mutate(rng, base) if rng.random() < 0.7 else base

    roll = rng.random()
    if roll < 0.6:
        return _encode(one(rng)), 0x1
    if roll < 0.75:
        count = rng.choice([2, 5, LIMITS["max_subscriptions_per_socket"] + 4, 200])
        return _encode([one(rng) for _ in range(count)]), 0x1
    if roll < 0.85:
        return _garble(rng, _encode(one(rng))), 0x1  # may not even be UTF-8: 1007
    if roll < 0.9:
        return _encode(one(rng)), 0x2  # binary
    if roll < 0.95:
        return b'{"pad":"' + b"x" * (LIMITS["max_ws_frame_bytes"] + 10) + b'"}', 0x1  # 1009
    return _encode({"type": "subscribe", "sub_doc": "tree", "req": _deep(rng)}), 0x1


async def _ws_case(served_: Served, rng: random.Random, ctx: Context) -> None:
    data, opcode = _ws_message(rng)
    ws = await RawSocket.connect(served_.port)
    try:
        await ws.send(frame(data, opcode))
        sentinels = {}
        for sub_doc in SUB_DOCS:
            op_id = f"s{new_op_id()}"
            op = {"type": "node.insert", "node_id": op_id, "parent_id": "root", "op_id": op_id}
            req = f"sentinel-{sub_doc}"
            sentinels[req] = op_id
            await ws.send_json({"type": "apply", "sub_doc": sub_doc, "req": req, "ops": [op]})
        waiting = set(sentinels)
        while waiting:
            try:
                code, payload = await ws.receive()
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise AssertionError(f"the socket ended without a close frame: {exc!r}") from None
            if code == 0x8:
                ctx.closes[ws.close_code or 0] = ctx.closes.get(ws.close_code or 0, 0) + 1
                assert ws.close_code in (1009, 1007, 1002), (ws.close_code, payload)
                return
            assert code == 0x1, (code, payload[:80])
            answer = json.loads(payload)
            for item in answer if isinstance(answer, list) else [answer]:
                if item["type"] == "error":
                    assert item["code"] in CODES, item
                    assert item["code"] != "internal", item  # a fault of the server's
                    assert str(item.get("req")) not in sentinels, item
                elif item["type"] == "ack":
                    for result in item["results"]:
                        if "clock" in result:
                            ctx.ops_answered.add(result["op_id"])
                    waiting.discard(item["req"] if isinstance(item["req"], str) else "")
    finally:
        await ws.close()


# -- the well-behaved client ---------------------------------------------------------------------


@dataclass
class GoodClient:
    acked: list[str] = field(default_factory=list)
    broadcast: list[tuple[int, str]] = field(default_factory=list)
    health_checks: int = 0


async def _good_client(served_: Served, stop: asyncio.Event, good: GoodClient) -> None:
    base = f"http://127.0.0.1:{served_.port}"
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"{base}/v1/workspaces/ws1/socket", headers=auth("ws1"))
        await ws.send_json({"type": "subscribe", "sub_doc": "tree", "since": 0})
        req = 0
        while not stop.is_set():
            async with session.get(f"{base}/healthz") as health:
                assert (health.status, await health.json()) == (200, {"status": "ok"})
            good.health_checks += 1
            req += 1
            op_id = f"g{new_op_id()}"
            op = {"type": "node.insert", "node_id": op_id, "parent_id": "root", "op_id": op_id}
            await ws.send_json({"type": "apply", "sub_doc": "tree", "req": req, "ops": [op]})
            async with asyncio.timeout(20):
                while True:
                    msg = await ws.receive_json()
                    if msg["type"] == "op":
                        good.broadcast.append((msg["clock"], msg["op_id"]))
                    elif msg["type"] == "ack" and msg["req"] == req:
                        assert "clock" in msg["results"][0], msg
                        good.acked.append(op_id)
                        break
                    else:
                        assert msg["type"] == "synced", msg
        await ws.close()


# -- the run -------------------------------------------------------------------------------------


async def test_hostile_input_never_breaks_the_server_or_its_promise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(SEED)
    config = ServerConfig(db_path=tmp_path / "cv.db", token_secret=SECRET, **LIMITS)
    stop = asyncio.Event()
    good = GoodClient()
    async with served(config) as server:
        enqueued = await raw_http(
            server.port, post("/v1/workspaces/ws1/requests", b'{"stage":"s"}')
        )
        assert enqueued.status == 202, enqueued
        claimed = await raw_http(
            server.port, post("/v1/queue/claim", b'{"worker_classes":["s"],"worker_id":"w"}')
        )
        assert claimed.status == 200, claimed
        ctx = Context(
            request_id=enqueued.json()["request_id"],
            claim_token=claimed.json()["request"]["claim_token"],
        )
        well_behaved = asyncio.create_task(_good_client(server, stop, good))
        try:
            async with asyncio.timeout(DEADLINE):
                for case in range(CASES_HTTP + CASES_WS):
                    where = f"seed {SEED} case {case}"
                    if case % 2 or case >= 2 * CASES_WS:
                        path, body, headers = _http_case(rng, ctx)
                        answer = await raw_http(server.port, post(path, body, headers=headers))
                        _check_http(answer, f"{where}: POST {path}", ctx)
                    else:
                        try:
                            await _ws_case(server, rng, ctx)
                        except (AssertionError, TimeoutError) as exc:
                            raise AssertionError(f"{where}: {exc!r}") from exc
                    assert not well_behaved.done(), well_behaved
        finally:
            stop.set()
            await well_behaved  # raises what went wrong for it, if anything did
        # The last broadcasts of the good client's own ops are in; its last ack came after them.
    # Nothing failed inside the server either (an unhandled error, a callback that raised).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    log = sqlite3.connect(tmp_path / "cv.db")
    try:
        rows = log.execute(
            "SELECT sub_doc, clock, op_id FROM workspace_sub_doc_ops WHERE workspace_id = 'ws1'"
        ).fetchall()
        requests = log.execute(
            "SELECT request_id, caused_by_clock FROM workspace_process_requests"
            " WHERE workspace_id = 'ws1'"
        ).fetchall()
    finally:
        log.close()
    logged = {op_id for _, _, op_id in rows}
    answered = ctx.ops_answered | set(good.acked)
    assert logged - answered == set(), "applied without an answer"
    assert answered - logged == set(), "acknowledged and lost"
    # The same for what applies enqueued: every request a commit made was answered, and every
    # request an answer named is in the queue.
    caused = {request_id for request_id, clock in requests if clock is not None}
    assert caused - ctx.requests_answered == set(), "enqueued without an answer"
    assert ctx.requests_answered - {r for r, _ in requests} == set(), "answered and lost"
    # The well-behaved client: every apply acked, every broadcast of "tree" once and in order.
    tree = sorted(clock for sub_doc, clock, _ in rows if sub_doc == "tree")
    clocks = [clock for clock, _ in good.broadcast]
    assert clocks == list(range(1, len(clocks) + 1))
    assert clocks == tree[: len(clocks)]
    assert set(good.acked) <= {op_id for _, op_id in good.broadcast}
    assert good.health_checks > 10
    assert len(good.acked) > 10
    # The run exercised what it claims to (true of every seed tried; the mix is fixed).
    assert ctx.statuses.get(200, 0) > 5
    assert len(ctx.requests_answered) > 0
    assert ctx.statuses.get(413, 0) > 0
    assert ctx.statuses.get(415, 0) > 0
    assert ctx.statuses.get(400, 0) > 5
    assert ctx.closes.get(1009, 0) > 0
