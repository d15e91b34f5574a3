"""Acceptance soak: the whole promise at once, with real processes on the embedded SQLite server.

Concurrently, for a bounded run:

- 4 SDK writer processes (file outboxes; 2 send ops over the websocket, 2 over HTTP) apply a
  fixed plan of `node.insert` / `node.move` / `node.increment` ops to 3 sub-docs through a
  `FaultProxy` that cuts a share of server answers (after the server committed, before the client
  heard); writer 0 is SIGKILLed mid-stream and restarted on its outbox;
- 2 subscriber clients follow every sub-doc through another proxy that drops all its
  connections now and then;
- 3 `cv-worker` processes race on 2 non-coalescing `evaluate` requests per job, each cell paid
  to the counting fake provider under the compute lock and written with `ctx.apply_op`;
- the server itself is SIGKILLed once mid-run and restarted on the same database file.

Then: every intended op_id is in the log exactly once, in its writer's order; clocks are 1..n;
counters equal the intended increments; each subscriber saw exactly the log; every request is
done with each cell written once; the provider was paid once per (job, task).

Writer ops carry op_ids derived from (writer, plan index), so a restarted writer re-intends an op
its predecessor never got into the outbox under the same identity, and "intended" is the plan.

Run as `python -m tests.acceptance.test_soak writer ...` this module is the writer process.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from cv_mutations import NodeInsert
from cv_workspace_client import (
    ClientConfig,
    Committed,
    OpRejectedError,
    RequestOutcome,
    StillPendingError,
    WorkspaceClient,
)
from cv_workspace_client.stages import JOBS
from cv_workspace_client.testing import FaultProxy
from tests.acceptance.procs import free_port, mint_cli_token
from tests.acceptance.three_layers_procs import Proc, provider_stats, server_cmd, worker_cmd
from tests.chaos.writer import read_log, settle

pytestmark = pytest.mark.acceptance

WS: Final = "soak"
DOCS: Final = ("d0", "d1", "d2")
WRITERS: Final = 4  # even ones over the websocket, odd ones over HTTP
OPS_PER_WRITER: Final = 300
#: Ops a writer keeps in flight at once (pipelined; one sub-doc's ops still apply in order).
WINDOW: Final = 8
STAGE_JOBS: Final = 10
COLUMNS: Final = 3
CELLS: Final = STAGE_JOBS * COLUMNS
REQUESTS_PER_JOB: Final = 2  # not coalesced: only the compute lock stops a second payment
STAGE_WORKERS: Final = 3
SUBSCRIBER_CLIENTS: Final = 2
HTTP_CUT_P: Final = 0.08  # per server answer on the HTTP writers' proxy
WS_CUT_P: Final = 0.05  # per server chunk (after the 101) on the websocket writers' proxy
DROP_EVERY_S: Final = 0.7  # the subscribers' proxy drops everything this often
#: Every wait of the run is bounded by this; the run itself takes far less.
DEADLINE_S: Final = 90.0

#: Short retries: a soak waits out cuts and restarts, not the default production backoff.
FAST_RETRY: Final = ClientConfig(
    retry_base_seconds=0.05, retry_cap_seconds=0.5, retry_attempts=8, request_timeout_seconds=10
)


# -- the writers' plan ----------------------------------------------------------------------------


def op_id_of(writer: int, k: int) -> str:
    return f"soak-w{writer}-{k:05d}"


def plan(writer: int, count: int = OPS_PER_WRITER) -> list[tuple[str, dict[str, Any]]]:
    """Writer `writer`'s ops in submission order: per sub-doc, two folders and a leaf are
    inserted, then the leaf moves between the folders (every 4th op) and the shared counter is
    incremented. An op applied out of order would be rejected (`node_not_found`)."""
    ops: list[tuple[str, dict[str, Any]]] = []
    a, b, leaf = f"w{writer}.a", f"w{writer}.b", f"w{writer}.x"
    for k in range(count):
        doc, j = DOCS[k % len(DOCS)], k // len(DOCS)
        op: dict[str, Any]
        if j == 0:
            op = {"type": "node.insert", "node_id": a, "parent_id": "root"}
        elif j == 1:
            op = {"type": "node.insert", "node_id": b, "parent_id": "root"}
        elif j == 2:
            op = {"type": "node.insert", "node_id": leaf, "parent_id": a}
        elif j % 4 == 3:
            target = b if (j // 4) % 2 == 0 else a
            op = {"type": "node.move", "node_id": leaf, "parent_id": target, "index": 0}
        else:
            op = {"type": "node.increment", "node_id": "counter", "field": "n", "by": 1}
        op["op_id"] = op_id_of(writer, k)
        ops.append((doc, op))
    return ops


def parse_writer_op_id(op_id: str | None) -> tuple[int, int] | None:
    if op_id is None or not op_id.startswith("soak-w"):
        return None
    writer, k = op_id.removeprefix("soak-w").split("-")
    return int(writer), int(k)


# -- the writer process ---------------------------------------------------------------------------


async def run_writer(url: str, token: str, index: int, outbox: Path, transport: str) -> int:
    deadline = time.monotonic() + DEADLINE_S
    config = ClientConfig(
        retry_base_seconds=FAST_RETRY.retry_base_seconds,
        retry_cap_seconds=FAST_RETRY.retry_cap_seconds,
        retry_attempts=FAST_RETRY.retry_attempts,
        request_timeout_seconds=FAST_RETRY.request_timeout_seconds,
        ops_over_websocket=transport == "ws",
    )
    ops = plan(index)
    rejected: list[str] = []
    async with WorkspaceClient(url, token=token, outbox=outbox, config=config) as client:
        # A predecessor's outbox is replayed first; once it is answered, the log says where the
        # plan resumes (ops it never got into the outbox are re-intended under the same op_id).
        restored = client.pending_count()
        await settle(client, deadline)
        done = [
            key[1]
            for doc in DOCS
            for entry in await read_log(client, doc, WS)
            if (key := parse_writer_op_id(entry.op_id)) is not None and key[0] == index
        ]
        start = max(done, default=-1) + 1
        print(f"writer {index} resumes at {start} (restored {restored})", flush=True)
        window = asyncio.Semaphore(WINDOW)

        async def one(doc: str, op: dict[str, Any]) -> None:
            try:
                await client.apply_op(WS, doc, op)
            except StillPendingError:
                pass  # it stays in the outbox under its op_id; settle() sees it through
            except OpRejectedError as exc:
                rejected.append(f"{op['op_id']}: {exc.code}")
            finally:
                window.release()

        tasks: list[asyncio.Task[None]] = []
        for doc, op in ops[start:]:
            await window.acquire()
            tasks.append(asyncio.create_task(one(doc, op)))
        await asyncio.gather(*tasks)
        await settle(client, deadline)
        pending = client.pending_count()
    print(f"writer {index} done pending={pending} rejected={rejected}", flush=True)
    return 0 if pending == 0 and not rejected else 3


def writer_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="soak writer")
    parser.add_argument("url")
    parser.add_argument("token")
    parser.add_argument("index", type=int)
    parser.add_argument("outbox", type=Path)
    parser.add_argument("transport", choices=["ws", "http"])
    args = parser.parse_args(argv)
    return asyncio.run(run_writer(args.url, args.token, args.index, args.outbox, args.transport))


# -- the test's side ------------------------------------------------------------------------------


class Progress:
    """One condition every subscriber notifies: the test waits for states, never for time."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout), self.changed:
            await self.changed.wait_for(predicate)


class Follower:
    """One subscription: every (clock, op_id) it was handed, duplicates included."""

    def __init__(self, client: WorkspaceClient, doc: str, progress: Progress) -> None:
        self.doc = doc
        self.seen: list[tuple[int, str | None]] = []
        self.cells: list[tuple[str, str]] = []
        self.by_writer: Counter[int] = Counter()
        self._progress = progress
        self.task = asyncio.create_task(self._follow(client))

    @property
    def clock(self) -> int:
        return self.seen[-1][0] if self.seen else 0

    async def _follow(self, client: WorkspaceClient) -> None:
        try:
            async with client.subscribe(WS, self.doc, since=0) as subscription:
                async for committed in subscription:
                    assert isinstance(committed, Committed)  # never compacted here
                    self.seen.append((committed.clock, committed.op_id))
                    if (key := parse_writer_op_id(committed.op_id)) is not None:
                        self.by_writer[key[0]] += 1
                    self.cells += cells_of(committed)
                    await self._progress.notify()
        finally:
            await self._progress.notify()  # a failed subscription must wake its waiters

    def check_alive(self) -> None:
        if self.task.done():
            self.task.result()  # surfaces the subscription's error
            raise AssertionError(f"subscription to {self.doc} ended early")


def cells_of(committed: Committed) -> list[tuple[str, str]]:
    raw = committed.op.model_dump()
    if raw["type"] != "node.update":
        return []
    return [(raw["node_id"], key) for key in raw["set"] if key.startswith("eval:")]


def caught_up(follower: Follower, head: int) -> Callable[[], bool]:
    return lambda: follower.clock >= head or follower.task.done()


async def drop_now_and_then(proxy: FaultProxy, stop: asyncio.Event) -> None:
    """The subscribers' network: every connection dropped every DROP_EVERY_S (a fault schedule,
    not a wait for a state), until `stop`."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), DROP_EVERY_S)
        except TimeoutError:
            proxy.drop_all()


@dataclass
class Writer:
    index: int
    outbox: Path
    log: Path
    args: list[str]
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)

    async def spawn(self) -> None:
        with self.log.open("a") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.acceptance.test_soak", "writer", *self.args,
                stdout=out, stderr=out,
            )  # fmt: skip
        self.procs.append(proc)

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.procs[-1]

    def outbox_rows(self) -> int:
        with sqlite3.connect(self.outbox) as db:
            return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])


@dataclass
class Servers:
    """The server process, replaced by a new one on the same file and port after its kill."""

    db: Path
    port: int
    log: Path
    current: Proc | None = None

    def start(self) -> None:
        shrunk = {"lease": 4.0, "lock_ttl": 5.0, "backoff": 0.5}
        self.current = Proc(server_cmd(self.db, self.port, **shrunk), self.log, "listening on")
        self.current.start()

    def kill(self) -> None:
        assert self.current is not None
        self.current.kill()
        self.current.stop()  # only closes its files: it is dead


@dataclass
class Report:
    logs: dict[str, list[Committed]]
    states: dict[str, dict[str, Any]]
    followers: list[Follower]
    outcomes: list[RequestOutcome]
    writers: list[Writer]
    cuts: int
    drops: int
    kill_points: dict[str, tuple[int, int]]
    #: op_ids of the ops the test itself put in the writers' sub-docs.
    seeded: set[str]


async def soak(tmp_path: Path, servers: Servers, token: str, url: str, provider_url: str) -> Report:
    progress = Progress()
    stop_faults = asyncio.Event()
    async with AsyncExitStack() as stack:
        http_proxy = await stack.enter_async_context(FaultProxy(url, seed=1))
        ws_proxy = await stack.enter_async_context(FaultProxy(url, seed=2))
        sub_proxy = await stack.enter_async_context(FaultProxy(url, seed=3))
        # The worst moment: the server committed, the answer is lost on the way back.
        http_proxy.cut_chunks(HTTP_CUT_P)
        ws_proxy.cut_chunks(WS_CUT_P, skip_chunks=1)
        admin = await stack.enter_async_context(
            WorkspaceClient(url, token=token, config=FAST_RETRY)
        )

        seeded: set[str] = set()
        for doc in DOCS:
            commit = await admin.apply_op(
                WS, doc, NodeInsert(node_id="counter", parent_id="root", fields={"n": 0})
            )
            seeded.add(commit.op_id)
        jobs = [f"J{i:02d}" for i in range(STAGE_JOBS)]
        for outcome in await admin.apply_ops(
            WS, JOBS, [NodeInsert(node_id=j, parent_id="root", fields={"title": j}) for j in jobs]
        ):
            assert not isinstance(outcome, Exception), outcome

        followers: list[Follower] = []
        for _ in range(SUBSCRIBER_CLIENTS):
            client = await stack.enter_async_context(
                WorkspaceClient(sub_proxy.url, token=token, config=FAST_RETRY)
            )
            followers += [Follower(client, doc, progress) for doc in (*DOCS, JOBS)]

        async def close_followers() -> None:
            for follower in followers:
                follower.task.cancel()
            await asyncio.gather(*(f.task for f in followers), return_exceptions=True)

        stack.push_async_callback(close_followers)
        dropper = asyncio.create_task(drop_now_and_then(sub_proxy, stop_faults))

        columns = [{"name": f"c{i}", "prompt": f"Soak criterion {i}."} for i in range(COLUMNS)]

        async def enqueue_jobs(some: list[str]) -> list[str]:
            enqueued = await asyncio.gather(
                *(
                    admin.enqueue(
                        WS,
                        stage="evaluate",
                        job_id=job,
                        input={"columns": columns},
                        deterministic=False,
                        idempotency_key=f"soak-{job}-{n}",
                    )
                    for job in some
                    for n in range(REQUESTS_PER_JOB)
                )
            )
            return [e.request_id for e in enqueued]

        # Half the stage jobs now, half once the server was killed and restarted: the kill is
        # then mid-stages by construction. All of them up front, a loaded machine ran every
        # stage before the writers were half done, and the kill landed after the stages.
        request_ids = await enqueue_jobs(jobs[: STAGE_JOBS // 2])

        writers: list[Writer] = []
        for i in range(WRITERS):
            transport = "ws" if i % 2 == 0 else "http"
            proxy = ws_proxy if transport == "ws" else http_proxy
            outbox = tmp_path / f"writer{i}.outbox.db"
            args = [proxy.url, token, str(i), str(outbox), transport]
            writers.append(Writer(i, outbox, tmp_path / f"writer{i}.log", args))
        for writer in writers:
            await writer.spawn()

        first = followers[: len(DOCS) + 1]  # the first client's subscriptions
        jobs_follower = first[-1]

        def writer_ops_seen(index: int | None = None) -> int:
            for follower in first:
                follower.check_alive()
            return sum(
                f.by_writer[index] if index is not None else sum(f.by_writer.values())
                for f in first[:-1]
            )

        kill_points: dict[str, tuple[int, int]] = {}
        # (1) writer 0 SIGKILLed a third of the way through its plan, restarted on its outbox.
        await progress.wait_for(lambda: writer_ops_seen(0) >= OPS_PER_WRITER // 3, 45)
        assert writers[0].proc.returncode is None, "writer 0 ended before its kill"
        writers[0].proc.kill()
        await writers[0].proc.wait()
        kill_points["writer0"] = (writer_ops_seen(0), len(jobs_follower.cells))
        await writers[0].spawn()

        # (3) the server SIGKILLed with writer ops and paid cells both under way, restarted on
        # the same file and port (the serving lock of the dead process must be free).
        total = WRITERS * OPS_PER_WRITER
        await progress.wait_for(
            lambda: writer_ops_seen() >= total // 2 and len(jobs_follower.cells) >= CELLS // 4,
            45,
        )
        kill_points["server"] = (writer_ops_seen(), len(jobs_follower.cells))
        servers.kill()
        await asyncio.to_thread(servers.start)
        request_ids += await enqueue_jobs(jobs[STAGE_JOBS // 2 :])
        request_ids = sorted(set(request_ids))
        assert len(request_ids) == STAGE_JOBS * REQUESTS_PER_JOB

        # (4) every stage request, waited for through the restart.
        outcomes = await asyncio.gather(
            *(admin.wait_request(WS, rid, timeout=60) for rid in request_ids)
        )
        async with asyncio.timeout(60):
            codes = [await w.proc.wait() for w in writers]
        logs_text = {w.index: w.log.read_text() for w in writers}
        assert codes == [0] * WRITERS, logs_text

        logs = {doc: await read_log(admin, doc, WS) for doc in (*DOCS, JOBS)}
        states = {doc: (await admin.get_state(WS, doc))[1].to_json() for doc in DOCS}
        for follower in followers:
            await progress.wait_for(caught_up(follower, logs[follower.doc][-1].clock), 30)
            follower.check_alive()
        stop_faults.set()
        await dropper
        return Report(
            logs=logs,
            states=states,
            followers=followers,
            outcomes=list(outcomes),
            writers=writers,
            cuts=http_proxy.stats.cuts + ws_proxy.stats.cuts,
            drops=sub_proxy.stats.dropped,
            kill_points=kill_points,
            seeded=seeded,
        )
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: the stack may swallow)


def test_soak_keeps_the_whole_promise_under_every_fault_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    db = tmp_path / "cv.db"
    token = mint_cli_token(db, WS)
    servers = Servers(db, free_port(), tmp_path / "server.log")
    provider = Proc(
        ["-m", "cv_workspace_client.stages.fake_provider", "--delay", "0.25"],
        tmp_path / "provider.log",
        "listening on",
    )
    url = f"http://127.0.0.1:{servers.port}"
    workers: list[Proc] = []
    report: Report | None = None
    try:
        servers.start()
        provider.start()
        for i in range(STAGE_WORKERS):
            args = worker_cmd(url, token, provider.url, f"soak{i}", 1.0)
            workers.append(Proc(args, tmp_path / f"worker{i}.log", "ready").spawn())
        for worker in workers:
            worker.wait_ready()
        # One bound over the whole run on top of each wait's own: it stops by itself.
        report = asyncio.run(
            asyncio.wait_for(soak(tmp_path, servers, token, url, provider.url), 2 * DEADLINE_S)
        )
        stats = provider_stats(provider.url)
    finally:
        for proc in [*workers, provider]:
            proc.stop()
        if servers.current is not None:
            servers.current.stop()
    assert report is not None

    # Layer 3: every intended op once, in its writer's order; clocks 1..n; counters add up.
    intended = {op_id_of(w, k) for w in range(WRITERS) for k in range(OPS_PER_WRITER)}
    logged = [entry.op_id for doc in DOCS for entry in report.logs[doc]]
    duplicates = [op_id for op_id, n in Counter(logged).items() if n > 1]
    assert not duplicates, f"applied more than once: {duplicates[:10]}"
    missing = sorted((intended | report.seeded) - set(logged))
    assert set(logged) == intended | report.seeded, f"intended ops not in the log: {missing[:10]}"
    for doc in (*DOCS, JOBS):
        clocks = [entry.clock for entry in report.logs[doc]]
        assert clocks == list(range(1, len(clocks) + 1)), f"{doc}: clocks are not 1..n"
    for w in range(WRITERS):
        ops = plan(w)
        for doc in DOCS:
            ks = [
                key[1]
                for entry in report.logs[doc]
                if (key := parse_writer_op_id(entry.op_id)) is not None and key[0] == w
            ]
            assert ks == sorted(ks), f"writer {w}'s ops to {doc} applied out of order"
            moves = [op for d, op in ops if d == doc and op["type"] == "node.move"]
            leaf = report.states[doc]["nodes"][f"w{w}.x"]
            assert leaf["parent"] == moves[-1]["parent_id"], f"{doc}: w{w}'s last move lost"
    for doc in DOCS:
        increments = sum(
            1 for w in range(WRITERS) for d, op in plan(w) if d == doc
            if op["type"] == "node.increment"
        )  # fmt: skip
        assert report.states[doc]["nodes"]["counter"]["fields"]["n"] == increments, doc
    for writer in report.writers:
        assert writer.outbox_rows() == 0, f"writer {writer.index}'s outbox is not empty"

    # Every subscriber saw every clock exactly once, in order: its digest is the log's.
    for follower in report.followers:
        expected = [(entry.clock, entry.op_id) for entry in report.logs[follower.doc]]
        assert follower.seen == expected, f"a subscriber of {follower.doc} diverged from the log"

    # Layers 1 and 2: every request done; every cell paid once and written once.
    assert [o.status for o in report.outcomes] == ["done"] * len(report.outcomes)
    assert all(o.error is None for o in report.outcomes), [o.error for o in report.outcomes]
    cells = sorted(
        (job, f"eval:c{c}")
        for job in (f"J{i:02d}" for i in range(STAGE_JOBS))
        for c in range(COLUMNS)
    )
    log_cells = [cell for entry in report.logs[JOBS] for cell in cells_of(entry)]
    assert sorted(log_cells) == cells, "a cell written twice, or never"
    computed = Counter(
        (o.result["job_id"], name) for o in report.outcomes for name in o.result["computed"]
    )
    assert all(n == 1 for n in computed.values()), f"computed by two requests: {computed}"
    assert stats["calls"] == CELLS, f"provider paid {stats['calls']} times for {CELLS} cells"
    assert sorted(stats["by_prompt"].values()) == [1] * CELLS

    # The faults landed mid-run (else the test tested nothing).
    writer_kill, server_kill = report.kill_points["writer0"], report.kill_points["server"]
    assert writer_kill[0] < OPS_PER_WRITER, "writer 0 was killed after it finished"
    assert server_kill[0] < WRITERS * OPS_PER_WRITER, (
        f"server killed after the writes: {server_kill}"
    )
    assert server_kill[1] < CELLS, f"server killed after the stages: {server_kill}"
    assert report.cuts > 0, "no writer connection was cut"
    assert report.drops > 0, "no subscriber connection was dropped"
    redriven = sum(1 for o in report.outcomes if o.request and o.request.dequeue_count > 1)
    print(
        f"soak: ops={len(logged)} cuts={report.cuts} sub_drops={report.drops} "
        f"restarts=writer:1,server:1 kills_at(writer0={writer_kill}, server={server_kill}) "
        f"provider_calls={stats['calls']}/{CELLS} requests={len(report.outcomes)} "
        f"redriven={redriven} wall={time.monotonic() - started:.1f}s"
    )


if __name__ == "__main__":
    if sys.argv[1:2] != ["writer"]:
        raise SystemExit(
            "usage: python -m tests.acceptance.test_soak writer URL TOKEN I OUTBOX ws|http"
        )
    raise SystemExit(writer_main(sys.argv[2:]))
