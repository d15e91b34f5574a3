"""A fake OpenAI-compatible provider endpoint that counts calls: for the demo, the acceptance
tests and the benchmark, where the workers are separate processes and the count must be one.

`python -m cv_workspace_client.stages.fake_provider [--port 0] [--delay 0.05]` prints
`fake provider listening on http://127.0.0.1:PORT/v1` and serves:

- `POST /v1/chat/completions` — answers after `delay` seconds with a deterministic completion
  (`demo_answer(prompt)`; a whole number for commute prompts). A call counts when it arrives:
  a call sent is a call paid for.
- `GET /stats` — `{"calls", "in_flight", "peak_in_flight", "by_prompt": {prompt: count}}`.
- `POST /reset` — forget the counts.

Point a worker at it with `--provider openai --provider-url http://127.0.0.1:PORT/v1`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
from collections import Counter
from typing import Any

from aiohttp import web

from cv_workspace_client.providers import fake_answer

__all__ = ["FakeProviderStats", "create_fake_provider_app", "demo_answer", "main"]

_STATS: web.AppKey[FakeProviderStats] = web.AppKey("stats")
_DELAY: web.AppKey[float] = web.AppKey("delay")


def demo_answer(prompt: str) -> str:
    """The endpoint's answer to `prompt`: stable across runs and processes. Commute prompts (see
    `stages.enrich`) get a whole number of minutes; everything else `fake_answer(prompt)`."""
    if prompt.startswith("Commute in minutes"):
        digest = hashlib.sha256(prompt.encode()).digest()
        return str(5 + int.from_bytes(digest[:4], "big") % 86)
    return fake_answer(prompt)


class FakeProviderStats:
    def __init__(self) -> None:
        self.by_prompt: Counter[str] = Counter()
        self.calls = 0
        self.in_flight = 0
        self.peak_in_flight = 0

    def reset(self) -> None:
        """Forget the counts (calls in flight stay in flight)."""
        self.by_prompt.clear()
        self.calls = 0
        self.peak_in_flight = self.in_flight

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "by_prompt": dict(self.by_prompt),
        }


async def _completions(request: web.Request) -> web.Response:
    stats = request.app[_STATS]
    try:
        body = await request.json()
        prompt = str(body["messages"][-1]["content"])
    except (ValueError, KeyError, IndexError, TypeError):
        return web.json_response(
            {"error": {"message": "not a chat completion request"}}, status=400
        )
    stats.calls += 1
    stats.by_prompt[prompt] += 1
    stats.in_flight += 1
    stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
    try:
        # The latency of a real provider: the window in which racing workers can double-pay.
        await asyncio.sleep(request.app[_DELAY])
    finally:
        stats.in_flight -= 1
    return web.json_response(
        {
            "id": f"fake-{stats.calls}",
            "object": "chat.completion",
            "model": body.get("model", "fake"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": demo_answer(prompt)},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 1},
        }
    )


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATS].to_json())


async def _reset(request: web.Request) -> web.Response:
    request.app[_STATS].reset()
    return web.json_response({"reset": True})


def create_fake_provider_app(delay: float = 0.05) -> web.Application:
    app = web.Application()
    app[_STATS] = FakeProviderStats()
    app[_DELAY] = delay
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/stats", _stats)
    app.router.add_post("/reset", _reset)
    return app


async def _serve(host: str, port: int, delay: float) -> None:
    runner = web.AppRunner(create_fake_provider_app(delay), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"fake provider listening on http://{host}:{bound}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_provider", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per answer")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.delay))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
