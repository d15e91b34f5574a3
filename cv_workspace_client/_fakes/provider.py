"""`CountingFakeProvider`: a `Provider` that counts its calls. Apps' tests import it from
`cv_workspace_client.testing`; `cv-worker --provider fake` hands it to stages from here, as no
module the product runs imports `testing`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from cv_workspace_client.providers import ProviderResult, fake_answer

__all__ = ["CountingFakeProvider"]


class CountingFakeProvider:
    """A `Provider` that answers `answer(prompt)` after `delay` seconds and counts every call.

    A call counts when it starts: a call that was sent is a call paid for, even if the caller is
    cancelled before the answer. Counters are guarded by a lock, so one instance can be shared by
    tasks and by threads running their own event loops.
    """

    #: The model a call names when its caller names none (what `cv-worker` logs for it).
    model = "counting-fake"

    def __init__(
        self,
        *,
        delay: float = 0.0,
        answer: Callable[[str], str] = fake_answer,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.delay = delay
        self._answer = answer
        self._sleep = sleep
        self._lock = threading.Lock()
        self._by_prompt: Counter[str] = Counter()
        self._calls = 0
        self._in_flight = 0
        self._peak_in_flight = 0

    async def complete(
        self, prompt: str, *, model: str | None = None, **params: Any
    ) -> ProviderResult:
        with self._lock:
            self._calls += 1
            self._by_prompt[prompt] += 1
            self._in_flight += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
        try:
            if self.delay > 0:
                await self._sleep(self.delay)
            text = self._answer(prompt)
        finally:
            with self._lock:
                self._in_flight -= 1
        raw = {
            "model": model or self.model,
            "choices": [{"message": {"role": "assistant", "content": text}}],
            "params": params,
        }
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": 1}
        return ProviderResult(text=text, raw=raw, usage=usage)

    @property
    def calls(self) -> int:
        """Calls made so far, all prompts together."""
        with self._lock:
            return self._calls

    def calls_for(self, prompt: str) -> int:
        """Calls made so far with exactly `prompt`."""
        with self._lock:
            return self._by_prompt[prompt]

    def counts(self) -> dict[str, int]:
        """A snapshot of the calls per prompt."""
        with self._lock:
            return dict(self._by_prompt)

    @property
    def peak_in_flight(self) -> int:
        """The most calls that were ever running at once."""
        with self._lock:
            return self._peak_in_flight

    def reset(self) -> None:
        """Forget every count (calls in flight stay in flight)."""
        with self._lock:
            self._by_prompt.clear()
            self._calls = 0
            self._peak_in_flight = self._in_flight
