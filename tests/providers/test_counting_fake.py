"""`CountingFakeProvider`: deterministic answers and exact counts, however it is called."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cv_workspace_client.providers import Provider, fake_answer
from cv_workspace_client.testing import CountingFakeProvider

PROMPTS = [f"prompt {i}" for i in range(10)]
CALLS_PER_PROMPT = 20


class GatedSleep:
    """Holds every call until `expected` calls are inside, proving they overlapped."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.inside = 0
        self.all_inside = asyncio.Event()
        self.gate = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.inside += 1
        if self.inside == self.expected:
            self.all_inside.set()
        await self.gate.wait()


async def test_answers_are_derived_from_the_prompt() -> None:
    provider = CountingFakeProvider()
    first = await provider.complete("a")
    again = await provider.complete("a")
    other = await provider.complete("b")
    assert first.text == again.text == fake_answer("a")
    assert other.text != first.text
    assert first.raw["choices"][0]["message"]["content"] == first.text


async def test_a_custom_answer_function_is_used() -> None:
    provider = CountingFakeProvider(answer=str.upper)
    assert (await provider.complete("shout")).text == "SHOUT"


async def test_counts_are_exact_under_concurrent_tasks() -> None:
    total = len(PROMPTS) * CALLS_PER_PROMPT
    sleep = GatedSleep(total)
    provider = CountingFakeProvider(delay=0.05, sleep=sleep)
    calls = asyncio.gather(
        *(provider.complete(p) for p in PROMPTS for _ in range(CALLS_PER_PROMPT))
    )
    await asyncio.wait_for(sleep.all_inside.wait(), timeout=10)
    assert provider.calls == total  # counted on entry, while all are still in flight
    sleep.gate.set()
    results = await asyncio.wait_for(calls, timeout=10)
    assert provider.calls == total
    assert provider.counts() == dict.fromkeys(PROMPTS, CALLS_PER_PROMPT)
    assert all(provider.calls_for(p) == CALLS_PER_PROMPT for p in PROMPTS)
    assert provider.calls_for("never asked") == 0
    assert provider.peak_in_flight == total
    assert [r.text for r in results] == [
        fake_answer(p) for p in PROMPTS for _ in range(CALLS_PER_PROMPT)
    ]


def test_counts_are_exact_across_threads_with_their_own_event_loops() -> None:
    provider = CountingFakeProvider()
    threads_n = 8
    start = threading.Barrier(threads_n)

    async def hammer() -> None:
        for _ in range(CALLS_PER_PROMPT):
            await asyncio.gather(*(provider.complete(p) for p in PROMPTS))

    def run() -> None:
        start.wait(timeout=10)
        asyncio.run(hammer())

    threads = [threading.Thread(target=run) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert provider.calls == threads_n * len(PROMPTS) * CALLS_PER_PROMPT
    assert provider.counts() == dict.fromkeys(PROMPTS, threads_n * CALLS_PER_PROMPT)


async def test_a_cancelled_call_still_counts_as_made() -> None:
    sleep = GatedSleep(1)
    provider = CountingFakeProvider(delay=1.0, sleep=sleep)
    task = asyncio.create_task(provider.complete("expensive"))
    await asyncio.wait_for(sleep.all_inside.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert provider.calls_for("expensive") == 1
    assert provider.peak_in_flight == 1
    sleep.gate.set()
    await provider.complete("cheap")
    assert provider.peak_in_flight == 1  # the cancelled call left the in-flight count


async def test_reset_forgets_the_counts() -> None:
    provider = CountingFakeProvider()
    await provider.complete("a")
    provider.reset()
    assert (provider.calls, provider.counts(), provider.peak_in_flight) == (0, {}, 0)
    await provider.complete("a")
    assert provider.calls_for("a") == 1


def test_the_fake_satisfies_the_provider_protocol() -> None:
    assert isinstance(CountingFakeProvider(), Provider)
