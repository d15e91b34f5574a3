"""The chaos checker finds each broken invariant: a clean history passes, and each one made to
break a single promise fails with that promise named (so a soak reporting "0 duplicates, 0 lost"
is a checker that could have said otherwise)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from cv_mutations import SubDocState, apply_op, parse_op
from tests.chaos.invariants import Entry, History, RequestRecord, check
from tests.chaos.plan import DOCS, op_for, op_id_of

JOBS = "jobs"
COLUMNS = ("c0", "c1")


def _clean() -> History:
    """Two writers' first 30 ops, logged in plan order, states rebuilt by the real reducer; one
    job with two requests that split its cells; subscribers that saw exactly the log."""
    logs: dict[str, list[Entry]] = {doc: [] for doc in (*DOCS, JOBS)}
    states = {doc: SubDocState.empty() for doc in DOCS}
    for doc in DOCS:
        seed: dict[str, Any] = {"type": "node.insert", "node_id": "counter", "parent_id": "root",
                "fields": {"n": 0}, "op_id": f"seed-doc-{doc}"}  # fmt: skip
        apply_op(states[doc], parse_op(seed))
        logs[doc].append((1, seed["op_id"], seed))
    for k in range(30):
        for w in range(2):
            doc, op = op_for(w, k)
            apply_op(states[doc], parse_op(op))
            logs[doc].append((len(logs[doc]) + 1, op["op_id"], op))
    for c, name in enumerate(COLUMNS):
        op = {"type": "node.update", "node_id": "J1", "set": {f"eval:{name}": "x"},
              "op_id": f"cell-{c}"}  # fmt: skip
        logs[JOBS].append((c + 1, op["op_id"], op))
    return History(
        logs=logs,
        jobs_doc=JOBS,
        states={doc: state.to_json() for doc, state in states.items()},
        acked={w: {op_id_of(w, k) for k in range(0, 30, 2)} for w in range(2)},
        seen={("s0", doc): [(c, i) for c, i, _ in entries] for doc, entries in logs.items()},
        requests=[
            RequestRecord("r1", "J1", "done", ("eval:c0",)),
            RequestRecord("r2", "J1", "done", ("eval:c1",)),
        ],
        key_answers={"k1": {"r1"}, "k2": {"r2"}},
        columns=COLUMNS,
        provider_calls=2,
        outbox_rows={"w0": 0, "w1": 0},
    )


def test_a_clean_history_passes_with_its_figures() -> None:
    verdict = check(_clean())
    assert verdict.violations == []
    assert verdict.figures["intended"] == 60
    assert verdict.figures["applied"] == 60
    assert verdict.figures["acknowledged"] == 30
    assert verdict.figures["duplicates"] == verdict.figures["lost"] == 0
    assert verdict.figures["cells"] == 2


def _drop_op(h: History, op_id: str) -> None:
    for doc in DOCS:
        h.logs[doc] = [e for e in h.logs[doc] if e[1] != op_id]
        h.seen[("s0", doc)] = [(c, i) for c, i, _ in h.logs[doc]]


def _renumber(h: History, doc: str) -> None:
    h.logs[doc] = [(n + 1, i, op) for n, (_, i, op) in enumerate(h.logs[doc])]
    h.seen[("s0", doc)] = [(c, i) for c, i, _ in h.logs[doc]]


def _duplicate(h: History) -> None:
    entry = h.logs["d0"][5]
    h.logs["d0"].append(entry)
    _renumber(h, "d0")


def _lose_acked(h: History) -> None:
    _drop_op(h, op_id_of(0, 28))  # acknowledged (even k), op 29 still logged
    for doc in DOCS:
        _renumber(h, doc)


def _gap(h: History) -> None:
    _drop_op(h, op_id_of(1, 27))  # not acknowledged, but op 28 of the same writer is logged
    for doc in DOCS:
        _renumber(h, doc)


def _reorder(h: History) -> None:
    log = h.logs["d1"]
    a = next(n for n, e in enumerate(log) if e[1] == op_id_of(0, 13))
    b = next(n for n, e in enumerate(log) if e[1] == op_id_of(0, 16))
    log[a], log[b] = log[b], log[a]
    _renumber(h, "d1")


def _clock_gap(h: History) -> None:
    clock, op_id, op = h.logs["d2"][-1]
    h.logs["d2"][-1] = (clock + 1, op_id, op)


def _subscriber_twice(h: History) -> None:
    seen = h.seen[("s0", "d0")]
    seen.insert(3, seen[2])


def _subscriber_missed(h: History) -> None:
    del h.seen[("s0", JOBS)][0]


def _counter_off(h: History) -> None:
    h.states["d0"]["nodes"]["counter"]["fields"]["n"] += 1


def _request_unfinished(h: History) -> None:
    h.requests[1] = RequestRecord("r2", "J1", "timeout", ("eval:c1",))


def _key_forked(h: History) -> None:
    h.key_answers["k1"].add("r3")


def _cell_by_two(h: History) -> None:
    h.requests[1] = RequestRecord("r2", "J1", "done", ("eval:c0", "eval:c1"))


def _cell_twice(h: History) -> None:
    h.logs[JOBS].append((3, "cell-again", copy.deepcopy(h.logs[JOBS][0][2])))
    h.seen[("s0", JOBS)] = [(c, i) for c, i, _ in h.logs[JOBS]]


def _cell_never(h: History) -> None:
    h.logs[JOBS].pop()
    h.seen[("s0", JOBS)] = [(c, i) for c, i, _ in h.logs[JOBS]]
    h.provider_calls = 1


def _overpaid(h: History) -> None:
    h.provider_calls = 3


def _outbox_left(h: History) -> None:
    h.outbox_rows["w1"] = 2


BREAKS: dict[str, tuple[Callable[[History], None], str]] = {
    "duplicate": (_duplicate, "applied more than once"),
    "lost": (_lose_acked, "acknowledged ops not in the log"),
    "gap": (_gap, "intended ops not in the log"),
    "order": (_reorder, "out of order"),
    "clock": (_clock_gap, "clocks are not"),
    "subscriber_twice": (_subscriber_twice, "diverged"),
    "subscriber_missed": (_subscriber_missed, "diverged"),
    "counter": (_counter_off, "counter is"),
    "unfinished": (_request_unfinished, "did not end"),
    "forked_key": (_key_forked, "Idempotency-Keys"),
    "cell_by_two": (_cell_by_two, "computed by two requests"),
    "cell_twice": (_cell_twice, "written twice"),
    "cell_never": (_cell_never, "never written"),
    "overpaid": (_overpaid, "provider paid"),
    "outbox": (_outbox_left, "outboxes not empty"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_broken_promise_is_reported(name: str) -> None:
    history = _clean()
    breaker, expected = BREAKS[name]
    breaker(history)
    verdict = check(history)
    assert not verdict.ok
    assert any(expected in v for v in verdict.violations), verdict.violations


def test_a_worker_killed_mid_call_may_be_paid_again() -> None:
    history = _clean()
    history.provider_calls = 3
    history.faults["kill_worker"] = 1
    assert check(history).ok
