"""The queue and blob stores against the pure model, step by step (differential, docs/queue.md).

Hypothesis drives one store and an in-memory oracle built from `cv_server.queue.model` with the
same random program — enqueues (deterministic and random ids, reruns, ids of another workspace),
claims and batch claims (several worker classes, a class nobody claims, workspace filters),
heartbeats, completions and failures with the current, a stale or a bogus token, poison replays,
cancels, listings, and time jumping to the exact instant a lease lapses or a backoff ends — and
compares every field of every row after every step, type for type (JSON `1`, `1.0` and `true`
differ).

The model leaves one thing open that the seed does not: which of several claimable rows a claim
takes. The oracle uses the stores' documented order — by when the row became claimable
(`available_at` of a pending row, `lease_expires_at` of a lapsed one), then `created_at`, then
enqueue order (SQLite's rowid, PostgreSQL's `seq`) — and checks it on every claim.

A backend's test class subclasses `QueueDifferentialContract` and overrides `open_queue` and
`open_blobs`: factories of async context managers yielding a fresh, empty store in whatever event
loop runs them (each Hypothesis example runs in its own loop).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from cv_server.queue import BlobStore, QueueStore, model
from cv_server.queue.errors import QueueError, RequestNotFound
from cv_server.queue.model import Completion, Enqueued, NewRequest, ProcessRequest
from tests.stateful import AsyncStateMachine

QueueOpener = Callable[[], AbstractAsyncContextManager[QueueStore]]
#: `open_blobs(retention, new_ref)`: a fresh blob store minting its references with `new_ref`.
BlobOpener = Callable[[float, Callable[[], str]], AbstractAsyncContextManager[BlobStore]]

WORKSPACES = ("ws-a", "ws-b")
STAGES = ("s1", "s2")
#: "nobody" is a worker class no claimer ever asks for: its requests must stay pending.
WORKER_CLASSES = (None, "c1", "nobody")
#: What claimers ask for: one class, several (in either order), none, a class with no requests.
CLAIM_CLASSES: tuple[list[str], ...] = (
    ["s1"],
    ["s2"],
    ["c1"],
    ["s1", "s2", "c1"],
    ["c1", "s2", "s1"],
    ["absent"],
    [],
)
#: The workspaces a claimer's token allows (None: all).
CLAIM_WORKSPACES: tuple[list[str] | None, ...] = (
    None,
    None,
    ["ws-a"],
    ["ws-b"],
    ["ws-b", "ws-a"],
    [],
)
#: A few fixed ids, so enqueues coalesce, rerun and collide across workspaces.
FIXED_IDS = ("d_1", "d_2", "d_3")
LEASES = (0.1, 0.2, 0.3, 1.0, 120.0)
BACKOFFS = (0.0, 0.1, 0.2, 30.0)
BLOB_RETENTION = 10.0

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# JSON values where Python equality and JSON disagree (1 == 1.0 == True, 0.0 == -0.0 == False):
# a store that compares values with `==` before writing them would keep the old one.
_TRICKY = st.sampled_from([0, 1, 1.0, True, False, 0.0, -0.0, "1", None])
_SCALARS = _TRICKY | st.integers(-5, 5) | st.text("ab", max_size=3)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from("xy"), inner),
    max_leaves=4,
)


def canonical(row: ProcessRequest) -> str:
    """Every field, type for type: `json.dumps` tells 1, 1.0 and true (and 0.0 and -0.0) apart."""
    return json.dumps(dataclasses.asdict(row), sort_keys=True)


def claim_order(row: ProcessRequest, seq: int) -> tuple[float, float, int]:
    """When `row` became claimable, then its age, then enqueue order (the stores' claim order)."""
    since = row.available_at if row.status == "pending" else row.lease_expires_at
    assert since is not None
    return (since, row.created_at, seq)


def outcome_of(value: ProcessRequest | QueueError) -> str:
    return canonical(value) if isinstance(value, ProcessRequest) else type(value).__name__


def queue_machine(open_queue: QueueOpener) -> type[AsyncStateMachine]:
    """A state machine running one store of `open_queue` beside the model."""

    class QueueDifferential(AsyncStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.opened = open_queue()
            self.store = self.run(self.opened.__aenter__())
            self.now = 0.0
            self.rows: dict[str, ProcessRequest] = {}
            self.seq: dict[str, int] = {}
            self.tokens: dict[str, list[str]] = {}
            self.minted = 0

        def teardown(self) -> None:
            try:
                self.run(self.opened.__aexit__(None, None, None))
            finally:
                self.close_loop()

        def pick_id(self, data: st.DataObject) -> str:
            """A known id (held ones twice as likely: they are the ones a worker writes to), or
            an unknown one."""
            held = sorted(i for i, row in self.rows.items() if row.status == "in_progress")
            return data.draw(st.sampled_from([*held, *sorted(self.rows), "d_missing"]))

        def pick_token(self, data: st.DataObject, request_id: str) -> str:
            """The current holder's token (most likely), an older one of the row, or a bogus one."""
            row = self.rows.get(request_id)
            current = [row.claim_token] * 3 if row is not None and row.claim_token else []
            stale = [t for t in self.tokens.get(request_id, []) if t not in current]
            return data.draw(st.sampled_from([*current, *stale, "bogus"]))

        def expect(self, action: Callable[[], Any]) -> tuple[Any, type[Exception] | None]:
            try:
                return action(), None
            except QueueError as refused:
                return None, type(refused)

        # -- enqueuers ----------------------------------------------------------------------------

        @rule(
            data=st.data(),
            workspace=st.sampled_from(WORKSPACES),
            stage=st.sampled_from(STAGES),
            worker_class=st.sampled_from(WORKER_CLASSES),
            input=JSON,
            max_dequeues=st.integers(1, 3),
            rerun=st.booleans(),
        )
        def enqueue(
            self,
            data: st.DataObject,
            workspace: str,
            stage: str,
            worker_class: str | None,
            input: Any,
            max_dequeues: int,
            rerun: bool,
        ) -> None:
            if data.draw(st.booleans(), label="fixed id"):
                request_id = data.draw(st.sampled_from(FIXED_IDS), label="request_id")
            else:
                self.minted += 1
                request_id = model.random_request_id(f"{self.minted:040x}")
            req = NewRequest(
                workspace_id=workspace,
                stage=stage,
                request_id=request_id,
                input=input,
                job_id="job",
                worker_class=worker_class,
                max_dequeues=max_dequeues,
            )
            self.submit(req, rerun)

        @initialize(
            requests=st.lists(
                st.tuples(
                    st.sampled_from(WORKSPACES),
                    st.sampled_from(STAGES),
                    st.sampled_from(WORKER_CLASSES),
                    st.integers(1, 3),
                ),
                max_size=4,
            )
        )
        def a_backlog(self, requests: list[tuple[str, str, str | None, int]]) -> None:
            """Start with a few requests enqueued at the same instant (ties on every key but
            enqueue order)."""
            for n, (workspace, stage, worker_class, max_dequeues) in enumerate(requests):
                req = NewRequest(
                    workspace,
                    stage,
                    f"d_b{n}",
                    n,
                    worker_class=worker_class,
                    max_dequeues=max_dequeues,
                )
                self.submit(req, False)

        def submit(self, req: NewRequest, rerun: bool) -> None:
            request_id = req.request_id
            existing = self.rows.get(request_id)
            expected, refused = self.expect(
                lambda: model.decide_enqueue(existing, req, self.now, rerun=rerun)
            )
            try:
                got: Enqueued | QueueError = self.run(
                    self.store.enqueue(req, self.now, rerun=rerun)
                )
            except QueueError as error:
                got = error
            if isinstance(got, QueueError):
                assert type(got) is refused, (got, refused)
                return
            assert refused is None, f"the model refuses with {refused}, the store accepted"
            answer, _write = expected
            assert got.coalesced == answer.coalesced
            assert canonical(got.row) == canonical(answer.row)
            if existing is None:
                self.seq[request_id] = len(self.seq)
            self.rows[request_id] = answer.row

        # -- workers ------------------------------------------------------------------------------

        @rule(
            classes=st.sampled_from(CLAIM_CLASSES),
            workspaces=st.sampled_from(CLAIM_WORKSPACES),
            limit=st.integers(1, 3),
            single=st.booleans(),
            lease=st.sampled_from(LEASES),
            worker=st.sampled_from(("w1", "w2")),
        )
        def claim(
            self,
            classes: list[str],
            workspaces: list[str] | None,
            limit: int,
            single: bool,
            lease: float,
            worker: str,
        ) -> None:
            limit = 1 if single else limit
            in_scope = [
                row
                for row in self.rows.values()
                if row.worker_class in classes
                and (workspaces is None or row.workspace_id in workspaces)
                and model.is_claimable(row, self.now)
            ]
            doomed = [row for row in in_scope if model.is_parked_on_lapse(row)]
            wanted = sorted(
                (row for row in in_scope if not model.is_parked_on_lapse(row)),
                key=lambda row: claim_order(row, self.seq[row.request_id]),
            )[:limit]
            if single:
                one = self.run(
                    self.store.claim(classes, worker, lease, self.now, workspace_ids=workspaces)
                )
                got = [] if one is None else [one]
            else:
                got = self.run(
                    self.store.claim_many(
                        classes, worker, lease, self.now, limit=limit, workspace_ids=workspaces
                    )
                )
            # Oldest claimable first: the same rows, in the same order.
            assert [row.request_id for row in got] == [row.request_id for row in wanted]
            for held, before in zip(got, wanted, strict=True):
                token = held.claim_token
                assert token is not None
                assert token not in self.tokens.get(held.request_id, []), "a reused token"
                after = model.claim(
                    before, claim_token=token, worker_id=worker, lease=lease, now=self.now
                )
                assert canonical(held) == canonical(after)
                self.rows[held.request_id] = after
                self.tokens.setdefault(held.request_id, []).append(token)
            # A lapsed row out of attempts (or cancelled) is never handed out; a store may park
            # it now or on a later claim (PostgreSQL parks up to `limit` of them at a time).
            if doomed:
                stored = {
                    row.request_id: row
                    for row in self.run(self.store.get_many([row.request_id for row in doomed]))
                }
                for row in doomed:
                    parked = model.park_lapsed(row, self.now)
                    now_stored = canonical(stored[row.request_id])
                    assert now_stored in (canonical(row), canonical(parked)), row.request_id
                    if now_stored == canonical(parked):
                        self.rows[row.request_id] = parked

        @rule(data=st.data(), lease=st.sampled_from(LEASES))
        def heartbeat(self, data: st.DataObject, lease: float) -> None:
            request_id = self.pick_id(data)
            token = self.pick_token(data, request_id)
            row = self.rows.get(request_id)
            expected: Any
            refused: type[Exception] | None
            if row is None:
                expected, refused = None, RequestNotFound
            else:
                expected, refused = self.expect(
                    lambda: model.heartbeat(row, token, lease, self.now)
                )
            try:
                got: ProcessRequest | QueueError = self.run(
                    self.store.heartbeat(request_id, token, lease, self.now)
                )
            except QueueError as error:
                got = error
            if isinstance(got, QueueError):
                assert type(got) is refused, (got, refused)
                return
            assert refused is None, f"the model refuses with {refused}, the store accepted"
            assert canonical(got) == canonical(expected)
            self.rows[request_id] = expected

        @rule(data=st.data(), size=st.integers(1, 3), single=st.booleans())
        def complete(self, data: st.DataObject, size: int, single: bool) -> None:
            batch = []
            for _ in range(1 if single else size):
                request_id = self.pick_id(data)
                batch.append(
                    Completion(
                        request_id=request_id,
                        claim_token=self.pick_token(data, request_id),
                        result=data.draw(JSON, label="result"),
                        error=data.draw(st.none() | JSON, label="error"),
                        blob_ref=data.draw(st.sampled_from([None, "b_1"]), label="blob_ref"),
                        cache=data.draw(st.sampled_from([None, "hit", "miss"]), label="cache"),
                        telemetry=data.draw(st.none() | JSON, label="telemetry"),
                    )
                )
            # The model applies a batch one completion after the other.
            expected: list[str] = []
            for item in batch:
                row = self.rows.get(item.request_id)
                if row is None:
                    expected.append(RequestNotFound.__name__)
                    continue
                transition, refused = self.expect(
                    lambda row=row, item=item: model.complete(  # type: ignore[misc]
                        row,
                        item.claim_token,
                        item.result,
                        self.now,
                        error=item.error,
                        blob_ref=item.blob_ref,
                        cache=item.cache,
                        telemetry=item.telemetry,
                    )
                )
                if refused is not None:
                    expected.append(refused.__name__)
                    continue
                self.rows[item.request_id] = transition.row
                expected.append(canonical(transition.row))
            got: list[ProcessRequest | QueueError]
            if single:
                (item,) = batch
                try:
                    got = [
                        self.run(
                            self.store.complete(
                                item.request_id,
                                item.claim_token,
                                item.result,
                                self.now,
                                error=item.error,
                                blob_ref=item.blob_ref,
                                cache=item.cache,
                                telemetry=item.telemetry,
                            )
                        )
                    ]
                except QueueError as error:
                    got = [error]
            else:
                got = self.run(self.store.complete_many(batch, self.now))
            assert [outcome_of(value) for value in got] == expected

        @rule(data=st.data(), error=JSON, backoff=st.sampled_from(BACKOFFS))
        def fail(self, data: st.DataObject, error: Any, backoff: float) -> None:
            request_id = self.pick_id(data)
            token = self.pick_token(data, request_id)
            self.verb(
                request_id,
                lambda row: model.fail(row, token, error, backoff, self.now).row,
                lambda: self.store.fail(request_id, token, error, backoff, self.now),
            )

        @rule(data=st.data())
        def replay_poison(self, data: st.DataObject) -> None:
            request_id = self.pick_id(data)
            self.verb(
                request_id,
                lambda row: model.replay_poison(row, self.now),
                lambda: self.store.replay_poison(request_id, self.now),
            )

        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            request_id = self.pick_id(data)
            self.verb(
                request_id,
                lambda row: model.cancel(row, self.now).row,
                lambda: self.store.cancel(request_id, self.now),
            )

        def verb(
            self,
            request_id: str,
            rule: Callable[[ProcessRequest], ProcessRequest],
            call: Callable[[], Any],
        ) -> None:
            row = self.rows.get(request_id)
            expected: Any
            refused: type[Exception] | None
            if row is None:
                expected, refused = None, RequestNotFound
            else:
                expected, refused = self.expect(lambda: rule(row))
            try:
                got = self.run(call())
            except QueueError as error:
                got = error
            if isinstance(got, QueueError):
                assert type(got) is refused, (got, refused)
                return
            assert refused is None, f"the model refuses with {refused}, the store accepted"
            assert canonical(got) == canonical(expected)
            self.rows[request_id] = expected

        # -- time ---------------------------------------------------------------------------------

        @rule(seconds=st.sampled_from((0.0, 0.1, 0.2, 1.0, 30.0, 121.0)))
        def time_passes(self, seconds: float) -> None:
            self.now += seconds

        @rule(data=st.data())
        def time_reaches_an_edge(self, data: st.DataObject) -> None:
            """Jump to the exact instant a lease lapses or a backoff ends: a lease is held at
            `now == lease_expires_at`, a backoff is over at `now == available_at`."""
            edges = sorted(
                {
                    t
                    for row in self.rows.values()
                    for t in (row.lease_expires_at, row.available_at)
                    if t is not None and t >= self.now
                }
            )
            if edges:
                self.now = data.draw(st.sampled_from(edges))

        # -- operators ----------------------------------------------------------------------------

        @rule(
            status=st.sampled_from([None, *model.STATUSES]),
            workspace=st.sampled_from([None, *WORKSPACES]),
            limit=st.integers(0, 4),
        )
        def listing(self, status: Any, workspace: str | None, limit: int) -> None:
            got = self.run(self.store.list(status=status, workspace_id=workspace, limit=limit))
            assert [canonical(row) for row in got] == [
                canonical(row) for row in self.oldest_first(status, workspace)[:limit]
            ]

        def oldest_first(self, status: Any, workspace: str | None) -> list[ProcessRequest]:
            return sorted(
                (
                    row
                    for row in self.rows.values()
                    if status in (None, row.status) and workspace in (None, row.workspace_id)
                ),
                key=lambda row: (row.created_at, self.seq[row.request_id]),
            )

        @invariant()
        def every_row_matches_the_model(self) -> None:
            stored = self.run(self.store.list(limit=10_000))
            assert [canonical(row) for row in stored] == [
                canonical(row) for row in self.oldest_first(None, None)
            ]

    return QueueDifferential


def blob_machine(open_blobs: BlobOpener) -> type[AsyncStateMachine]:
    """A state machine running one blob store beside a dict of what must be readable."""

    class BlobDifferential(AsyncStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.next_ref = "b_0"
            self.minted = 0
            self.opened = open_blobs(BLOB_RETENTION, self.mint)
            self.store = self.run(self.opened.__aenter__())
            self.now = 0.0
            #: (workspace, ref) -> (bytes, put at, expires at), until the sweep deletes it.
            self.blobs: dict[tuple[str, str], tuple[bytes, float, float]] = {}

        def teardown(self) -> None:
            try:
                self.run(self.opened.__aexit__(None, None, None))
            finally:
                self.close_loop()

        def mint(self) -> str:
            return self.next_ref

        @rule(data=st.data(), workspace=st.sampled_from(WORKSPACES), payload=st.binary(max_size=8))
        def put(self, data: st.DataObject, workspace: str, payload: bytes) -> None:
            known = sorted({ref for _, ref in self.blobs})
            reuse: bool = data.draw(st.booleans(), label="reuse a reference")
            if known and reuse:
                self.next_ref = data.draw(st.sampled_from(known))
            else:
                self.minted += 1
                self.next_ref = f"b_{self.minted:x}"
            key = (workspace, self.next_ref)
            if key in self.blobs:
                # A minter that repeats itself must not overwrite the blob already stored under
                # the reference (its owner still reads it), expired or not.
                with pytest.raises(Exception):  # noqa: B017, PT011 - the driver's own error
                    self.run(self.store.put(workspace, payload, self.now))
                return
            assert self.run(self.store.put(workspace, payload, self.now)) == self.next_ref
            self.blobs[key] = (payload, self.now, self.now + BLOB_RETENTION)

        @rule(data=st.data(), workspace=st.sampled_from(WORKSPACES))
        def get(self, data: st.DataObject, workspace: str) -> None:
            refs = sorted({ref for _, ref in self.blobs} | {"b_missing"})
            ref = data.draw(st.sampled_from(refs))
            found = self.blobs.get((workspace, ref))
            # Readable strictly before its expiry instant, gone from that instant on.
            expected = found[0] if found is not None and self.now < found[2] else None
            assert self.run(self.store.get(workspace, ref, self.now)) == expected

        @rule(limit=st.sampled_from([None, 0, 1, 2]))
        def sweep(self, limit: int | None) -> None:
            expired = [key for key, (_, _, expires) in self.blobs.items() if expires <= self.now]
            deleted = self.run(self.store.sweep(self.now, limit=limit))
            assert deleted == (len(expired) if limit is None else min(limit, len(expired)))
            # Which expired blobs went is the store's choice; reading each at its put time
            # tells. A blob not yet expired is never swept.
            gone = [
                key for key in expired if self.run(self.store.get(*key, self.blobs[key][1])) is None
            ]
            assert len(gone) == deleted
            for key in gone:
                del self.blobs[key]
            for key, (payload, put_at, expires) in self.blobs.items():
                if expires > self.now:
                    assert self.run(self.store.get(*key, put_at)) == payload

        @rule(seconds=st.sampled_from((0.1, 0.2, 1.0, BLOB_RETENTION / 2, BLOB_RETENTION)))
        def time_passes(self, seconds: float) -> None:
            self.now += seconds

        @rule(data=st.data())
        def time_reaches_an_expiry(self, data: st.DataObject) -> None:
            edges = sorted({e for _, _, e in self.blobs.values() if e >= self.now})
            if edges:
                self.now = data.draw(st.sampled_from(edges))

    return BlobDifferential


def request_of(
    request_id: str, *, stage: str = "s1", input: Any = None, worker_class: str | None = None
) -> NewRequest:
    return NewRequest(
        workspace_id=WORKSPACES[0],
        stage=stage,
        request_id=request_id,
        input=input,
        worker_class=worker_class,
    )


class QueueDifferentialContract:
    """Every `QueueStore` and `BlobStore` agrees with the model after every step."""

    @pytest.fixture
    def open_queue(self) -> QueueOpener:
        raise NotImplementedError("a backend's test class opens fresh queue stores")

    @pytest.fixture
    def open_blobs(self) -> BlobOpener:
        raise NotImplementedError("a backend's test class opens fresh blob stores")

    # -- the differential runs --------------------------------------------------------------------

    def test_every_queue_row_matches_the_model_after_every_step(
        self, open_queue: QueueOpener
    ) -> None:
        run_state_machine_as_test(queue_machine(open_queue), settings=SETTINGS)

    def test_every_blob_read_and_sweep_matches_the_retention_rule(
        self, open_blobs: BlobOpener
    ) -> None:
        run_state_machine_as_test(blob_machine(open_blobs), settings=SETTINGS)

    # -- what the differential found, pinned ------------------------------------------------------

    @pytest.mark.parametrize(
        ("first", "then"),
        [(1, True), (1, 1.0), ({"n": 0}, {"n": False}), ([0.0], [-0.0])],
        ids=["int-bool", "int-float", "nested-int-bool", "zero-sign"],
    )
    async def test_a_rerun_stores_its_input_type_for_type(
        self, open_queue: QueueOpener, first: Any, then: Any
    ) -> None:
        """JSON `1`, `1.0` and `true` are different inputs even though Python finds them equal:
        the rerun's answer and the stored row must both carry the new one."""
        async with open_queue() as store:
            await store.enqueue(request_of("d_1", input=first), 1.0)
            held = await store.claim("s1", "w", 10.0, 1.0)
            assert held is not None
            assert held.claim_token is not None
            await store.complete("d_1", held.claim_token, None, 2.0)
            answer = await store.enqueue(request_of("d_1", input=then), 3.0, rerun=True)
            stored = await store.get(WORKSPACES[0], "d_1")
            assert stored is not None
            assert json.dumps(answer.row.input) == json.dumps(then)
            assert canonical(stored) == canonical(answer.row)

    async def test_the_last_error_is_stored_type_for_type(self, open_queue: QueueOpener) -> None:
        """A failure, then another failure and an expected error whose payloads equal the last
        one in Python but not in JSON: each is stored as given."""
        async with open_queue() as store:
            await store.enqueue(request_of("d_1"), 1.0)
            for now, error in ((1.0, {"code": 1}), (2.0, {"code": True})):
                held = await store.claim("s1", "w", 10.0, now)
                assert held is not None
                assert held.claim_token is not None
                failed = await store.fail("d_1", held.claim_token, error, 0.0, now)
                assert canonical(await store.get(WORKSPACES[0], "d_1") or held) == canonical(failed)
            held = await store.claim("s1", "w", 10.0, 3.0)
            assert held is not None
            assert held.claim_token is not None
            done = await store.complete("d_1", held.claim_token, None, 3.0, error={"code": 1.0})
            stored = await store.get(WORKSPACES[0], "d_1")
            assert stored is not None
            assert json.dumps(stored.error) == json.dumps({"code": 1.0})
            assert canonical(stored) == canonical(done)

    async def test_a_tie_between_a_lapsed_lease_and_a_backoff_goes_to_the_older_enqueue(
        self, open_queue: QueueOpener
    ) -> None:
        """Both became claimable at the same instant and were created at the same instant: the
        one enqueued first is claimed first (enqueue order, as for two pending rows), whichever
        of the two is the lapsed lease."""
        for lapsed_first in (True, False):
            async with open_queue() as store:
                await store.enqueue(request_of("d_first"), 0.0)
                await store.enqueue(request_of("d_second"), 0.0)
                held = await store.claim_many("s1", "w", 1.0, 0.0, limit=2)
                assert [row.request_id for row in held] == ["d_first", "d_second"]
                # One lease lapses at 1.0 (its worker died); the other fails, backed off to 1.0.
                backed_off = held[1] if lapsed_first else held[0]
                assert backed_off.claim_token is not None
                await store.fail(backed_off.request_id, backed_off.claim_token, "boom", 1.0, 0.0)
                order = await store.claim_many("s1", "w2", 1.0, 1.5, limit=1)
                assert [row.request_id for row in order] == ["d_first"], lapsed_first

    async def test_a_tie_across_worker_classes_goes_to_the_older_enqueue(
        self, open_queue: QueueOpener
    ) -> None:
        """A worker claiming several classes takes the oldest request of all of them; at equal
        instants, the one enqueued first — not the one of the class it named first."""
        async with open_queue() as store:
            await store.enqueue(request_of("d_a", stage="s1"), 5.0)
            await store.enqueue(request_of("d_b", stage="s2"), 5.0)
            await store.enqueue(request_of("d_c", stage="s1", worker_class="nobody"), 4.0)
            taken = await store.claim_many(["s2", "s1", "absent"], "w", 1.0, 6.0, limit=1)
            assert [row.request_id for row in taken] == ["d_a"]
            taken = await store.claim_many(["s2", "s1"], "w", 1.0, 6.0, limit=3)
            assert [row.request_id for row in taken] == ["d_b"]
            # A class nobody asks for keeps its request pending, however old.
            (orphan,) = await store.list(status="pending")
            assert orphan.request_id == "d_c"

    async def test_a_blob_put_twice_under_one_reference_keeps_the_first(
        self, open_blobs: BlobOpener
    ) -> None:
        async with open_blobs(BLOB_RETENTION, lambda: "b_1") as store:
            assert await store.put("ws-a", b"first", 0.0) == "b_1"
            with pytest.raises(Exception):  # noqa: B017, PT011 - the driver's own error
                await store.put("ws-a", b"second", 1.0)
            assert await store.get("ws-a", "b_1", 2.0) == b"first"
            # The same reference in another workspace is another blob.
            assert await store.put("ws-b", b"other", 1.0) == "b_1"
            assert await store.get("ws-a", "b_1", 2.0) == b"first"
            assert await store.get("ws-b", "b_1", 2.0) == b"other"
            # Expiry counts from each put, to the instant; a sweep limited to 0 deletes nothing.
            assert await store.get("ws-a", "b_1", BLOB_RETENTION) is None
            assert await store.get("ws-b", "b_1", BLOB_RETENTION) == b"other"
            assert await store.sweep(BLOB_RETENTION + 1.0, limit=0) == 0
            assert await store.sweep(BLOB_RETENTION) == 1
            assert await store.get("ws-b", "b_1", 1.0) == b"other"
