"""The commit pipeline through real HTTP: dedupe, reuse, recorded rejections, order."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from cv_mutations import new_op_id
from tests.server.helpers import counter, get_doc, get_ops, increment, insert, post_ops


async def _seed(client: TestClient[Any, Any]) -> None:
    await post_ops(client, [insert("n")])


async def test_the_same_op_sent_twice_applies_once_and_returns_the_same_clock(
    client: TestClient[Any, Any],
) -> None:
    await _seed(client)
    op = increment(by=5)
    first = await post_ops(client, [op])
    second = await post_ops(client, [op])
    assert first["results"][0] == {"op_id": op["op_id"], "clock": 2, "duplicate": False}
    assert second["results"][0] == {"op_id": op["op_id"], "clock": 2, "duplicate": True}
    assert await counter(client) == 5
    assert (await get_doc(client))["clock"] == 2


async def test_concurrent_sends_of_one_op_id_apply_once(client: TestClient[Any, Any]) -> None:
    await _seed(client)
    op = increment()
    answers = await asyncio.gather(*(post_ops(client, [op]) for _ in range(20)))
    clocks = {answer["results"][0]["clock"] for answer in answers}
    fresh = [a for a in answers if not a["results"][0]["duplicate"]]
    assert clocks == {2}
    assert len(fresh) == 1
    assert await counter(client) == 1


async def test_a_reused_op_id_with_a_different_op_is_refused_and_not_applied(
    client: TestClient[Any, Any],
) -> None:
    await _seed(client)
    op_id = new_op_id()
    await post_ops(client, [increment(by=1, op_id=op_id)])
    answer = await post_ops(client, [increment(by=2, op_id=op_id)])
    assert answer["results"][0]["error"]["code"] == "op_id_reuse"
    assert await counter(client) == 1
    assert (await get_doc(client))["clock"] == 2


async def test_a_retried_rejected_op_gets_the_same_rejection_even_once_it_would_fit(
    client: TestClient[Any, Any],
) -> None:
    op = insert("child", parent="later", op_id=new_op_id())
    first = await post_ops(client, [op])
    assert first["results"][0]["error"]["code"] == "parent_not_found"
    await post_ops(client, [insert("later")])  # now the op would succeed
    retry = await post_ops(client, [op])
    assert retry["results"][0]["error"] == first["results"][0]["error"]
    assert retry["results"][0]["duplicate"] is True
    assert "child" not in (await get_doc(client))["state"]["nodes"]


async def test_a_batch_commits_in_order_with_gap_free_clocks(client: TestClient[Any, Any]) -> None:
    ops = [insert(f"n{i}", op_id=new_op_id()) for i in range(50)]
    answer = await post_ops(client, ops)
    assert [r["clock"] for r in answer["results"]] == list(range(1, 51))
    log = await get_ops(client)
    assert [entry["op_id"] for entry in log["ops"]] == [op["op_id"] for op in ops]
    children = (await get_doc(client))["state"]["nodes"]["root"]["children"]
    assert children == [f"n{i}" for i in range(50)]


async def test_a_rejected_op_does_not_stop_the_others_and_consumes_no_clock(
    client: TestClient[Any, Any],
) -> None:
    answer = await post_ops(client, [insert("a"), insert("a"), insert("b")])
    codes = [r.get("error", {}).get("code") for r in answer["results"]]
    assert codes == [None, "node_exists", None]
    assert [r.get("clock") for r in answer["results"]] == [1, None, 2]


async def test_an_atomic_batch_applies_nothing_when_one_op_is_rejected(
    client: TestClient[Any, Any],
) -> None:
    await _seed(client)
    answer = await post_ops(client, [increment(by=1), insert("n"), increment(by=1)], atomic=True)
    codes = [r["error"]["code"] for r in answer["results"]]
    assert codes == ["atomic_aborted", "node_exists", "atomic_aborted"]
    assert await counter(client) is None
    assert (await get_doc(client))["clock"] == 1


async def test_ops_since_returns_exactly_the_entries_after_the_clock(
    client: TestClient[Any, Any],
) -> None:
    await post_ops(client, [insert(f"n{i}") for i in range(10)])
    log = await get_ops(client, since=7)
    assert log["clock"] == 10
    assert [entry["clock"] for entry in log["ops"]] == [8, 9, 10]
    assert log["ops"][0]["op"]["node_id"] == "n7"


async def test_concurrent_atomic_batches_that_fail_apply_nothing_while_others_commit(
    client: TestClient[Any, Any],
) -> None:
    await _seed(client)
    failing = [[increment(by=1), insert("n"), increment(by=1)] for _ in range(30)]
    passing = [[increment(by=10), increment(by=10)] for _ in range(30)]
    answers = await asyncio.gather(
        *(post_ops(client, ops, atomic=True) for ops in failing + passing)
    )
    for answer in answers[:30]:
        codes = [r["error"]["code"] for r in answer["results"]]
        assert codes == ["atomic_aborted", "node_exists", "atomic_aborted"]
    for answer in answers[30:]:
        assert all("clock" in r for r in answer["results"])
    assert await counter(client) == 30 * 20  # only the passing batches, each whole
    log = await get_ops(client)
    assert log["clock"] == 1 + 60
    assert [entry["clock"] for entry in log["ops"]] == list(range(1, 62))
