"""The queue's pure state machine (docs/queue.md): every rule without a database."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_server.config import ServerConfig
from cv_server.queue import model
from cv_server.queue.errors import InvalidTransition, LeaseLost, RequestIdConflict, RequestNotFound
from cv_server.queue.model import Completion, NewRequest, ProcessRequest, RequestEvent

CONFIG = ServerConfig()
LEASE = CONFIG.lease_seconds
BACKOFF = CONFIG.failure_backoff_seconds


def new_request(**changes: object) -> NewRequest:
    base = NewRequest(
        workspace_id="ws",
        stage="evaluate",
        request_id=model.deterministic_request_id("ws", "job", "main", "evaluate"),
        input={"a": 1},
        job_id="job",
        branch_path="main",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def claimed(row: ProcessRequest, now: float, token: str = "t1") -> ProcessRequest:
    return model.claim(row, claim_token=token, worker_id="w", lease=LEASE, now=now)


# -- ids -------------------------------------------------------------------------------------------


def test_the_deterministic_id_follows_its_documented_recipe() -> None:
    canonical = json.dumps(
        ["cv-request/v1", "ws", "job", None, "evaluate"], separators=(",", ":"), ensure_ascii=False
    )
    expected = "d_" + hashlib.sha256(canonical.encode()).hexdigest()[:40]
    assert model.deterministic_request_id("ws", "job", None, "evaluate") == expected


names = st.text(min_size=0, max_size=12)
optional_names = st.none() | names


@given(names, optional_names, optional_names, names, names, optional_names, optional_names, names)
def test_deterministic_ids_differ_exactly_when_their_parts_differ(
    ws1: str,
    job1: str | None,
    branch1: str | None,
    stage1: str,
    ws2: str,
    job2: str | None,
    branch2: str | None,
    stage2: str,
) -> None:
    first = model.deterministic_request_id(ws1, job1, branch1, stage1)
    second = model.deterministic_request_id(ws2, job2, branch2, stage2)
    assert (first == second) == ((ws1, job1, branch1, stage1) == (ws2, job2, branch2, stage2))
    assert len(first) == 42


def test_deterministic_id_parts_cannot_bleed_into_each_other() -> None:
    assert model.deterministic_request_id("a|b", "c", None, "s") != model.deterministic_request_id(
        "a", "b|c", None, "s"
    )
    assert model.deterministic_request_id("ws", "", "", "s") != model.deterministic_request_id(
        "ws", None, None, "s"
    )


def test_a_random_id_wraps_the_callers_randomness() -> None:
    assert model.random_request_id("ab" * 20) == "r_" + "ab" * 20
    with pytest.raises(ValueError, match="hex"):
        model.random_request_id("not hex at all, not hex at all, not hex!!")
    with pytest.raises(ValueError, match="hex"):
        model.random_request_id("abc")


def test_a_request_that_may_never_be_claimed_is_refused() -> None:
    with pytest.raises(ValueError, match="max_dequeues"):
        new_request(max_dequeues=0)


def test_the_worker_class_defaults_to_the_stage() -> None:
    assert model.new_row(new_request(), 1.0).worker_class == "evaluate"
    assert model.new_row(new_request(worker_class="gpu"), 1.0).worker_class == "gpu"


def test_the_claim_token_is_left_out_of_the_enqueuers_json() -> None:
    row = claimed(model.new_row(new_request(), 0.0), 1.0)
    assert "claim_token" not in row.to_json()
    assert row.to_json(include_claim_token=True)["claim_token"] == "t1"
    assert row.to_json()["status"] == "in_progress"


# -- enqueue ---------------------------------------------------------------------------------------


def test_enqueue_decides_new_coalesced_or_reopened() -> None:
    req = new_request()
    (fresh, coalesced), write = model.decide_enqueue(None, req, 1.0)
    assert (fresh.status, coalesced, write) == ("pending", False, True)
    (same, coalesced), write = model.decide_enqueue(fresh, req, 2.0, rerun=True)
    assert (same, coalesced, write) == (fresh, True, False)
    done, _ = model.complete(claimed(fresh, 3.0), "t1", {"r": 1}, 4.0)
    (answer, coalesced), write = model.decide_enqueue(done, req, 5.0)
    assert (answer, coalesced, write) == (done, True, False)
    (reopened, coalesced), write = model.decide_enqueue(done, req, 6.0, rerun=True)
    assert (reopened.status, reopened.run, reopened.created_at, coalesced, write) == (
        "pending",
        2,
        6.0,
        False,
        True,
    )
    assert reopened.claim_token is None


def test_enqueue_refuses_an_id_of_another_workspace() -> None:
    row = model.new_row(new_request(), 1.0)
    with pytest.raises(RequestIdConflict):
        model.decide_enqueue(row, new_request(workspace_id="other"), 2.0)


# -- claim, fence, finish --------------------------------------------------------------------------


def test_a_batch_completion_answers_each_item_and_writes_only_what_changed() -> None:
    mine = claimed(model.new_row(new_request(), 0.0), 1.0)
    other_id = model.deterministic_request_id("ws", "job", "main", "other")
    theirs = claimed(model.new_row(new_request(request_id=other_id, stage="other"), 0.0), 1.0)
    rows = {mine.request_id: mine, theirs.request_id: theirs}
    batch = [
        Completion(mine.request_id, "t1", result={"v": 1}),
        Completion(mine.request_id, "t1", result={"v": 1}),  # the holder's duplicate
        Completion(theirs.request_id, "stale"),
        Completion("missing", "t1"),
    ]
    outcomes, changed, events = model.complete_batch(rows, batch, 2.0)
    done = outcomes[0]
    assert isinstance(done, ProcessRequest)
    assert done.status == "done"
    assert done.result == {"v": 1}
    assert outcomes[1] == done
    assert isinstance(outcomes[2], LeaseLost)
    assert isinstance(outcomes[3], RequestNotFound)
    assert changed == {mine.request_id: done}
    assert events == [RequestEvent.of(done)]
    assert rows[mine.request_id] == mine  # the stored rows are read, never changed


def test_claimability_follows_availability_and_leases() -> None:
    row = model.new_row(new_request(), 10.0)
    assert not model.is_claimable(row, 9.0)
    assert model.is_claimable(row, 10.0)
    held = claimed(row, 10.0)
    assert not model.is_claimable(held, 10.0 + LEASE)
    assert model.is_claimable(held, 10.0 + LEASE + 0.001)
    with pytest.raises(InvalidTransition):
        claimed(held, 11.0, token="t2")


def test_an_exhausted_row_is_never_claimed_but_poisoned_on_lapse() -> None:
    row = claimed(model.new_row(new_request(max_dequeues=1), 0.0), 0.0)
    assert model.is_exhausted(row)
    with pytest.raises(InvalidTransition):
        claimed(row, LEASE + 1, token="t2")
    parked = model.poison_exhausted(row, LEASE + 1)
    assert (parked.status, parked.finished_at, parked.error["code"]) == (
        "poison",
        LEASE + 1,
        "lease_lapsed",
    )


def test_only_the_current_token_may_heartbeat_complete_or_fail() -> None:
    old = claimed(model.new_row(new_request(), 0.0), 0.0, token="old")
    new = claimed(old, LEASE + 1, token="new")
    with pytest.raises(LeaseLost):
        model.heartbeat(new, "old", LEASE, LEASE + 2)
    with pytest.raises(LeaseLost):
        model.complete(new, "old", None, LEASE + 2)
    with pytest.raises(LeaseLost):
        model.fail(new, "old", None, BACKOFF, LEASE + 2)
    assert model.heartbeat(new, "new", LEASE, LEASE + 2).lease_expires_at == 2 * LEASE + 2


def test_fail_backs_off_then_poisons_at_the_cutoff() -> None:
    row = claimed(model.new_row(new_request(max_dequeues=2), 0.0), 0.0)
    back, changed = model.fail(row, "t1", {"code": "x"}, BACKOFF, 5.0)
    assert (back.status, back.available_at, back.error, changed) == (
        "pending",
        5.0 + BACKOFF,
        {"code": "x"},
        True,
    )
    again = claimed(back, 5.0 + BACKOFF, token="t2")
    parked, _ = model.fail(again, "t2", {"code": "y"}, BACKOFF, 40.0)
    assert (parked.status, parked.dequeue_count, parked.finished_at) == ("poison", 2, 40.0)


def test_retries_of_complete_and_fail_by_the_holder_change_nothing() -> None:
    row = claimed(model.new_row(new_request(), 0.0), 0.0)
    done, changed = model.complete(row, "t1", {"v": 1}, 1.0)
    assert changed
    assert model.complete(done, "t1", {"v": 2}, 2.0) == (done, False)
    failed, _ = model.fail(row, "t1", {"e": 1}, BACKOFF, 1.0)
    assert model.fail(failed, "t1", {"e": 2}, BACKOFF, 2.0) == (failed, False)


def test_an_unknown_cache_outcome_is_refused() -> None:
    row = claimed(model.new_row(new_request(), 0.0), 0.0)
    with pytest.raises(ValueError, match="cache"):
        model.complete(row, "t1", None, 1.0, cache="warm")  # type: ignore[arg-type]


def test_only_poison_is_replayed() -> None:
    row = claimed(model.new_row(new_request(max_dequeues=1), 0.0), 0.0)
    parked, _ = model.fail(row, "t1", {"code": "bug"}, BACKOFF, 1.0)
    replayed = model.replay_poison(parked, 50.0)
    assert (replayed.status, replayed.dequeue_count, replayed.available_at) == ("pending", 0, 50.0)
    assert (replayed.claim_token, replayed.finished_at, replayed.run) == (None, None, 1)
    with pytest.raises(InvalidTransition):
        model.replay_poison(replayed, 51.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_nonsensical_lease_or_backoff_is_refused(bad: float) -> None:
    row = model.new_row(new_request(), 0.0)
    with pytest.raises(ValueError, match="lease"):
        model.claim(row, claim_token="t", worker_id="w", lease=bad, now=1.0)
    with pytest.raises(ValueError, match="backoff"):
        model.fail(claimed(row, 1.0), "t1", None, bad, 2.0)


# -- how long a request has waited unclaimed -------------------------------------------------------


def test_a_row_says_how_long_it_has_been_claimable_without_a_claim() -> None:
    row = model.new_row(new_request(), 10.0)
    assert model.unclaimed_seconds(row, 25.0) == 15.0
    assert row.to_json(now=25.0)["unclaimed_seconds"] == 15.0
    assert "unclaimed_seconds" not in row.to_json()  # only when the caller knows the time
    held = claimed(row, 30.0)
    assert model.unclaimed_seconds(held, 31.0) is None  # a live lease: someone works on it
    lapsed_at = 30.0 + LEASE
    assert model.unclaimed_seconds(held, lapsed_at + 4.0) == 4.0  # its worker died
    backed_off = model.fail(held, "t1", {"code": "x"}, BACKOFF, 40.0).row
    assert model.unclaimed_seconds(backed_off, 41.0) == 0.0  # waiting out its backoff
    assert model.unclaimed_seconds(backed_off, 40.0 + BACKOFF + 2.0) == 2.0
    done = model.complete(claimed(row, 30.0), "t1", None, 50.0).row
    assert model.unclaimed_seconds(done, 60.0) is None
    assert model.unclaimed_seconds(model.cancel(row, 60.0).row, 70.0) is None
