"""Races on layers 1 and 2 (docs/queue.md, docs/stages.md), written once and run against every
backend.

The queue and lock contracts check each rule one verb at a time; this suite makes the verbs race:
a stale holder against the workers re-claiming its request, reruns against reruns, claimers on
several connections against rows that must never be handed out again, a lapsed lock holder's
release against the takeover of its key, and the whole compute-lock protocol run by many workers
at once. Every race is real (many tasks on several connections, each backend's own locking
decides who wins) and bounded; no test sleeps to let a race settle, and time is passed in.

A backend's test class subclasses `RacesContract` and provides `store` and `peer_stores` (queue
stores on the same database, each through its own connection, as several server processes
would have), `locks` and `peer_locks` (the same for compute locks), and `make_config`, a
`ServerConfig` factory for a whole server on that backend.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from cv_server import ServerConfig, create_app
from cv_server.auth import mint_token
from cv_server.keys import STORES
from cv_server.locks import Acquired, ComputeLockStore, Locked
from cv_server.queue import LeaseLost, ProcessRequest, QueueError, QueueStore
from cv_workspace_client import ClientConfig, WorkspaceClient
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker
from tests.contract.queue_contract import BACKOFF, LEASE, STAGE, WS, request

#: Requests (or lock keys) raced at once in one test.
ROWS = 24
#: Competing claimers / acquirers per request or key.
RIVALS = 6
#: Workers running the compute-lock protocol on each key.
WORKERS = 12
#: Wall-clock bound of any single wait in this suite (a hang is a failure, not a slow pass).
PATIENCE = 30.0
SECRET = b"races-contract-secret-0123456789abcdef"

ClientFactory = Callable[..., Any]


def _held(row: ProcessRequest | None) -> str:
    assert row is not None
    assert row.claim_token is not None
    return row.claim_token


class RacesContract:
    """What every backend keeps when its verbs race."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[QueueStore]:
        raise NotImplementedError("a backend's test class provides the store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def peer_stores(self, store: QueueStore) -> AsyncIterator[list[QueueStore]]:
        raise NotImplementedError("a backend's test class provides stores on other connections")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def locks(self) -> AsyncIterator[ComputeLockStore]:
        raise NotImplementedError("a backend's test class provides the lock store")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    async def peer_locks(self, locks: ComputeLockStore) -> AsyncIterator[list[ComputeLockStore]]:
        raise NotImplementedError("a backend's test class provides lock stores elsewhere")
        yield  # noqa: PT022 - an async generator, like the overrides

    @pytest.fixture
    def make_config(self) -> Callable[..., ServerConfig]:
        raise NotImplementedError("a backend's test class provides a server config factory")

    # -- layer 1: a stale holder against the workers that re-claim its request --------------------

    @pytest.mark.parametrize("verb", ["complete", "heartbeat", "fail"])
    async def test_a_stale_holder_racing_the_reclaimers_wins_everything_or_writes_nothing(
        self, store: QueueStore, peer_stores: list[QueueStore], verb: str
    ) -> None:
        """At once, after the lease lapsed: the old holder's fenced verb, and RIVALS claimers per
        request on every connection. Per request exactly one side wins: either the holder's verb
        took effect and nobody got the request, or one claimer got it and the holder's verb was
        refused (LeaseLost) and changed nothing."""
        stores = [store, *peer_stores]
        for i in range(ROWS):
            await store.enqueue(request(f"job-{i}"), 0.0)
        old = await store.claim_many(STAGE, "old", LEASE, 0.0, limit=ROWS)
        assert len(old) == ROWS
        now = LEASE + 1.0  # every lease lapsed; nobody re-claimed yet

        async def stale(row: ProcessRequest) -> ProcessRequest | QueueError:
            token = _held(row)
            try:
                if verb == "complete":
                    return await store.complete(row.request_id, token, {"by": "old"}, now)
                if verb == "heartbeat":
                    return await store.heartbeat(row.request_id, token, LEASE, now)
                return await store.fail(row.request_id, token, {"by": "old"}, BACKOFF, now)
            except LeaseLost as refused:
                return refused

        rivals = [
            stores[i % len(stores)].claim(STAGE, f"new-{i}", LEASE, now)
            for i in range(ROWS * RIVALS)
        ]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(stale(row) for row in old), *rivals), PATIENCE
        )
        stale_outcomes = dict(zip((row.request_id for row in old), outcomes[:ROWS], strict=True))
        claims = [row for row in outcomes[ROWS:] if row is not None]
        assert all(isinstance(row, ProcessRequest) for row in claims)
        taken = Counter(row.request_id for row in claims if isinstance(row, ProcessRequest))
        assert all(count == 1 for count in taken.values()), taken  # never handed out twice

        for before in old:
            outcome = stale_outcomes[before.request_id]
            current = await store.get(WS, before.request_id)
            assert current is not None
            if before.request_id in taken:
                # A claimer won: the holder was fenced out and the new claim stands as made.
                assert isinstance(outcome, LeaseLost), (verb, outcome)
                (mine,) = (
                    r
                    for r in claims
                    if isinstance(r, ProcessRequest) and r.request_id == before.request_id
                )
                assert current == mine
                assert (current.status, current.dequeue_count) == ("in_progress", 2)
            else:
                # The holder won: its verb stuck, and no claimer may have slipped in after it.
                assert isinstance(outcome, ProcessRequest), (verb, outcome)
                assert current == outcome
                expected = {"complete": "done", "heartbeat": "in_progress", "fail": "pending"}
                assert current.status == expected[verb]
                assert current.claim_token == before.claim_token
                assert current.dequeue_count == 1

        # Afterwards the stale token can still write nothing over a new claim.
        for row in claims:
            assert isinstance(row, ProcessRequest)
            current = await store.get(WS, row.request_id)
            stale_token = next(o.claim_token for o in old if o.request_id == row.request_id)
            with pytest.raises(LeaseLost):
                await store.complete(row.request_id, stale_token or "", {"by": "old"}, now + 1)
            assert await store.get(WS, row.request_id) == current

    async def test_the_holder_keeps_its_request_at_the_exact_instant_its_lease_expires(
        self, store: QueueStore, peer_stores: list[QueueStore]
    ) -> None:
        """`lease_expires_at == now` is not lapsed (claimable only once `lease_expires_at <
        now`): claimers racing the holder's heartbeat at that instant get nothing."""
        stores = [store, *peer_stores]
        for i in range(ROWS):
            await store.enqueue(request(f"job-{i}"), 0.0)
        held = await store.claim_many(STAGE, "holder", LEASE, 0.0, limit=ROWS)
        edge = held[0].lease_expires_at
        assert edge == LEASE
        beats = [store.heartbeat(row.request_id, _held(row), LEASE, edge) for row in held]
        rivals = [
            stores[i % len(stores)].claim_many(STAGE, f"w{i}", LEASE, edge, limit=3)
            for i in range(RIVALS * 2)
        ]
        outcomes = await asyncio.wait_for(asyncio.gather(*beats, *rivals), PATIENCE)
        assert all(batch == [] for batch in outcomes[ROWS:])
        for beat in outcomes[:ROWS]:
            assert isinstance(beat, ProcessRequest)
            assert (beat.status, beat.lease_expires_at, beat.dequeue_count) == (
                "in_progress",
                edge + LEASE,
                1,
            )

    async def test_a_request_backed_off_until_now_goes_to_exactly_one_racing_claimer(
        self, store: QueueStore, peer_stores: list[QueueStore]
    ) -> None:
        """`available_at == now` is claimable; of the claimers racing at that instant on every
        connection, exactly one gets each request, and only once its backoff ran out."""
        stores = [store, *peer_stores]
        for i in range(ROWS):
            await store.enqueue(request(f"job-{i}"), 0.0)
        for row in await store.claim_many(STAGE, "w", LEASE, 1.0, limit=ROWS):
            failed = await store.fail(row.request_id, _held(row), {"n": 1}, BACKOFF, 1.0)
            assert failed.available_at == 1.0 + BACKOFF
        early = await asyncio.gather(
            *(s.claim(STAGE, "early", LEASE, 1.0 + BACKOFF - 1e-6) for s in stores)
        )
        assert early == [None] * len(stores)
        claims = await asyncio.wait_for(
            asyncio.gather(
                *(
                    stores[i % len(stores)].claim(STAGE, f"w{i}", LEASE, 1.0 + BACKOFF)
                    for i in range(ROWS * RIVALS)
                )
            ),
            PATIENCE,
        )
        won = [row for row in claims if row is not None]
        assert len(won) == ROWS
        assert len({row.request_id for row in won}) == ROWS
        assert {row.dequeue_count for row in won} == {2}

    # -- layer 1: poison is never handed out, whoever claims -------------------------------------

    async def test_concurrent_batch_claimers_never_hand_out_an_exhausted_request(
        self, store: QueueStore, peer_stores: list[QueueStore]
    ) -> None:
        """A mixed backlog — requests whose last allowed worker died, requests whose worker died
        with budget left, fresh ones — raced by batch claimers on every connection: the exhausted
        ones all end in poison and reach nobody; every other one is claimed exactly once."""
        stores = [store, *peer_stores]
        doomed = [request(f"doomed-{i}", max_dequeues=1) for i in range(ROWS // 2)]
        dying = [request(f"dying-{i}", max_dequeues=3) for i in range(ROWS // 2)]
        for req in (*doomed, *dying):
            await store.enqueue(req, 0.0)
        first = await store.claim_many(STAGE, "dead", LEASE, 0.0, limit=ROWS)
        assert len(first) == ROWS
        fresh = [request(f"fresh-{i}") for i in range(ROWS)]
        for req in fresh:
            await store.enqueue(req, 1.0)
        now = 2 * LEASE  # every lease of the dead worker lapsed

        batches = await asyncio.wait_for(
            asyncio.gather(
                *(
                    stores[i % len(stores)].claim_many(STAGE, f"w{i}", LEASE, now, limit=1 + i % 4)
                    for i in range(len(stores) * RIVALS)
                )
            ),
            PATIENCE,
        )
        # On PostgreSQL a claimer may come back short while rows it skipped (locked by a rival
        # claim that did not take them) stay claimable: the rest is swept up right after.
        rest = await store.claim_many(STAGE, "sweeper", LEASE, now, limit=ROWS * 4)
        claimed = Counter(row.request_id for batch in (*batches, rest) for row in batch)
        assert all(count == 1 for count in claimed.values()), claimed
        doomed_ids = {req.request_id for req in doomed}
        assert not doomed_ids & set(claimed)
        assert set(claimed) == {req.request_id for req in (*dying, *fresh)}
        for req in doomed:
            row = await store.get(WS, req.request_id)
            assert row is not None
            assert (row.status, row.dequeue_count) == ("poison", 1)
        # Much later, on any connection: poison stays parked.
        later = await asyncio.gather(
            *(s.claim_many(STAGE, "late", LEASE, now + 100 * LEASE, limit=ROWS) for s in stores)
        )
        assert not doomed_ids & {row.request_id for batch in later for row in batch}
        assert len(await store.list(status="poison", limit=ROWS * 4)) == len(doomed)

    # -- layer 1: reruns racing ------------------------------------------------------------------

    async def test_concurrent_reruns_of_a_finished_request_reopen_it_once(
        self, store: QueueStore, peer_stores: list[QueueStore]
    ) -> None:
        """Many clients ask, at once and on every connection, to re-run a finished request: one
        re-opens it as run 2, all the others coalesce into that run (never run 3, never a fork)."""
        stores = [store, *peer_stores]
        await store.enqueue(request(), 0.0)
        held = await store.claim(STAGE, "w", LEASE, 1.0)
        await store.complete(held.request_id if held else "", _held(held), {"run": 1}, 2.0)
        answers = await asyncio.wait_for(
            asyncio.gather(
                *(
                    stores[i % len(stores)].enqueue(request(input={"i": i}), 3.0, rerun=True)
                    for i in range(ROWS)
                )
            ),
            PATIENCE,
        )
        reopened = [a for a in answers if not a.coalesced]
        assert len(reopened) == 1
        assert {(a.row.request_id, a.row.run) for a in answers} == {(reopened[0].row.request_id, 2)}
        row = await store.get(WS, reopened[0].row.request_id)
        assert row is not None
        assert (row.status, row.run, row.input) == ("pending", 2, reopened[0].row.input)
        # The first run's holder, retrying its completion late, cannot finish the second run.
        with pytest.raises(LeaseLost):
            await store.complete(row.request_id, _held(held), {"run": 1}, 4.0)
        assert await store.get(WS, row.request_id) == row

    # -- layer 2: compute lock ---------------------------------------------------------------------

    async def test_a_lapsed_holders_release_racing_the_takeover_never_frees_the_new_lock(
        self, locks: ComputeLockStore, peer_locks: list[ComputeLockStore]
    ) -> None:
        """Per key, at once: the release of a holder whose TTL lapsed, and RIVALS acquirers on
        every connection. Exactly one acquirer wins each key and its lock survives the release."""
        stores = [locks, *peer_locks]
        keys = [f"eval:col-{i}" for i in range(ROWS)]
        old = {key: await locks.acquire(WS, "job", key, "slow", 1.0, 0.0) for key in keys}
        assert all(isinstance(lock, Acquired) for lock in old.values())
        now = 5.0

        async def release(key: str) -> bool:
            lock = old[key]
            assert isinstance(lock, Acquired)
            return await locks.release(WS, "job", key, lock.token, now)

        acquirers = [
            (key, stores[(i + r) % len(stores)].acquire(WS, "job", key, f"w{r}", 60.0, now))
            for i, key in enumerate(keys)
            for r in range(RIVALS)
        ]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(release(key) for key in keys), *(a for _, a in acquirers)), PATIENCE
        )
        won: dict[str, list[Acquired]] = {key: [] for key in keys}
        for (key, _), outcome in zip(acquirers, outcomes[ROWS:], strict=True):
            if isinstance(outcome, Acquired):
                won[key].append(outcome)
            else:
                assert isinstance(outcome, Locked)
        for key in keys:
            assert len(won[key]) == 1, (key, won[key])
            lock = await locks.get(WS, "job", key, now)
            assert lock is not None, key
            assert lock.token == won[key][0].token
        # And later still, the old token frees nothing.
        for key in keys:
            assert await release(key) is False
            assert await locks.get(WS, "job", key, now + 1) is not None

    async def test_the_lock_protocol_pays_for_each_expensive_call_once_however_many_race(
        self, locks: ComputeLockStore, peer_locks: list[ComputeLockStore]
    ) -> None:
        """WORKERS per key run the compute-lock protocol (docs/stages.md) at once on every
        connection: pre-flight check, acquire, double-check inside the lock, compute (the call, then
        its write), release; a worker that finds the key locked waits for the write. Each call is
        paid once."""
        stores = [locks, *peer_locks]
        keys = [f"eval:col-{i}" for i in range(ROWS)]
        written: dict[str, str] = {}
        write_seen = {key: asyncio.Event() for key in keys}
        calls: Counter[str] = Counter()
        ticks = itertools.count()

        async def worker(key: str, n: int) -> str:
            lock_store = stores[n % len(stores)]
            while True:
                if key in written:  # 1. pre-flight
                    return written[key]
                outcome = await lock_store.acquire(WS, "job", key, f"w{n}", 60.0, 10.0)
                if isinstance(outcome, Locked):
                    await write_seen[key].wait()  # the holder's write is "broadcast"
                    continue
                try:
                    if key in written:  # 3. double-check inside the lock
                        return written[key]
                    calls[key] += 1  # 4. the expensive call...
                    await asyncio.sleep(0)  # ...which yields, as a real call would
                    written[key] = f"{key}@{next(ticks)}"  # ...then its write commits
                    write_seen[key].set()
                    return written[key]
                finally:
                    await lock_store.release(WS, "job", key, outcome.token, 10.0)

        results = await asyncio.wait_for(
            asyncio.gather(*(worker(key, n) for key in keys for n in range(WORKERS))), PATIENCE
        )
        assert calls == Counter({key: 1 for key in keys})
        assert results == [written[key] for key in keys for _ in range(WORKERS)]
        for key in keys:
            assert await locks.get(WS, "job", key, 10.0) is None  # every lock was released

    # -- the server's settings drive the queue (docs/configuration.md)
    # --------------------------------------

    async def test_the_servers_queue_settings_bound_leases_backoffs_and_attempts(
        self, aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
    ) -> None:
        """`lease_seconds`, `failure_backoff_seconds` and `max_dequeues` set on the server are
        what a request gets when its enqueuer names none: after `max_dequeues` failed attempts
        the request is poison and no worker gets it again."""
        client: TestClient[Any, Any] = await aiohttp_client(
            create_app(
                make_config(
                    token_secret=SECRET,
                    lease_seconds=7.0,
                    failure_backoff_seconds=0.0,
                    max_dequeues=2,
                )
            )
        )
        headers = {"Authorization": f"Bearer {mint_token(SECRET, [WS], now=time.time())}"}
        resp = await client.post(
            f"/v1/workspaces/{WS}/requests",
            json={"stage": STAGE, "job_id": "J1"},
            headers=headers,
        )
        assert resp.status == 202, await resp.text()
        request_id = (await resp.json())["request_id"]
        statuses = []
        for _ in range(3):
            resp = await client.post(
                "/v1/queue/claim",
                json={"worker_classes": [STAGE], "worker_id": "w"},
                headers=headers,
            )
            if resp.status == 204:
                statuses.append("nothing to claim")
                continue
            row = (await resp.json())["request"]
            assert row["lease_expires_at"] - row["claimed_at"] == pytest.approx(7.0)
            resp = await client.post(
                f"/v1/workspaces/{WS}/requests/{request_id}/fail",
                json={"claim_token": row["claim_token"], "error": {"code": "boom"}},
                headers=headers,
            )
            assert resp.status == 200, await resp.text()
            statuses.append((await resp.json())["status"])
        assert statuses == ["pending", "poison", "nothing to claim"], statuses
        resp = await client.get(f"/v1/workspaces/{WS}/requests/{request_id}", headers=headers)
        assert (await resp.json())["max_dequeues"] == 2

    async def test_an_idempotency_key_raced_by_many_clients_on_two_servers_enqueues_once(
        self, aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
    ) -> None:
        """The same non-deterministic enqueue, under one Idempotency-Key, sent at once by many
        clients to two servers on the same database: one row; every 202 names it (the first
        answer or its replay) and the others are told the first is still running."""
        servers: list[TestClient[Any, Any]] = [
            await aiohttp_client(create_app(make_config(token_secret=SECRET))) for _ in range(2)
        ]
        headers = {
            "Authorization": f"Bearer {mint_token(SECRET, [WS], now=time.time())}",
            "Idempotency-Key": "enqueue-once",
        }
        body = {"stage": STAGE, "input": {"url": "https://example.invalid/a"}}

        async def post(server: TestClient[Any, Any]) -> tuple[int, Any]:
            resp = await server.post(f"/v1/workspaces/{WS}/requests", json=body, headers=headers)
            return resp.status, await resp.json(content_type=None)

        answers = await asyncio.wait_for(
            asyncio.gather(*(post(servers[i % 2]) for i in range(ROWS))), PATIENCE
        )
        accepted = [answer for status, answer in answers if status == 202]
        assert accepted, answers
        assert {a["request_id"] for a in accepted} == {accepted[0]["request_id"]}
        assert sum(1 for a in accepted if not a["coalesced"]) == len(accepted)
        others = [answer["code"] for status, answer in answers if status != 202]
        assert set(others) <= {"idempotency_key_in_progress"}, answers
        # However the race went, a retry now replays the one answer, and there is one row.
        status, again = await post(servers[0])
        assert (status, again["request_id"]) == (202, accepted[0]["request_id"])
        listed = await servers[1].get(
            "/v1/queue/requests", params={"workspace": WS}, headers=headers
        )
        assert len((await listed.json())["requests"]) == 1

    async def test_a_worker_renews_a_lease_shorter_than_its_heartbeat_interval(
        self, aiohttp_client: ClientFactory, make_config: Callable[..., ServerConfig]
    ) -> None:
        """A server set to a lease shorter than the worker's heartbeat interval (60 s by default):
        while the worker is alive and its stage still runs, its lease is renewed past the one
        its claim was granted, a rival claiming then gets nothing, and the stage runs once, on
        its first claim."""
        lease = 2.0
        server: TestClient[Any, Any] = await aiohttp_client(
            create_app(make_config(token_secret=SECRET, lease_seconds=lease))
        )
        token = mint_token(SECRET, [WS], now=time.time())
        headers = {"Authorization": f"Bearer {token}"}
        started, finish = asyncio.Event(), asyncio.Event()
        runs: list[int] = []

        async def slow(ctx: StageContext) -> dict[str, int]:
            runs.append(ctx.request.dequeue_count)
            started.set()
            await finish.wait()
            return {"ok": 1}

        url = str(server.make_url("")).rstrip("/")
        config = ClientConfig(retry_base_seconds=0.005, retry_cap_seconds=0.05)
        async with WorkspaceClient(url, token=token, config=config) as client:
            worker = Worker(client, {"slow": slow})
            running = asyncio.create_task(worker.run())
            try:
                resp = await server.post(
                    f"/v1/workspaces/{WS}/requests",
                    json={"stage": "slow", "job_id": "J1"},
                    headers=headers,
                )
                request_id = (await resp.json())["request_id"]
                await asyncio.wait_for(started.wait(), PATIENCE)
                # The stage is long: it outlives the lease granted at its claim, and only a
                # heartbeat keeps the request its own. The rival claims at the moment (on the
                # store's clock, passed in) a heartbeat renewed the lease after the first one
                # would have lapsed: however late that beat came on a loaded machine, nobody
                # could take the request in between, and the renewed lease holds then.
                async with asyncio.timeout(PATIENCE):
                    while True:
                        resp = await server.get(
                            f"/v1/workspaces/{WS}/requests/{request_id}", headers=headers
                        )
                        row = await resp.json()
                        renewed_at = row["lease_expires_at"] - lease
                        if renewed_at > row["claimed_at"] + lease:
                            break
                        await asyncio.sleep(0.02)  # a state, announced by no event
                assert server.app is not None
                queue: QueueStore = server.app[STORES].queue
                assert await queue.claim(["slow"], "rival", lease, renewed_at) is None
                finish.set()
            finally:
                finish.set()
                worker.stop()
                stats = await asyncio.wait_for(running, PATIENCE)
        assert runs == [1]
        assert (stats.completed, stats.leases_lost) == (1, 0)
        resp = await server.get(f"/v1/workspaces/{WS}/requests/{request_id}", headers=headers)
        row = await resp.json()
        assert (row["status"], row["dequeue_count"], row["result"]) == ("done", 1, {"ok": 1})
