"""`WorkspaceClient(token_provider=...)`: the SDK asks the app for a fresh token when the server
refuses the one in use, and goes on — ops once each and in order, the websocket reconnected, the
subscriptions and the queue calls undisturbed — instead of parking everything until the app
notices `sync_status.refused` and calls `set_token()`. A provider whose tokens keep being refused
is asked a bounded number of times, with the client's backoff, never in a loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cv_mutations import NodeIncrement, NodeInsert
from cv_server.auth import mint_token
from cv_workspace_client import (
    AuthError,
    Committed,
    ForbiddenError,
    StillPendingError,
    WorkspaceClient,
)
from cv_workspace_client._io.auth import RefreshPolicy, TokenRefresher
from cv_workspace_client._queue.requester import enqueue, get_request, wait_request
from cv_workspace_client.stage import StageContext
from cv_workspace_client.worker import Worker, WorkerConfig
from tests.clocks import stop_token_clock

from ..helpers import SECRET, WS, RecordingSleep, collect, fast_config, server_log, token_for

BOUND = 20.0


class Provider:
    """A token provider that counts its calls and gives `tokens()` each time."""

    def __init__(self, tokens: Callable[[], str] = lambda: token_for(WS)) -> None:
        self.calls = 0
        self.tokens = tokens
        self.called = asyncio.Event()

    async def __call__(self) -> str:
        self.calls += 1
        self.called.set()
        await asyncio.sleep(0)  # a real provider answers later, not within the call
        return self.tokens()


def _ops() -> list[NodeInsert | NodeIncrement]:
    return [NodeInsert(node_id="n", parent_id="root")] + [
        NodeIncrement(node_id="n", field="c") for _ in range(4)
    ]


# -- the refresh rule, without a server --------------------------------------------------------


def _refresher(
    provider: Callable[[], Awaitable[str]] | None, sleep: RecordingSleep, attempts: int = 5
) -> tuple[TokenRefresher, list[str]]:
    held = ["t0"]
    refresher = TokenRefresher(
        provider,
        current=lambda: held[-1],
        adopt=held.append,
        policy=RefreshPolicy(attempts, backoff=lambda n: float(n)),
        sleep=sleep,
    )
    return refresher, held


async def test_refusals_at_once_share_one_provider_call() -> None:
    provider = Provider(lambda: "t1")
    refresher, held = _refresher(provider, RecordingSleep())
    answers = await asyncio.gather(*(refresher.refreshed("t0") for _ in range(20)))
    assert answers == [True] * 20
    assert provider.calls == 1
    assert held == ["t0", "t1"]


async def test_tokens_refused_in_turn_are_retried_with_backoff_then_the_refusal_stands() -> None:
    counter = iter(range(1, 100))
    provider = Provider(lambda: f"t{next(counter)}")
    sleep = RecordingSleep()
    refresher, held = _refresher(provider, sleep, attempts=5)
    for _ in range(12):  # each fresh token is refused again (a workspace the user lost)
        if not await refresher.refreshed(held[-1]):
            break
    assert provider.calls == 5
    assert sleep.delays == [1.0, 2.0, 3.0, 4.0]  # the first refresh at once, then the backoff
    assert await refresher.refreshed(held[-1]) is False
    assert provider.calls == 5  # not asked again until the app steps in
    refresher.reset()
    assert await refresher.refreshed(held[-1]) is True
    assert provider.calls == 6


async def test_an_accepted_token_resets_the_count() -> None:
    counter = iter(range(1, 100))
    provider = Provider(lambda: f"t{next(counter)}")
    sleep = RecordingSleep()
    refresher, held = _refresher(provider, sleep, attempts=2)
    for _ in range(10):  # every token expires after it worked: an hourly refresh, for ever
        assert await refresher.refreshed(held[-1]) is True
        refresher.accepted(held[-1])
    assert provider.calls == 10
    assert sleep.delays == []


async def test_a_failing_or_unchanged_provider_leaves_the_refusal_standing() -> None:
    async def broken() -> str:
        raise OSError("auth server down")

    refresher, held = _refresher(broken, RecordingSleep())
    assert await refresher.refreshed("t0") is False
    assert isinstance(refresher.last_error, OSError)
    assert held == ["t0"]

    same = Provider(lambda: "t0")
    refresher, held = _refresher(same, RecordingSleep())
    assert await refresher.refreshed("t0") is False
    assert held == ["t0"]


async def test_a_refusal_of_a_replaced_token_goes_again_without_asking() -> None:
    provider = Provider(lambda: "t9")
    refresher, held = _refresher(provider, RecordingSleep())
    held.append("t1")  # set_token while the request was out
    assert await refresher.refreshed("t0") is True
    assert provider.calls == 0


async def test_a_refusal_after_close_does_not_ask_the_provider() -> None:
    """A request refused while its client closes (a worker's call in flight) must not start a
    refresh: its token would be adopted into a closed client."""
    provider = Provider(lambda: "t1")
    refresher, held = _refresher(provider, RecordingSleep())
    refresher.close()
    assert await refresher.refreshed("t0") is False
    assert provider.calls == 0
    assert held == ["t0"]


# -- through the real server -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_token", ["not-a-token", token_for("other")], ids=["unauthorized", "forbidden"]
)
@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_ops_refused_for_the_token_go_through_with_the_providers_token(
    server_url: str, tmp_path: Path, bad_token: str, websocket: bool
) -> None:
    provider = Provider()
    async with WorkspaceClient(
        server_url,
        token=bad_token,
        token_provider=provider,
        outbox=tmp_path / "app.outbox",
        config=fast_config(ops_over_websocket=websocket),
    ) as client:
        calls = [client.apply_op(WS, "tree", op) for op in _ops()]
        commits = await asyncio.wait_for(asyncio.gather(*calls), BOUND)
        assert [commit.clock for commit in commits] == [1, 2, 3, 4, 5]
        assert client.sync_status.refused == frozenset()
    assert provider.calls == 1
    log = await server_log(server_url, "tree")
    assert [entry["clock"] for entry in log] == [1, 2, 3, 4, 5]
    assert [entry["op_id"] for entry in log] == [commit.op_id for commit in commits]


async def test_many_sub_docs_refused_at_once_ask_the_provider_once(
    server_url: str, tmp_path: Path
) -> None:
    provider = Provider()
    async with WorkspaceClient(
        server_url,
        token="expired-token",
        token_provider=provider,
        outbox=tmp_path / "app.outbox",
        config=fast_config(ops_over_websocket=False),
    ) as client:
        calls = [client.apply_op(WS, f"doc-{i}", _ops()[0]) for i in range(16)]
        commits = await asyncio.wait_for(asyncio.gather(*calls), BOUND)
    assert provider.calls == 1
    assert {commit.clock for commit in commits} == {1}
    for i in range(16):
        assert len(await server_log(server_url, f"doc-{i}")) == 1


async def test_a_client_without_a_token_asks_the_provider_at_start(server_url: str) -> None:
    provider = Provider()
    async with WorkspaceClient(server_url, token_provider=provider, config=fast_config()) as client:
        assert provider.calls == 1
        assert client.token is not None
        commit = await asyncio.wait_for(client.apply_op(WS, "tree", _ops()[0]), BOUND)
    assert commit.clock == 1
    assert provider.calls == 1  # the first token worked: nothing refused, nothing asked


async def test_a_subscription_outlives_its_tokens_expiry_on_the_open_websocket(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server closes a socket at its token's expiry (4001). With a provider the socket
    reconnects with a fresh token and the subscription resumes: no gap, no duplicate, no error."""
    # One second left at the handshake, whenever it comes: minted 59 s before the second the
    # server's token clock stands at, for 60 s.
    stopped = stop_token_clock(monkeypatch)
    expiring = mint_token(SECRET, [WS], now=stopped - 59, ttl=60)
    provider = Provider()
    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as writer,
        WorkspaceClient(
            server_url, token=expiring, token_provider=provider, config=fast_config()
        ) as reader,
    ):
        await reader.connect(WS, timeout=BOUND)
        async with reader.subscribe(WS, "tree") as sub:
            await asyncio.wait_for(writer.apply_op(WS, "tree", _ops()[0]), BOUND)
            first = await asyncio.wait_for(anext(sub), BOUND)
            await asyncio.wait_for(provider.called.wait(), BOUND)  # the expiry came
            for op in _ops()[1:]:
                await asyncio.wait_for(writer.apply_op(WS, "tree", op), BOUND)
            rest = await asyncio.wait_for(collect(sub, 5), BOUND)
        assert reader.sync_status.refused == frozenset()
        assert reader._sockets[WS].connections >= 2
    assert [first.clock, *rest] == [1, 2, 3, 4, 5]
    assert provider.calls == 1


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_a_provider_whose_tokens_are_all_refused_is_asked_a_bounded_number_of_times(
    server_url: str, tmp_path: Path, websocket: bool
) -> None:
    """The user lost access to the workspace: every fresh token is refused too. The provider is
    asked `retry_attempts` times at most, the ops stay in the outbox, and `set_token` (a token
    that works) sends them once each."""
    minted = iter(range(100))
    # A new token each time (`iat` is in whole seconds: the same grant would mint the same one).
    provider = Provider(lambda: token_for("other", f"other-{next(minted)}"))
    async with WorkspaceClient(
        server_url,
        token=token_for("other"),
        token_provider=provider,
        outbox=tmp_path / "app.outbox",
        config=fast_config(ops_over_websocket=websocket, retry_attempts=3),
    ) as client:
        for op in _ops():  # each submit retries the parked sub-doc, and so the refresh
            with pytest.raises(StillPendingError) as pending:
                await asyncio.wait_for(client.apply_op(WS, "tree", op), BOUND)
            assert isinstance(pending.value.last_error, ForbiddenError | AuthError)
        assert provider.calls == 3
        assert client.sync_status.refused == frozenset({WS})
        assert client.pending_count() == 5
        assert await server_log(server_url, "tree") == []

        client.set_token(token_for(WS))
        await client.wait_synced(timeout=BOUND)
    log = await server_log(server_url, "tree")
    assert [entry["clock"] for entry in log] == [1, 2, 3, 4, 5]
    assert len({entry["op_id"] for entry in log}) == 5


async def test_queue_calls_and_waits_go_through_with_the_providers_token(
    server_url: str,
) -> None:
    provider = Provider()
    async with WorkspaceClient(
        server_url, token="expired-token", token_provider=provider, config=fast_config()
    ) as client:
        answer = await enqueue(client, WS, {"stage": "s", "job_id": "J1"})
        client.set_token("expired-again")
        row = await get_request(client, WS, answer.request_id)
        client.set_token("expired-once-more")
        outcome = await wait_request(client, WS, answer.request_id, timeout=0.2)
    assert row.request_id == answer.request_id
    assert outcome.status == "timeout"  # nobody works it: the wait ran out, it was not refused
    assert provider.calls == 3


async def test_a_worker_keeps_working_across_a_refused_token(server_url: str) -> None:
    """Workers run for days; their tokens do not. A refused claim does not stop the worker."""
    provider = Provider()
    calls: list[object] = []

    async def echo(ctx: StageContext) -> object:
        calls.append(ctx.input)
        return {"echo": ctx.input}

    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as app,
        WorkspaceClient(
            server_url, token="expired-token", token_provider=provider, config=fast_config()
        ) as worker_client,
    ):
        worker = Worker(
            worker_client,
            {"echo": echo},
            config=WorkerConfig(idle_initial_seconds=0.01, idle_max_seconds=0.05),
        )
        task = asyncio.create_task(worker.run())
        try:
            answer = await app.enqueue(WS, stage="echo", job_id="J1", input=[1, 2])
            outcome = await app.wait_request(WS, answer.request_id, timeout=BOUND)
        finally:
            worker.stop()
            await asyncio.wait_for(task, BOUND)  # raises if the worker died on the refusal
    assert outcome.status == "done"
    assert outcome.result == {"echo": [1, 2]}
    assert calls == [[1, 2]]
    assert provider.calls == 1


async def test_a_provider_that_never_answers_is_given_up_after_the_request_timeout() -> None:
    never = asyncio.Event()

    async def silent() -> str:
        await never.wait()  # its auth server accepted the connection and went quiet
        return "never"

    held = ["t0"]
    refresher = TokenRefresher(
        silent,
        current=lambda: held[-1],
        adopt=held.append,
        policy=RefreshPolicy(5, backoff=lambda n: 0.0),
        sleep=RecordingSleep(),
        timeout=0.05,
    )
    assert await asyncio.wait_for(refresher.refreshed("t0"), BOUND) is False
    assert isinstance(refresher.last_error, TimeoutError)
    assert refresher.policy.failures == refresher.policy.attempts  # each try timed out


async def test_a_failing_provider_is_asked_again_with_the_backoff_within_one_refresh() -> None:
    """A blip of the auth server: one failure does not make the refusal stand (which would stop
    a worker and end a websocket's subscriptions); the provider is asked again with the backoff
    within the same refresh."""
    answers: list[BaseException | str] = [OSError("down"), OSError("still down"), "t1"]

    async def flaky() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    sleep = RecordingSleep()
    refresher, held = _refresher(flaky, sleep)
    assert await refresher.refreshed("t0") is True
    assert held == ["t0", "t1"]
    assert sleep.delays == [1.0, 2.0]  # the policy's backoff between the provider's tries
    assert answers == []


async def test_retry_pending_reconnects_a_websocket_that_gave_up_on_a_refusal(
    server_url: str,
) -> None:
    healthy = False

    async def provider() -> str:
        if not healthy:
            raise OSError("the auth server is down")
        return token_for(WS)

    async with (
        WorkspaceClient(server_url, token=token_for(WS), config=fast_config()) as writer,
        WorkspaceClient(
            server_url,
            token="expired-token",
            token_provider=provider,
            config=fast_config(retry_attempts=2),
        ) as client,
    ):
        async with client.subscribe(WS, "tree") as refused:
            with pytest.raises(AuthError):  # refused, and the provider could not help
                await asyncio.wait_for(anext(refused), BOUND)
        assert client.sync_status.refused == frozenset({WS})
        healthy = True
        client.retry_pending()  # the websocket that gave up connects again
        async with client.subscribe(WS, "tree") as sub:
            commit = await writer.apply_op(WS, "tree", _ops()[0])
            seen = await asyncio.wait_for(anext(sub), BOUND)
        assert isinstance(seen, Committed)
        assert seen.op_id == commit.op_id
        assert client.sync_status.refused == frozenset()
