"""`enqueue_many` against the real server on loopback: one answer per item, in order, and a
retried batch — by the SDK after a lost answer, or by the app sending it again — enqueues
nothing twice."""

from __future__ import annotations

import pytest

from cv_workspace_client import EnqueueItem, InvalidRequestError, QueueClient
from cv_workspace_client.testing import FaultProxy

from .helpers import WS, fast_config

ITEMS = [
    EnqueueItem("evaluate", job_id="J1", input={"v": 1}),
    EnqueueItem("render"),  # no job: a random id, which only the key keeps from forking
    EnqueueItem("evaluate", job_id="J1", input={"v": 2}),  # a duplicate within the batch
    EnqueueItem("evaluate", job_id="J2", rerun=True),
]


async def _row_count(server_url: str, token: str) -> int:
    async with QueueClient(server_url, token) as reader:
        return len(await reader.list_requests(workspace_id=WS, limit=1000))


async def test_each_item_is_answered_in_order(server_url: str, token: str) -> None:
    async with QueueClient(server_url, token, config=fast_config()) as client:
        answers = await client.enqueue_many(WS, ITEMS)
        single = await client.enqueue(WS, stage="evaluate", job_id="J1")
    assert [a.coalesced for a in answers] == [False, False, True, False]
    assert [a.input_differs for a in answers] == [False, False, True, False]
    assert answers[2].request_id == answers[0].request_id
    assert answers[1].request_id.startswith("r_")
    assert single.request_id == answers[0].request_id  # the id the single enqueue mints
    assert not any(a.replayed for a in answers)
    assert await _row_count(server_url, token) == 3


async def test_a_batch_whose_answer_was_lost_is_retried_and_enqueues_nothing_twice(
    server_url: str, token: str
) -> None:
    async with FaultProxy(server_url) as proxy:
        async with QueueClient(proxy.url, token, config=fast_config()) as client:
            proxy.cut_next(1)  # the server commits the batch; its answer never arrives
            answers = await client.enqueue_many(WS, ITEMS)
        assert proxy.stats.cuts == 1
    assert all(a.replayed for a in answers)  # the retry got the first attempt's answer
    assert [a.coalesced for a in answers] == [False, False, True, False]
    assert await _row_count(server_url, token) == 3


async def test_a_batch_sent_again_is_answered_as_duplicates(server_url: str, token: str) -> None:
    deterministic = [item for item in ITEMS if item.job_id is not None and not item.rerun]
    async with QueueClient(server_url, token, config=fast_config()) as client:
        first = await client.enqueue_many(WS, deterministic)
        again = await client.enqueue_many(WS, deterministic)
    assert [a.request_id for a in again] == [a.request_id for a in first]
    assert all(a.coalesced and not a.replayed for a in again)
    assert await _row_count(server_url, token) == 1


async def test_a_bad_item_refuses_the_batch_and_nothing_is_enqueued(
    server_url: str, token: str
) -> None:
    async with QueueClient(server_url, token, config=fast_config()) as client:
        with pytest.raises(InvalidRequestError) as refused:
            await client.enqueue_many(WS, [ITEMS[0], EnqueueItem("evaluate", max_dequeues=0)])
        assert await client.enqueue_many(WS, []) == []
    assert refused.value.code == "invalid_field"
    assert "requests[1]" in str(refused.value)
    assert await _row_count(server_url, token) == 0
