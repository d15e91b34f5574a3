"""An op's delivery stamp (`client_id`, `seq`, `minted_at`) is not part of what the op is: the
op an app submitted equals the stamped one the SDK sends and reads back
(docs/ops.md#exactly-once)."""

from __future__ import annotations

from cv_mutations import NodeIncrement, NodeInsert, parse_op

STAMP = {"client_id": "6vbTUg5mWNPLPV9yYb-Wv", "seq": 3, "minted_at": 1_796_546_805_590}


def test_a_stamped_op_equals_the_op_the_app_submitted() -> None:
    submitted = NodeIncrement(op_id="0ZVUUm2WKHY3-UGuO6Mzt", node_id="n", field="c", by=1)
    stamped = parse_op({**submitted.model_dump(exclude_none=True), **STAMP})
    assert stamped.seq == 3
    assert stamped == submitted
    assert hash(stamped) == hash(submitted)
    assert {stamped} == {submitted}


def test_what_the_op_does_and_its_op_id_still_tell_ops_apart() -> None:
    base = NodeIncrement(op_id="0ZVUUm2WKHY3-UGuO6Mzt", node_id="n", field="c", by=1)
    assert base != base.model_copy(update={"by": 2})
    assert base != base.model_copy(update={"op_id": "1ZVUUm2WKHY3-UGuO6Mzt"})
    assert base != base.model_copy(update={"meta": {"actor": "a"}})
    assert base != NodeInsert(op_id="0ZVUUm2WKHY3-UGuO6Mzt", node_id="n", parent_id="root")
    assert base != {"type": "node.increment"}
