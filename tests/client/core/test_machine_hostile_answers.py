"""The outbox machine and its two transports against the answers a server may give.

- The Hypothesis model of `test_machine_stateful` extended with the answers it never gives: a
  whole-request 4xx naming one op (`op_index`), `too_many_ops` after the server's limit shrank,
  429 with a Retry-After past the cap, garbled answers (results reordered, missing, extra) for
  batches the server did commit, and outbox writes that fail.
- The websocket writer packing queued frames into one message: the server's limit is in bytes.
- Through real servers on loopback: a late ack on a reopened socket for a batch already resent
  over HTTP, `close()` racing `apply_op`, `wait_synced` while ops keep coming, 1,000 sub-docs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from cv_mutations import NodeIncrement, NodeInsert, NodeUpdate
from cv_workspace_client import Commit, StillPendingError, WorkspaceClient
from cv_workspace_client._core.machine import (
    CountAttempt,
    Discard,
    Forget,
    OutboxMachine,
    OutboxRow,
    Persist,
    Resolve,
    Send,
    Wait,
)
from cv_workspace_client._io.frames import write_frames
from cv_workspace_client.errors import (
    InvalidRequestError,
    OpDiscardedError,
    OutboxError,
    RateLimitedError,
    WorkspaceError,
)
from cv_workspace_client.testing import FaultProxy

from ..helpers import WS, fast_config, server_log, server_state
from .test_machine_stateful import SUB_DOCS, ClientThroughHostileLink, index

TIMEOUT = 30
ServerFactory = Callable[..., Awaitable[TestServer]]

#: Ops the (simulated) server refuses as a whole request, naming the op (`op_index`): an op that
#: fails validation. Deterministic, as request validation is: every resend gets the same answer.
POISON = {"type": "node.increment", "node_id": "n", "field": "poison", "by": 1}
INCREMENT = {"type": "node.increment", "node_id": "n", "field": "c", "by": 1}
RETRY_AFTER_CAP = 1.0


class _Refused:
    """A whole-request answer (a problem document): nothing of the request was applied."""

    def __init__(self, error: WorkspaceError) -> None:
        self.error = error


class ClientFacingEveryAnswer(ClientThroughHostileLink):
    """The hostile-link model, with a server that also refuses, rate-limits and garbles."""

    def __init__(self) -> None:
        self.limit: int | None = None  # the server's max_ops_per_request (None: no limit)
        self.doomed: set[str] = set()  # op_ids whose request validation always fails
        self.write_failed: set[str] = set()  # op_ids whose outbox write failed
        self.rows: dict[int, OutboxRow] = {}  # this incarnation's rows, by seq
        self.last_decisions: list[Any] = []
        super().__init__()

    def new_client(self, rows: list[OutboxRow]) -> OutboxMachine:
        machine = OutboxMachine(
            now=lambda: 0.0,
            new_op_id=self.minter,
            backoff=lambda failures: 0.1 * failures,
            max_attempts=3,
            max_batch_ops=4,
            retry_after_cap=RETRY_AFTER_CAP,
        )
        self.rows = {row.seq: row for row in rows}
        machine.restore(rows)
        self.drain(machine)
        return machine

    def drain(self, machine: OutboxMachine | None = None) -> None:
        machine = machine or self.client
        self.last_decisions = machine.decisions()
        for decision in self.last_decisions:
            if isinstance(decision, Persist):
                self.unflushed_inserts.extend(decision.rows)
                self.rows.update((row.seq, row) for row in decision.rows)
            elif isinstance(decision, Send):
                self.requests.append((self.incarnation, decision))
            elif isinstance(decision, Forget):
                self.unflushed_deletes.extend(decision.seqs)
            elif isinstance(decision, Wait):
                self.timers.append(decision)
            elif isinstance(decision, Discard):
                self.discard_rows(decision)
            elif isinstance(decision, Resolve):
                self.resolved(decision)
            else:
                assert isinstance(decision, CountAttempt)

    def resolved(self, resolve: Resolve) -> None:
        for seq, outcome in resolve.outcomes:
            op_id = self.rows[seq].op_id
            if isinstance(outcome, Commit):
                assert outcome.op_id == op_id
                assert op_id not in self.doomed, f"{op_id} can never commit"
                self.told[op_id] = outcome.clock
            elif isinstance(outcome, InvalidRequestError):
                assert op_id in self.doomed, f"{op_id} refused: {outcome!r}"
            elif isinstance(outcome, OutboxError):
                assert op_id in self.write_failed, outcome
            elif isinstance(outcome, OpDiscardedError):
                assert outcome.op_id == op_id
                if not outcome.maybe_applied:
                    self.never_applied.add(op_id)
            else:
                assert isinstance(outcome, StillPendingError), outcome
                assert outcome.op_id == op_id

    def serve(self, send: Send) -> Any:
        # Request validation (inputs.parse_apply_body) runs before anything is committed.
        if self.limit is not None and len(send.rows) > self.limit:
            return _Refused(InvalidRequestError("too_many_ops", status=422))
        for i, row in enumerate(send.rows):
            if json.loads(row.op_json)["field"] == "poison":
                return _Refused(InvalidRequestError("invalid_field", status=422, op_index=i))
        return super().serve(send)

    # -- the app: poison ops, atomic groups no larger than the smallest server limit -----------

    @rule(sub_doc=st.sampled_from(SUB_DOCS), poison=st.lists(st.booleans(), min_size=1, max_size=3))
    def submit(self, sub_doc: str, poison: list[bool]) -> None:
        ops = [POISON if bad else INCREMENT for bad in poison]
        rows = self.client.submit(WS, sub_doc, ops)
        self.doomed.update(row.op_id for row, bad in zip(rows, poison, strict=True) if bad)
        self.drain()

    @rule(sub_doc=st.sampled_from(SUB_DOCS), poison=st.lists(st.booleans(), min_size=1, max_size=2))
    def submit_atomic(self, sub_doc: str, poison: list[bool]) -> None:
        ops = [POISON if bad else INCREMENT for bad in poison]
        rows = self.client.submit(WS, sub_doc, ops, atomic=True)
        if any(poison):  # the whole group is refused with the request
            self.doomed.update(row.op_id for row in rows)
        self.drain()

    # -- the outbox -----------------------------------------------------------------------------

    @rule(count=st.integers(1, 8))
    def outbox_commits(self, count: int = 1_000_000) -> None:
        """As the parent's, but never splitting an atomic group: the shell writes each submit's
        rows in one outbox transaction, so a crash keeps all of a group or none of it."""
        rows = self.unflushed_inserts
        while (
            count < len(rows)
            and rows[count].atomic_group is not None
            and (rows[count].atomic_group == rows[count - 1].atomic_group)
        ):
            count += 1
        super().outbox_commits(count)

    @precondition(lambda self: self.unflushed_inserts)
    @rule()
    def outbox_write_fails(self) -> None:
        """The oldest queued write fails (disk full): one submit's rows, all or none."""
        first = self.unflushed_inserts[0]
        failed = [
            row
            for row in self.unflushed_inserts
            if row.sub_doc == first.sub_doc
            and (row.seq == first.seq or (row.atomic_group or -1) == first.atomic_group)
        ]
        for row in failed:
            self.unflushed_inserts.remove(row)
            self.write_failed.add(row.op_id)
        self.client.persist_failed([row.seq for row in failed], OSError("disk full"))
        self.drain()

    # -- the server -----------------------------------------------------------------------------

    @rule(limit=st.sampled_from([None, 2, 3]))
    def server_limit_changes(self, limit: int | None) -> None:
        self.limit = limit

    @precondition(lambda self: any(inc == self.incarnation for inc, _ in self.requests))
    @rule(i=index, retry_after=st.sampled_from([0.0, 0.5, 7.0, 3600.0]))
    def request_rate_limited(self, i: int, retry_after: float) -> None:
        """429: nothing applied; the lane waits Retry-After, but never past the cap."""
        mine = [(inc, send) for inc, send in self.requests if inc == self.incarnation]
        incarnation, send = mine[i % len(mine)]
        self.requests.remove((incarnation, send))
        self.client.batch_failed(
            send.batch_id, RateLimitedError("rate_limited", retry_after=retry_after)
        )
        self.drain()
        if not self.last_decisions:
            return  # a copy of a batch answered meanwhile: the report is ignored
        waits = [d for d in self.last_decisions if isinstance(d, Wait)]
        if not self.client.is_parked(WS, send.sub_doc):
            (wait,) = waits
            assert wait.delay == min(retry_after, RETRY_AFTER_CAP)
            assert wait.sub_doc == send.sub_doc

    @precondition(lambda self: self.requests)
    @rule(i=index, how=st.sampled_from(["reversed", "short", "long", "no_clock", "not_a_list"]))
    def request_arrives_garbled(self, i: int, how: str) -> None:
        """The server commits the batch, but the answer does not fit it: the client must resend
        (and be told the commits as duplicates), never trust or drop it."""
        incarnation, send = self.requests.pop(i % len(self.requests))
        answer = self.serve(send)
        if isinstance(answer, _Refused) or (how == "reversed" and len(answer) < 2):
            self.responses.append((incarnation, send.batch_id, answer))
            return
        garbled: Any = {
            "reversed": answer[::-1],
            "short": answer[:-1],
            "long": [*answer, answer[-1]],
            "no_clock": [{k: v for k, v in r.items() if k != "clock"} for r in answer],
            "not_a_list": {"results": answer},
        }[how]
        self.responses.append((incarnation, send.batch_id, garbled))

    @precondition(lambda self: self.responses)
    @rule(i=index)
    def answer_arrives(self, i: int) -> None:
        incarnation, batch_id, results = self.responses.pop(i % len(self.responses))
        if incarnation == self.incarnation:
            if isinstance(results, _Refused):
                self.client.batch_failed(batch_id, results.error)
            else:
                self.client.batch_answered(batch_id, results)
            self.drain()

    # -- what must hold -------------------------------------------------------------------------

    @invariant()
    def no_refused_or_unwritten_op_is_ever_applied(self) -> None:
        for sub_doc in SUB_DOCS:
            applied = {str(e.op_id) for e in self.log(sub_doc)[1:]}
            assert not applied & self.doomed
            assert not applied & self.write_failed

    def settle(self) -> None:
        self.limit = None  # the network heals, and so does the server's config
        super().settle()

    def check_quiescence(self) -> None:
        # Refused ops left the outbox (answered) and are expected nowhere in the log.
        for op_id in self.doomed:
            self.reached_outbox.pop(op_id, None)
        super().check_quiescence()


def test_every_op_is_applied_once_in_order_or_refused_whatever_the_server_answers(
    tmp_path: Path,
) -> None:
    class Example(ClientFacingEveryAnswer):
        base_dir = tmp_path

    run_state_machine_as_test(
        Example,
        settings=settings(
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- the websocket writer: messages the server can take ------------------------------------------


class RecordingWebSocket:
    """Stands in for `aiohttp.ClientWebSocketResponse` in `write_frames`: records what is sent."""

    def __init__(self, expected_frames: int) -> None:
        self.messages: list[str] = []
        self.expected_frames = expected_frames
        self.all_sent = asyncio.Event()

    async def send_str(self, data: str) -> None:
        self.messages.append(data)
        if len(unpacked(self.messages)) >= self.expected_frames:
            self.all_sent.set()

    async def close(self) -> None:
        return None


async def packed(frames: list[str], max_bytes: int) -> list[str]:
    """The messages `write_frames` makes of `frames`, all queued before it runs."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for frame in frames:
        queue.put_nowait(frame)
    ws = RecordingWebSocket(len(frames))
    writer = asyncio.ensure_future(write_frames(ws, queue, max_bytes))  # type: ignore[arg-type]
    await asyncio.wait_for(ws.all_sent.wait(), 5)
    writer.cancel()
    return ws.messages


def unpacked(messages: list[str]) -> list[str]:
    frames: list[str] = []
    for message in messages:
        body = json.loads(message)
        for frame in body if isinstance(body, list) else [body]:
            frames.append(json.dumps(frame, separators=(",", ":"), ensure_ascii=False))
    return frames


@pytest.mark.parametrize(
    ("sizes", "text"),
    [
        # Frames of 50 and 48 characters: 99 with the comma, 101 with the brackets.
        ([27, 25], "x"),
        # Frames of 33 characters, 53 bytes each: two pack into 67 characters, 109 bytes.
        ([10, 10, 10], "\u4e2d"),
    ],
    ids=["ascii-brackets", "utf8"],
)
async def test_queued_frames_are_packed_into_messages_no_larger_than_the_limit_in_bytes(
    sizes: list[int], text: str
) -> None:
    frames = [
        json.dumps({"type": "apply", "t": text * n}, separators=(",", ":"), ensure_ascii=False)
        for n in sizes
    ]
    limit = 100
    messages = await packed(frames, limit)
    assert unpacked(messages) == frames  # every frame, once, in order
    for message in messages:
        single = not message.startswith("[")
        assert single or len(message.encode()) <= limit, (len(message.encode()), limit)


async def test_two_sub_docs_non_ascii_batches_that_each_fit_both_commit_over_the_websocket(
    server_url: str, token: str
) -> None:
    """Each op is ~600 KB of UTF-8 (200,000 three-byte characters), under the server's 1 MiB
    frame limit; queued together they made one 1.2 MB message, the server closed the socket
    (1009) and one valid op was failed for good as `body_too_large`."""
    async with WorkspaceClient(server_url, token=token, config=fast_config()) as client:
        await client.connect(WS, timeout=TIMEOUT)
        for sub_doc in ("a", "b"):
            await client.apply_op(WS, sub_doc, NodeInsert(node_id="n", parent_id="root"))
        text = "\u4e2d" * 200_000
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                client.apply_op(WS, "a", NodeUpdate(node_id="n", set={"x": text})),
                client.apply_op(WS, "b", NodeUpdate(node_id="n", set={"x": text})),
                return_exceptions=True,
            ),
            TIMEOUT,
        )
        assert client.pending_count() == 0
    assert all(isinstance(outcome, Commit) for outcome in outcomes), outcomes
    for sub_doc in ("a", "b"):
        state = await server_state(server_url, sub_doc)
        assert state["state"]["nodes"]["n"]["fields"]["x"] == text


# -- transports switching under a batch in flight --------------------------------------------------


class SwitchingServer:
    """The first websocket eats one apply and closes without an ack; further handshakes are refused
    until the resend came over HTTP. Every later websocket first acks that lost `req` again, with a
    clock the server never gave (a stale answer), then serves applies normally."""

    def __init__(self) -> None:
        self.clock = 0
        self.sockets = 0
        self.http_posts: list[list[str]] = []
        self.ws_reqs: list[int] = []
        self.lost: tuple[int, list[str]] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/workspaces/{ws}/docs/{sub_doc}/ops", self.post_ops)
        app.router.add_get("/v1/workspaces/{ws}/socket", self.socket)
        return app

    def commit(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = []
        for op in ops:
            self.clock += 1
            results.append({"op_id": op["op_id"], "clock": self.clock, "duplicate": False})
        return results

    async def post_ops(self, request: web.Request) -> web.Response:
        ops = (await request.json())["ops"]
        self.http_posts.append([op["op_id"] for op in ops])
        return web.json_response({"results": self.commit(ops)})

    async def socket(self, request: web.Request) -> web.StreamResponse:
        if self.sockets and not self.http_posts:
            return web.json_response({"code": "unavailable"}, status=503)
        self.sockets += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        stale_sent = False
        async for message in ws:
            body = json.loads(message.data)
            for frame in body if isinstance(body, list) else [body]:
                if frame.get("type") != "apply":
                    continue
                self.ws_reqs.append(frame["req"])
                if self.sockets == 1:
                    self.lost = (frame["req"], [op["op_id"] for op in frame["ops"]])
                    await ws.close()
                    return ws
                assert self.lost is not None
                if not stale_sent:
                    stale_sent = True
                    req, op_ids = self.lost
                    stale = [{"op_id": op_id, "clock": 999, "duplicate": False} for op_id in op_ids]
                    await ws.send_json({"type": "ack", "req": req, "results": stale})
                results = self.commit(frame["ops"])
                await ws.send_json({"type": "ack", "req": frame["req"], "results": results})
        return ws


async def test_an_ack_for_a_batch_resent_over_http_arriving_on_the_reopened_socket_is_ignored(
    aiohttp_server: ServerFactory,
) -> None:
    fake = SwitchingServer()
    server = await aiohttp_server(fake.app())
    url = str(server.make_url("")).rstrip("/")
    async with WorkspaceClient(url, token="t", config=fast_config()) as client:
        await client.connect(WS, timeout=TIMEOUT)
        first = await asyncio.wait_for(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1)), TIMEOUT
        )
        assert fake.lost is not None
        assert fake.http_posts == [[first.op_id]]
        assert first.clock == 1  # the HTTP answer, not the socket's
        await client.connect(WS, timeout=TIMEOUT)  # the socket is back
        second = await asyncio.wait_for(
            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1)), TIMEOUT
        )
        assert fake.sockets == 2
        # The stale ack for the lost `req` came first and answered nothing: not the first op
        # again, not the second one in flight (batch ids are never reused across connections).
        assert second.clock == 2
        assert not second.duplicate
        assert len(fake.ws_reqs) == len(set(fake.ws_reqs)) == 2
        assert client.pending_count() == 0
        assert client.acknowledged_clock(WS, "tree") == 2


# -- close() racing apply_op ----------------------------------------------------------------------


async def test_ops_racing_close_are_committed_or_still_pending_and_replayed_exactly_once(
    server_url: str, token: str, tmp_path: Path
) -> None:
    outbox = tmp_path / "outbox.db"
    config = fast_config()
    client = WorkspaceClient(server_url, token=token, outbox=outbox, config=config)
    await client.start()
    await client.connect(WS, timeout=TIMEOUT)
    await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))
    tasks = []
    # Some ops answered, some in flight, some written only, some only decided when close starts.
    for pause in (0.02, 0.005, 0.0, None):
        tasks += [
            asyncio.ensure_future(
                client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1))
            )
            for _ in range(10)
        ]
        if pause is not None:
            await asyncio.sleep(pause)
    closing = asyncio.ensure_future(client.close())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):  # refused, not accepted and then lost
        await client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1))
    await asyncio.wait_for(closing, TIMEOUT)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, Commit | StillPendingError) for o in outcomes), outcomes
    pending = [o.op_id for o in outcomes if isinstance(o, StillPendingError)]

    async with WorkspaceClient(server_url, token=token, outbox=outbox, config=config) as again:
        assert again.pending_count() <= len(pending)  # answered ones may already be forgotten
        await again.wait_synced(timeout=TIMEOUT)
    log = await server_log(server_url, "tree")
    submitted = [o.op_id for o in outcomes if isinstance(o, Commit | StillPendingError)]
    assert [entry["op_id"] for entry in log[1:]] == submitted  # each once, in submission order
    clocks = {entry["op_id"]: entry["clock"] for entry in log}
    assert all(clocks[o.op_id] == o.clock for o in outcomes if isinstance(o, Commit))


# -- wait_synced while ops keep coming ------------------------------------------------------------


async def test_wait_synced_returns_only_once_every_op_submitted_before_it_is_answered(
    server_url: str, token: str
) -> None:
    async with FaultProxy(server_url) as proxy:
        proxy.delay = 0.01  # every answer takes a while: batches overlap the submissions
        async with WorkspaceClient(proxy.url, token=token, config=fast_config()) as client:
            await client.apply_op(WS, "tree", NodeInsert(node_id="n", parent_id="root"))

            async def produce() -> list[Commit]:
                made = []
                for _ in range(60):  # bounded: "synced" means nothing pending at all
                    made.append(
                        asyncio.ensure_future(
                            client.apply_op(WS, "tree", NodeIncrement(node_id="n", field="c", by=1))
                        )
                    )
                    await asyncio.sleep(0.001)
                return list(await asyncio.gather(*made))

            producer = asyncio.ensure_future(produce())
            checks = 0
            while not producer.done():
                await asyncio.sleep(0.005)
                awaited = [future for future, _ in client._futures.values()]
                if not awaited:
                    continue
                await client.wait_synced(timeout=TIMEOUT)
                checks += 1
                # Every op pending when the wait began was answered before it returned.
                assert all(future.done() for future in awaited)
            outcomes = await producer
            await client.wait_synced(timeout=TIMEOUT)
            assert client.pending_count() == 0
            assert client.synced
    assert checks >= 1
    assert [o.clock for o in outcomes] == list(range(2, 62))


# -- many sub-docs --------------------------------------------------------------------------------


@pytest.mark.parametrize("websocket", [True, False], ids=["websocket", "http"])
async def test_a_thousand_sub_docs_with_one_op_each_all_commit_in_one_batch_each(
    server_url: str, token: str, websocket: bool
) -> None:
    sent: list[Send] = []
    async with WorkspaceClient(
        server_url, token=token, config=fast_config(ops_over_websocket=websocket)
    ) as client:
        if websocket:
            await client.connect(WS, timeout=TIMEOUT)
        original = client._ops._send

        def record(send: Send) -> None:
            sent.append(send)
            original(send)

        client._ops._send = record  # type: ignore[method-assign]
        sub_docs = [f"d{i:04d}" for i in range(1000)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.apply_op(WS, d, NodeInsert(node_id="n", parent_id="root"))
                    for d in sub_docs
                )
            ),
            TIMEOUT,
        )
        assert client.pending_count() == 0
    assert [o.clock for o in outcomes] == [1] * 1000
    assert sorted(s.sub_doc for s in sent) == sub_docs  # one batch per sub-doc, none resent
    for sub_doc in ("d0000", "d0999"):
        assert [e["op_id"] for e in await server_log(server_url, sub_doc)] == [
            o.op_id for o, d in zip(outcomes, sub_docs, strict=True) if d == sub_doc
        ]
