"""`model.enqueue_batch` is a fold of `decide_enqueue`: each item answered as a single enqueue of
it would be after the items before it, whatever mix of new, live, finished and repeated ids and
reruns the batch holds (Hypothesis)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cv_server.queue import model
from cv_server.queue.errors import RequestIdConflict
from cv_server.queue.model import EnqueueAsk, NewRequest, ProcessRequest, RequestStatus

NOW = 5.0
IDS = ("d_a", "d_b", "d_c")


def _req(request_id: str, n: int) -> NewRequest:
    return NewRequest("ws", "stage", request_id, input={"n": n})


def _stored(request_id: str, status: RequestStatus) -> ProcessRequest:
    return dataclasses.replace(model.new_row(_req(request_id, -1), 1.0), status=status)


stored_rows = st.dictionaries(
    st.sampled_from(IDS),
    st.sampled_from(model.STATUSES),
).map(lambda rows: {rid: _stored(rid, status) for rid, status in rows.items()})
batches = st.lists(st.tuples(st.sampled_from(IDS), st.booleans()), max_size=8).map(
    lambda items: [EnqueueAsk(_req(rid, n), rerun) for n, (rid, rerun) in enumerate(items)]
)


@given(stored_rows, batches)
def test_a_batch_answers_each_item_as_single_enqueues_in_turn_would(
    rows: dict[str, ProcessRequest], batch: list[EnqueueAsk]
) -> None:
    outcomes, inserted, rewritten, events = model.enqueue_batch(rows, batch, NOW)
    current = dict(rows)
    expected, written = [], []
    for item in batch:
        answer, write = model.decide_enqueue(
            current.get(item.request.request_id), item.request, NOW, rerun=item.rerun
        )
        expected.append(answer)
        if write:
            current[answer.row.request_id] = answer.row
            written.append(answer.row)
    assert outcomes == expected
    assert [(e.request_id, e.status, e.kind) for e in events] == [
        (row.request_id, "pending", "enqueued") for row in written
    ]
    # What must be written leaves the store as the single enqueues would have left it.
    assert {row.request_id for row in inserted}.isdisjoint(rows)
    assert set(rewritten) <= set(rows)
    assert {**rows, **{r.request_id: r for r in inserted}, **rewritten} == current


def test_an_item_of_another_workspace_refuses_the_batch() -> None:
    theirs = dataclasses.replace(_stored("d_a", "pending"), workspace_id="other")
    with pytest.raises(RequestIdConflict):
        model.enqueue_batch(
            {"d_a": theirs}, [EnqueueAsk(_req("d_b", 0)), EnqueueAsk(_req("d_a", 1))], NOW
        )
