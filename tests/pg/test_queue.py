"""What only the PostgreSQL queue shows: announcements cross instances through NOTIFY sent in the
committing transaction, the claim statement keeps the model's rules, and it walks the partial
indexes instead of the backlog."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from cv_server.config import ServerConfig
from cv_server.pg import NOTIFY_PAYLOAD_LIMIT, Notifier, create_pool
from cv_server.pg import queue_sql as sql
from cv_server.pg.queue import (
    PostgresQueueStore,
    parse_queue_payload,
    queue_payloads,
)
from cv_server.queue import (
    NewRequest,
    ProcessRequest,
    RequestEvent,
    deterministic_request_id,
    model,
)
from tests.pg.helpers import settings_for

pytestmark = pytest.mark.postgres

CONFIG = ServerConfig()
LEASE = CONFIG.lease_seconds
WS = "ws-1"
STAGE = "evaluate"
TIMEOUT = 10.0


def request(job_id: str, *, max_dequeues: int = CONFIG.max_dequeues) -> NewRequest:
    return NewRequest(
        workspace_id=WS,
        stage=STAGE,
        request_id=deterministic_request_id(WS, job_id, "main", STAGE),
        input={"job": job_id},
        job_id=job_id,
        branch_path="main",
        max_dequeues=max_dequeues,
    )


class Heard:
    """A queue listener that can be awaited."""

    def __init__(self) -> None:
        self.events: list[RequestEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, event: RequestEvent) -> None:
        self.events.append(event)
        self._changed.set()

    async def until(self, predicate: Callable[[list[RequestEvent]], bool]) -> None:
        async def loop() -> None:
            while not predicate(self.events):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), TIMEOUT)


@pytest.fixture
async def migrated(pool: asyncpg.Pool) -> asyncpg.Pool:
    from cv_server.pg import migrate

    await migrate(pool)
    return pool


@pytest.fixture
async def notifier(postgres_url: str) -> AsyncIterator[Notifier]:
    notifier = Notifier(postgres_url)
    await notifier.start()
    yield notifier
    await notifier.close()


@pytest.fixture
async def two_instances(
    postgres_url: str, schema: str, migrated: asyncpg.Pool, notifier: Notifier
) -> AsyncIterator[tuple[PostgresQueueStore, PostgresQueueStore]]:
    other_pool = await create_pool(postgres_url, settings_for(schema))
    channel = f"cv_queue_{schema}"
    first = PostgresQueueStore(migrated, channel=channel)
    second = PostgresQueueStore(other_pool, channel=channel)
    for store in (first, second):
        await store.listen(notifier)
    yield first, second
    for store in (first, second):
        await store.close()
    await other_pool.close()


async def test_waiters_on_one_instance_hear_what_another_instance_commits(
    two_instances: tuple[PostgresQueueStore, PostgresQueueStore],
) -> None:
    here, there = two_instances
    heard_here, heard_there = Heard(), Heard()
    here.add_listener(heard_here)
    there.add_listener(heard_there)
    await there.enqueue(request("a"), 1.0)
    held = await there.claim(STAGE, "w", LEASE, 2.0)
    assert held is not None
    await there.complete(held.request_id, held.claim_token or "", {"ok": True}, 3.0)
    await heard_here.until(lambda events: [e.status for e in events] == ["pending", "done"])
    # The instance that committed announced every change itself, once (not again via LISTEN);
    # the other heard what its listeners act on, never the claim.
    assert [e.status for e in heard_there.events] == ["pending", "in_progress", "done"]
    assert {e.request_id for e in heard_here.events} == {held.request_id}


async def test_a_parked_request_is_announced_to_every_instance(
    two_instances: tuple[PostgresQueueStore, PostgresQueueStore],
) -> None:
    here, there = two_instances
    heard = Heard()
    here.add_listener(heard)
    await there.enqueue(request("doomed", max_dequeues=1), 0.0)
    assert await there.claim(STAGE, "w", LEASE, 0.0) is not None
    assert await there.claim(STAGE, "w", LEASE, 2 * LEASE) is None
    await heard.until(lambda events: [e.status for e in events] == ["pending", "poison"])


async def test_the_notification_arrives_only_once_the_completion_is_readable(
    postgres_url: str, schema: str, migrated: asyncpg.Pool
) -> None:
    channel = f"cv_queue_{schema}"
    store = PostgresQueueStore(migrated, channel=channel)
    await store.enqueue(request("a"), 1.0)
    held = await store.claim(STAGE, "w", LEASE, 2.0)
    assert held is not None
    seen: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(postgres_url)
    reader = await asyncpg.connect(postgres_url, server_settings={"search_path": schema})

    def on_notify(conn: object, pid: int, chan: str, payload: str) -> None:
        seen.put_nowait(payload)

    try:
        await listener.add_listener(channel, on_notify)
        await store.complete(held.request_id, held.claim_token or "", {"ok": True}, 3.0)
        payload = await asyncio.wait_for(seen.get(), TIMEOUT)
        _, events = parse_queue_payload(payload)
        assert [(e.request_id, e.status) for e in events] == [(held.request_id, "done")]
        status = await reader.fetchval(
            f"SELECT status FROM {sql.TABLE} WHERE request_id = $1", held.request_id
        )
        assert status == "done"
    finally:
        await listener.close()
        await reader.close()


async def test_a_rolled_back_change_is_never_announced(
    two_instances: tuple[PostgresQueueStore, PostgresQueueStore], migrated: asyncpg.Pool
) -> None:
    here, there = two_instances
    heard = Heard()
    here.add_listener(heard)
    await migrated.execute(
        f"ALTER TABLE {sql.TABLE} ADD CONSTRAINT no_errors CHECK (job_id <> 'refused')"
    )
    with pytest.raises(asyncpg.CheckViolationError):
        await there.enqueue(request("refused"), 1.0)
    await there.enqueue(request("accepted"), 2.0)
    await heard.until(lambda events: len(events) >= 1)
    assert [e.request_id for e in heard.events] == [request("accepted").request_id]


async def test_the_claim_statement_keeps_the_models_rules(migrated: asyncpg.Pool) -> None:
    store = PostgresQueueStore(migrated, new_token=iter(["t-1", "t-2"]).__next__)
    await store.enqueue(request("doomed", max_dequeues=1), 0.0)
    first = await store.claim(STAGE, "w0", LEASE, 0.0)
    assert first is not None
    await store.enqueue(request("fresh"), 5.0)
    before = {r.job_id: r for r in await store.list()}
    claimed = await store.claim(STAGE, "w1", LEASE, 2 * LEASE)
    after = {r.job_id: r for r in await store.list()}
    assert claimed == after["fresh"]
    assert after["fresh"] == model.claim(
        before["fresh"], claim_token="t-2", worker_id="w1", lease=LEASE, now=2 * LEASE
    )
    assert after["doomed"] == model.poison_exhausted(before["doomed"], 2 * LEASE)


async def test_every_claim_probe_walks_its_partial_index(migrated: asyncpg.Pool) -> None:
    async with migrated.acquire() as conn:
        # A backlog of done rows and pending rows: no probe may scan them.
        await conn.execute(
            f"INSERT INTO {sql.TABLE} (request_id, workspace_id, stage, worker_class, status, run,"
            " available_at, dequeue_count, max_dequeues, created_at)"
            " SELECT 'r' || i, 'ws-' || (i % 7), 'evaluate', 'evaluate',"
            " CASE WHEN i % 3 = 0 THEN 'done' ELSE 'pending' END, 1, i, 0, 5, i"
            " FROM generate_series(1, 20000) i"
        )
        for workspaces in (None, 2):
            query = sql.claim_sql(workspaces is not None)
            ws_list = None if workspaces is None else ["ws-1", "ws-2"]
            args = [1e9, 16, "w", LEASE, ["t"] * 16, [STAGE], ws_list, "ch", "i"]
            # EXPLAIN ANALYZE runs the claim: roll it back, each case sees the same backlog.
            transaction = conn.transaction()
            await transaction.start()
            try:
                plan = await conn.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}", *args)
            finally:
                await transaction.rollback()
            nodes = _plan_nodes(plan[0][0][0]["Plan"])  # json arrives decoded
            scans = [n for n in nodes if n.get("Relation Name") == sql.TABLE]
            assert not [n for n in scans if n["Node Type"] == "Seq Scan"], workspaces
            used = {n.get("Index Name") for n in scans}
            expected = "pending" if workspaces is None else "pending_workspace"
            assert f"{sql.TABLE}_{expected}" in used
            assert f"{sql.TABLE}_leased" in used
            # Each index walk stops after the rows the claim needs.
            assert max(n["Actual Rows"] * n["Actual Loops"] for n in scans) <= 16 * 2


async def test_the_claimable_check_walks_its_partial_indexes(migrated: asyncpg.Pool) -> None:
    """The idle poll's check (`has_claimable`) seeks the partial indexes and stops at once,
    even when the rows it must skip are many and the ones it looks for are none: another class's
    backlog, another tenant's, and this class's work backing off."""
    async with migrated.acquire() as conn:
        await conn.execute(
            f"INSERT INTO {sql.TABLE} (request_id, workspace_id, stage, worker_class, status, run,"
            " available_at, dequeue_count, max_dequeues, created_at, lease_expires_at)"
            " SELECT 'r' || i, 'ws-' || (i % 7), 'evaluate',"
            " CASE WHEN i % 2 = 0 THEN 'other' ELSE 'evaluate' END,"
            " CASE WHEN i % 3 = 0 THEN 'in_progress' ELSE 'pending' END, 1,"
            # Class `evaluate` in ws-1 backs off past now; the rest is available at once.
            " CASE WHEN i % 2 = 1 AND i % 7 = 1 THEN 1e12 ELSE i END, 0, 5, i, 1e12"
            " FROM generate_series(1, 20000) i"
        )
        await conn.execute(f"ANALYZE {sql.TABLE}")
        for restricted, expected, args in (
            (False, "pending", [["other", "evaluate"], 1e9]),
            (True, "pending_workspace", [[STAGE], 1e9, ["ws-1"]]),
        ):
            query = sql.claimable_sql(restricted)
            plan = await conn.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}", *args)
            nodes = _plan_nodes(plan[0][0][0]["Plan"])  # json arrives decoded
            scans = [n for n in nodes if n.get("Relation Name") == sql.TABLE]
            assert not [n for n in scans if n["Node Type"] == "Seq Scan"], restricted
            used = {n.get("Index Name") for n in scans}
            assert {f"{sql.TABLE}_{expected}", f"{sql.TABLE}_leased"} <= used, used
            assert max(n["Actual Rows"] * n["Actual Loops"] for n in scans) <= 2
            assert await conn.fetchval(query, *args) is (not restricted)


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [node]
    for child in node.get("Plans", []):
        nodes.extend(_plan_nodes(child))
    return nodes


async def test_the_migration_leaves_the_queue_table_analyzed(migrated: asyncpg.Pool) -> None:
    reltuples = await migrated.fetchval(
        "SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)", sql.TABLE
    )
    assert reltuples == 0  # -1 would mean "never analyzed"


def event(i: int, status: model.RequestStatus = "done") -> RequestEvent:
    return RequestEvent("ws-" + "w" * 60, f"r_{i:040d}", status, 1, "c" * 64)


def test_payloads_stay_under_the_notify_limit_and_carry_every_broadcast_event() -> None:
    events = [event(i) for i in range(500)]
    payloads = queue_payloads("inst", [*events, event(999, "in_progress")])
    assert len(payloads) > 1
    assert all(len(p.encode()) < NOTIFY_PAYLOAD_LIMIT for p in payloads)
    parsed = [parse_queue_payload(p) for p in payloads]
    assert {instance for instance, _ in parsed} == {"inst"}
    assert [e for _, batch in parsed for e in batch] == events  # in_progress is not broadcast


def test_a_malformed_payload_is_refused() -> None:
    for payload in ("", "[]", '["i", [["w", "r", "in_progress", 1, "c"]]]', '["i", 3]'):
        with pytest.raises(ValueError, match="queue notification"):
            parse_queue_payload(payload)


def test_no_payload_for_changes_other_instances_do_not_act_on() -> None:
    assert queue_payloads("inst", [event(1, "in_progress")]) == []


def test_the_row_mapping_covers_every_model_field() -> None:
    assert tuple(f.name for f in dataclasses.fields(ProcessRequest)) == sql.COLUMNS
