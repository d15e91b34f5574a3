"""A sub-doc's state as the server serves it is always a pure fold of its committed log.

Random op programs run against the real server (SQLite, or PostgreSQL with two instances each
with its own cache), with everything that could let a cached state drift from the log: reducer
rejections, atomic batches with a rejected op, resent batches (duplicates) and op_id reuse,
LRU eviction (`subdoc_cache_limit` 1-2), snapshots (`snapshot_every` 1-3), appends whose write
fails (a trigger raising ABORT or, on SQLite, ROLLBACK) or whose COMMIT fails (a deferred check),
concurrent bursts sharing group commits, and restarts.

After every step, for every sub-doc (the same names in two workspaces):

- the log read through `GET .../ops?since=` is gap-free from clock 1 and every entry replays;
- `GET .../docs/{sub_doc}` on every instance answers the log's head and exactly `fold(log)`;
- the stored snapshot is at most the head and equals the fold of the log up to its clock;
- every new log entry is one an answer reported as freshly committed, with the op as sent, and
  every op_id has one decision, replayed identically to every retry;
- what was read concurrently during a burst (states and log pages) is a prefix of the final log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cv_mutations import REJECTION_CODES, OpRejected, SubDocState, apply_op, new_op_id, parse_op
from cv_server import ServerConfig, create_app
from cv_server.cli import _with_schema
from cv_server.oplog.pipeline import ATOMIC_ABORTED, OP_ID_REUSE
from tests.mutations.strategies import aimed_op, pool_trees
from tests.pg.helpers import fresh_schema
from tests.server.conftest import SECRET, auth

WORKSPACES: Final = ("w1", "w2")
#: The same sub-doc names in both workspaces: a snapshot or cache entry keyed on the wrong one
#: would show up as another sub-doc's state.
KEYS: Final = tuple((ws, doc) for ws in WORKSPACES for doc in ("a", "b"))
HEADERS: Final = auth(*WORKSPACES)
#: `GET .../ops` pages this small make every log read page several times.
PAGE: Final = 3
#: Bound on every request: a hang fails the example instead of the whole run.
REQUEST_SECONDS: Final = 20.0

Key = tuple[str, str]
Raw = dict[str, Any]

# Poison ops carry a meta marker a trigger looks for: the append that writes one fails in the
# database, after the pipeline already changed the cached state.
ABORT, ROLLBACK, COMMIT = "abort", "rollback", "commit"


def _marker(kind: str) -> str:
    # Both backends store the op compactly (orjson / json.dumps with (",", ":")).
    return f'%"poison":"{kind}"%'


SQLITE_POISON: Final = (
    "CREATE TABLE poison_parent (id INTEGER PRIMARY KEY)",
    "CREATE TABLE poison_child (parent INTEGER"
    " REFERENCES poison_parent(id) DEFERRABLE INITIALLY DEFERRED)",
    "CREATE TRIGGER poison_abort BEFORE INSERT ON workspace_sub_doc_ops"
    f" WHEN NEW.op LIKE '{_marker(ABORT)}' BEGIN SELECT RAISE(ABORT, 'poisoned op'); END",
    "CREATE TRIGGER poison_rollback BEFORE INSERT ON workspace_sub_doc_ops"
    f" WHEN NEW.op LIKE '{_marker(ROLLBACK)}' BEGIN SELECT RAISE(ROLLBACK, 'poisoned op'); END",
    # A row whose deferred foreign key fails at COMMIT: the whole group's COMMIT fails.
    "CREATE TRIGGER poison_commit AFTER INSERT ON workspace_sub_doc_ops"
    f" WHEN NEW.op LIKE '{_marker(COMMIT)}' BEGIN INSERT INTO poison_child VALUES (42); END",
)
POSTGRES_POISON: Final = (
    "CREATE FUNCTION raise_poison() RETURNS trigger LANGUAGE plpgsql"
    " AS $$ BEGIN RAISE EXCEPTION 'poisoned op'; END $$",
    "CREATE TRIGGER poison_abort BEFORE INSERT ON workspace_sub_doc_ops FOR EACH ROW"
    f" WHEN (NEW.op::text LIKE '{_marker(ABORT)}') EXECUTE FUNCTION raise_poison()",
    # Deferred: it fires at COMMIT, so the COMMIT itself fails.
    "CREATE CONSTRAINT TRIGGER poison_commit AFTER INSERT ON workspace_sub_doc_ops"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
    f" WHEN (NEW.op::text LIKE '{_marker(COMMIT)}') EXECUTE FUNCTION raise_poison()",
)


def fold(entries: list[Raw]) -> list[str]:
    """The state text after each prefix of the log (`[0]`: empty), replaying from clock 1."""
    state = SubDocState.empty()
    prefixes = [state.dumps()]
    for entry in entries:
        try:
            apply_op(state, parse_op(entry["op"]))
        except OpRejected as exc:  # pragma: no cover - the failure being hunted
            raise AssertionError(f"logged op at clock {entry['clock']} replays as {exc}") from exc
        prefixes.append(state.dumps())
    return prefixes


class ServerError(Exception):
    """A read answered with something other than 200."""


@dataclass
class Sent:
    key: Key
    ops: list[Raw]
    atomic: bool
    may_fail: bool
    status: int = 0
    results: list[Raw] = field(default_factory=list)


@dataclass
class Backend:
    """What differs between SQLite and PostgreSQL: the config, the instance count, and direct
    reads of the database (snapshots) and DDL (the poison triggers)."""

    config: ServerConfig
    instances: int
    poisons: tuple[str, ...]
    snapshot: Callable[[Key], Any]  # async: (clock, state text) | None
    install: Callable[[], Any]  # async: create the poison triggers


def sqlite_snapshot_reader(path: Path) -> Callable[[Key], Awaitable[tuple[int, str] | None]]:
    """Read a sub-doc's stored snapshot (clock, state text) straight from the SQLite file."""

    async def snapshot(key: Key) -> tuple[int, str] | None:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            row = conn.execute(
                "SELECT clock, state FROM workspace_sub_doc_snapshots"
                " WHERE workspace_id = ? AND sub_doc = ?",
                key,
            ).fetchone()
        return None if row is None else (int(row[0]), row[1])

    return snapshot


@contextlib.asynccontextmanager
async def sqlite_backend(**overrides: Any) -> AsyncIterator[Backend]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cv.db"

        snapshot = sqlite_snapshot_reader(path)

        async def install() -> None:
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                for statement in SQLITE_POISON:
                    conn.execute(statement)

        config = ServerConfig(db_path=path, token_secret=SECRET, **overrides)
        yield Backend(config, 1, (ABORT, ROLLBACK, COMMIT), snapshot, install)


def pg_snapshot_reader(conn: Any) -> Callable[[Key], Awaitable[tuple[int, str] | None]]:
    """Read a sub-doc's stored snapshot (clock, state text) straight from PostgreSQL."""

    async def snapshot(key: Key) -> tuple[int, str] | None:
        row = await conn.fetchrow(
            "SELECT clock, state::text AS state FROM workspace_sub_doc_snapshots"
            " WHERE workspace_id = $1 AND sub_doc = $2",
            *key,
        )
        return None if row is None else (int(row["clock"]), row["state"])

    return snapshot


@contextlib.asynccontextmanager
async def postgres_backend(postgres_url: str, **overrides: Any) -> AsyncIterator[Backend]:
    async with fresh_schema(postgres_url) as schema:
        conn = await asyncpg.connect(postgres_url, server_settings={"search_path": schema})
        try:
            snapshot = pg_snapshot_reader(conn)

            async def install() -> None:
                for statement in POSTGRES_POISON:
                    await conn.execute(statement)

            config = ServerConfig(
                database_url=_with_schema(postgres_url, schema), token_secret=SECRET, **overrides
            )
            yield Backend(config, 2, (ABORT, COMMIT), snapshot, install)
        finally:
            await conn.close()


class FoldCheck:
    """Drives the servers and checks the invariants of the module docstring."""

    def __init__(self, backend: Backend, data: st.DataObject) -> None:
        self.backend = backend
        self.data = data
        self.clients: list[TestClient[Any, Any]] = []
        self.tags = itertools.count()
        #: Per sub-doc: the log as last checked and the state text after each of its prefixes.
        self.logs: dict[Key, list[Raw]] = {key: [] for key in KEYS}
        self.prefixes: dict[Key, list[str]] = {key: [SubDocState.empty().dumps()] for key in KEYS}
        #: What ops are aimed at (see `batch`).
        self.model: dict[Key, SubDocState] = {key: SubDocState.empty() for key in KEYS}
        self.history: list[Sent] = []
        self.unchecked: list[Sent] = []
        #: (key, op_id) -> (op as sent, its decision: ("clock", n) or ("code", c)).
        self.decided: dict[tuple[Key, str], tuple[Raw, tuple[str, Any]]] = {}
        self.first_answers: set[tuple[Key, str]] = set()
        self.reuses: list[tuple[Key, str, Raw]] = []
        #: (key, clock, state text) and (key, since, head, entries) read during bursts.
        self.state_reads: list[tuple[Key, int, str]] = []
        self.page_reads: list[tuple[Key, int, int, list[Raw]]] = []

    # -- servers ---------------------------------------------------------------------------------

    async def start(self) -> None:
        for _ in range(self.backend.instances):
            client = TestClient(TestServer(create_app(self.backend.config), host="127.0.0.1"))
            await client.start_server()
            self.clients.append(client)

    async def stop(self) -> None:
        clients, self.clients = self.clients, []
        for client in clients:
            await client.close()

    def client(self) -> TestClient[Any, Any]:
        return self.clients[self.data.draw(st.integers(0, len(self.clients) - 1), label="at")]

    # -- requests --------------------------------------------------------------------------------

    async def post(self, sent: Sent, client: TestClient[Any, Any]) -> None:
        ws, doc = sent.key
        body = {"ops": sent.ops, "atomic": sent.atomic}
        async with asyncio.timeout(REQUEST_SECONDS):
            resp = await client.post(
                f"/v1/workspaces/{ws}/docs/{doc}/ops", json=body, headers=HEADERS
            )
            sent.status = resp.status
            answer = await resp.json(content_type=None)
        if resp.status == 200:
            sent.results = answer["results"]
        else:
            # Only a write the database refused may fail, and then nothing of it is applied.
            assert resp.status == 500, (resp.status, answer)
            assert sent.may_fail, (answer, sent)
        self.unchecked.append(sent)

    async def get_state(self, key: Key, client: TestClient[Any, Any]) -> tuple[int, str]:
        ws, doc = key
        async with asyncio.timeout(REQUEST_SECONDS):
            resp = await client.get(f"/v1/workspaces/{ws}/docs/{doc}", headers=HEADERS)
            if resp.status != 200:
                raise ServerError(resp.status, await resp.text())
            body = await resp.json()
        return body["clock"], SubDocState.from_json(body["state"]).dumps()

    async def get_page(
        self, key: Key, since: int, client: TestClient[Any, Any]
    ) -> tuple[int, list[Raw]]:
        ws, doc = key
        async with asyncio.timeout(REQUEST_SECONDS):
            resp = await client.get(
                f"/v1/workspaces/{ws}/docs/{doc}/ops", params={"since": since}, headers=HEADERS
            )
            assert resp.status == 200, await resp.text()
            body = await resp.json()
        return body["clock"], body["ops"]

    async def read_log(self, key: Key, client: TestClient[Any, Any]) -> tuple[int, list[Raw]]:
        entries: list[Raw] = []
        while True:
            head, page = await self.get_page(key, len(entries), client)
            entries += page
            if not page or len(entries) >= head:
                return head, entries

    # -- drawing ops -----------------------------------------------------------------------------

    def batch(self, key: Key, *, poison: bool) -> Sent:
        """1-4 ops aimed at the sub-doc's model, each also aimed past the ones before it.

        The model applies every op drawn, in the order drawn, whatever the server did: aiming
        at the server's state would make the draws depend on the order concurrent appends
        committed in, which Hypothesis cannot replay."""
        draw = self.data.draw
        scratch = self.model[key]
        ops: list[Raw] = []
        may_fail = False
        for _ in range(draw(st.integers(1, 4), label="ops")):
            op = aimed_op(self.data, scratch)
            with contextlib.suppress(OpRejected):
                apply_op(scratch, op)
            raw = op.model_dump(mode="json", exclude_none=True)
            meta: Raw = {"tag": next(self.tags)}
            if poison and draw(st.integers(0, 5), label="poison?") == 0:
                meta["poison"] = draw(st.sampled_from(self.backend.poisons), label="poison")
                may_fail = True
            raw["meta"] = meta
            if draw(st.integers(0, 4), label="op_id?"):
                raw["op_id"] = new_op_id()
            ops.append(raw)
        sent = Sent(key, ops, draw(st.booleans(), label="atomic"), may_fail)
        self.history.append(sent)
        return sent

    def key(self) -> Key:
        return self.data.draw(st.sampled_from(KEYS), label="key")

    # -- steps -----------------------------------------------------------------------------------

    async def step_post(self) -> None:
        await self.post(self.batch(self.key(), poison=True), self.client())

    async def step_resend(self) -> None:
        await self.post(self.resend(), self.client())

    def resend(self) -> Sent:
        """An earlier batch again (duplicates), atomic or not, maybe with an op_id reused."""
        before = self.data.draw(st.sampled_from(self.history), label="resend")
        ops = [dict(op) for op in before.ops]
        with_ids = [op for op in ops if "op_id" in op]
        reuse: bool = bool(with_ids) and self.data.draw(st.booleans(), label="reuse")
        if reuse:
            # Same op_id, another op: the server must refuse it as op_id_reuse.
            changed = self.data.draw(st.sampled_from(with_ids), label="changed")
            changed["meta"] = {**changed["meta"], "tag": next(self.tags)}
        sent = Sent(before.key, ops, self.data.draw(st.booleans(), label="atomic"), before.may_fail)
        self.history.append(sent)
        return sent

    async def step_burst(self) -> None:
        """Concurrent posts (sharing group commits and lanes) and reads on every instance."""
        draw = self.data.draw
        poison = draw(st.booleans(), label="poisoned burst")
        posts = [
            self.resend()
            if draw(st.booleans(), label="again")
            else self.batch(self.key(), poison=poison)
            for _ in range(draw(st.integers(2, 5), label="n"))
        ]
        may_fail = any(sent.may_fail for sent in posts)
        for sent in posts:
            sent.may_fail = may_fail  # a failed COMMIT fails every append of its group
        reads = [(self.key(), draw(st.booleans(), label="state?")) for _ in range(3)]
        # Every draw before the first coroutine: a draw that ends the example must not leave
        # coroutines never awaited.
        at = [self.client() for _ in range(len(posts) + len(reads))]
        tasks = [self.post(sent, client) for sent, client in zip(posts, at, strict=False)]
        tasks += [
            self.read_during(key, is_state, client, may_fail)
            for (key, is_state), client in zip(reads, at[len(posts) :], strict=True)
        ]
        await asyncio.gather(*tasks)

    async def read_during(
        self, key: Key, is_state: bool, client: TestClient[Any, Any], may_fail: bool
    ) -> None:
        try:
            if is_state:
                clock, text = await self.get_state(key, client)
                self.state_reads.append((key, clock, text))
            else:
                since = len(self.logs[key])
                head, entries = await self.get_page(key, since, client)
                self.page_reads.append((key, since, head, entries))
        except ServerError:
            # On SQLite a state read is a job of the writer's group: a COMMIT that fails fails
            # it too (it may have read the group's rows). Nothing it read is kept.
            assert may_fail
            assert is_state

    async def step_restart(self) -> None:
        await self.stop()
        await self.start()

    # -- the invariants --------------------------------------------------------------------------

    async def check(self) -> None:
        fresh: dict[Key, dict[int, Raw]] = {key: {} for key in KEYS}
        for sent in self.unchecked:
            self.check_answers(sent, fresh[sent.key])
        # The sub-docs just written first: with a cache of one or two, reading the others
        # first would evict them, and a state wrongly cached would be rebuilt before it is read.
        touched = list(dict.fromkeys(sent.key for sent in reversed(self.unchecked)))
        self.unchecked.clear()
        for key in [*touched, *(key for key in KEYS if key not in touched)]:
            await self.check_sub_doc(key, fresh[key])
        for key, op_id, raw in self.reuses:
            decided = self.decided.get((key, op_id))
            assert decided is not None, (key, op_id, raw)
            assert decided[0] != raw, (key, op_id, raw, decided)
        self.reuses.clear()
        for key, clock, text in self.state_reads:
            assert clock < len(self.prefixes[key]), (key, clock)
            assert text == self.prefixes[key][clock], (key, clock)
        self.state_reads.clear()
        for key, since, head, entries in self.page_reads:
            log = self.logs[key]
            assert since + len(entries) <= head <= len(log), (key, since, head, len(entries))
            assert entries == log[since : since + len(entries)], key
        self.page_reads.clear()

    def check_answers(self, sent: Sent, fresh: dict[int, Raw]) -> None:
        if sent.status != 200:
            return
        assert len(sent.results) == len(sent.ops)
        failed = any("error" in result for result in sent.results)
        for raw, result in zip(sent.ops, sent.results, strict=True):
            op_id = raw.get("op_id")
            assert result["op_id"] == op_id
            if "error" in result:
                code = result["error"]["code"]
                assert code in REJECTION_CODES | {ATOMIC_ABORTED, OP_ID_REUSE}, result
                assert sent.atomic or code != ATOMIC_ABORTED, result
                if code == OP_ID_REUSE:
                    assert op_id is not None
                    self.reuses.append((sent.key, op_id, raw))
                elif code in REJECTION_CODES and op_id is not None:
                    self.decide(sent.key, op_id, raw, ("code", code), result["duplicate"])
                continue
            clock = result["clock"]
            if result["duplicate"]:
                assert op_id is not None, result
            else:
                # All or nothing: an atomic batch with a rejection applied none of its ops.
                assert not (sent.atomic and failed), sent
                assert clock not in fresh, (clock, sent)
                fresh[clock] = raw
            if op_id is not None:
                self.decide(sent.key, op_id, raw, ("clock", clock), result["duplicate"])

    def decide(self, key: Key, op_id: str, raw: Raw, decision: tuple[str, Any], dup: bool) -> None:
        """One decision per op_id, the same in every answer, and only one answer not a replay."""
        known = self.decided.setdefault((key, op_id), (raw, decision))
        assert known == (raw, decision), (key, op_id, known, raw, decision)
        if not dup:
            assert (key, op_id) not in self.first_answers, f"{key}: {op_id} decided twice"
            self.first_answers.add((key, op_id))

    async def check_sub_doc(self, key: Key, fresh: dict[int, Raw]) -> None:
        before = len(self.logs[key])
        # The state first, while what was just written may still be cached; then the log.
        states = [await self.get_state(key, client) for client in self.clients]
        head, log = await self.read_log(key, self.client())
        assert head == len(log), (key, head, len(log))
        assert [entry["clock"] for entry in log] == list(range(1, head + 1)), key
        assert log[:before] == self.logs[key], f"{key}: the committed log changed"
        op_ids = [entry["op_id"] for entry in log if entry["op_id"] is not None]
        assert len(op_ids) == len(set(op_ids)), f"{key}: an op_id committed twice"
        # Every new entry is an op some answer reported as freshly committed, as it was sent.
        assert sorted(fresh) == list(range(before + 1, head + 1)), (key, sorted(fresh), before)
        for clock, raw in fresh.items():
            assert log[clock - 1]["op"] == raw, (key, clock)
            assert log[clock - 1]["op_id"] == raw.get("op_id"), (key, clock)
        prefixes = fold(log)
        for clock, text in states:
            assert clock == head, (key, clock, head)
            assert text == prefixes[head], f"{key}: get_state differs from fold(log)"
        stored = await self.backend.snapshot(key)
        if stored is not None:
            clock, text = stored
            assert clock <= head, f"{key}: snapshot at {clock} is ahead of the head {head}"
            assert SubDocState.loads(text).dumps() == prefixes[clock], f"{key}: snapshot {clock}"
        for (decided_key, op_id), (_raw, (kind, value)) in self.decided.items():
            if decided_key == key:
                committed = op_id in op_ids
                assert committed == (kind == "clock"), (key, op_id, kind, value)
        self.logs[key], self.prefixes[key] = log, prefixes

    # -- the program -----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.start()
        try:
            await self.backend.install()
            steps = {
                "post": self.step_post,
                "resend": self.step_resend,
                "burst": self.step_burst,
                "restart": self.step_restart,
            }
            # A start tree under each sub-doc, so the random ops meet nodes to move and delete.
            for key in KEYS:
                seed = self.data.draw(pool_trees, label="tree")
                ops = [
                    {
                        **op.model_dump(mode="json", exclude_none=True),
                        "op_id": new_op_id(),
                        "meta": {"tag": next(self.tags)},
                    }
                    for op in seed
                ]
                for op in seed:
                    apply_op(self.model[key], op)
                sent = Sent(key, ops, atomic=False, may_fail=False)
                self.history.append(sent)
                await self.post(sent, self.client())
            await self.check()
            kinds = st.sampled_from(
                ["post", "post", "post", "resend", "resend", "burst", "burst", "restart"]
            )
            for _ in range(self.data.draw(st.integers(4, 14), label="steps")):
                await steps[self.data.draw(kinds, label="step")]()
                await self.check()
        finally:
            await self.stop()


def _overrides(data: st.DataObject) -> dict[str, Any]:
    return {
        "snapshot_every": data.draw(st.integers(1, 3), label="snapshot_every"),
        "subdoc_cache_limit": data.draw(st.integers(1, 2), label="subdoc_cache_limit"),
        "catchup_page": PAGE,
        "sweep_seconds": 600,
    }


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        # No shrinking: an example is a few seconds of real I/O, and a failure that depends on
        # how concurrent appends were grouped may not replay; the full program is reported.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@_settings(60)
@given(data=st.data())
def test_sqlite_state_always_equals_the_fold_of_its_log(data: st.DataObject) -> None:
    async def run() -> None:
        async with sqlite_backend(**_overrides(data)) as backend:
            await FoldCheck(backend, data).run()

    asyncio.run(run())


@pytest.mark.postgres
@_settings(25)
@given(data=st.data())
def test_postgres_state_on_two_instances_always_equals_the_fold_of_its_log(
    postgres_url: str, data: st.DataObject
) -> None:
    async def run() -> None:
        async with postgres_backend(postgres_url, **_overrides(data)) as backend:
            await FoldCheck(backend, data).run()

    asyncio.run(run())
