"""`compute_once`: the compute lock (layer 2, docs/stages.md) as one call.

An expensive third-party call inside a stage (one LLM call per custom column, one maps call per
commute) must be paid for once, however many workers race for it. The protocol, per call:

1. **pre-flight check** — already there? Return it without touching the lock;
2. **acquire** `compute_lock(workspace, job_id, task)` on the server (insert-or-ignore, atomic);
3. **double-check inside the lock** — catches a write that landed between 1 and 2;
4. **compute** — the call *and its write*, committed before we go on;
5. **release** — in `finally`, and only with the token our acquisition got.

A caller that finds the key locked gets `locked` ("someone else is on it"); with `wait` it follows
the sub-doc the value is written to and returns it (`present`) as soon as the holder's write is
broadcast. If the holder dies instead, its lock lapses after the server's TTL (60 s) and the
waiter takes it over: a crashed worker costs one TTL, never a stuck cell.

```python
result = await compute_once(
    client, "ws1", job_id, f"eval:{col}",
    check=lambda: read_cell(job_id, col),          # current value or None
    compute=lambda: call_llm_then_write(job_id, col),
    holder=worker_id, sub_doc="jobs", wait=60.0,
)
```

The lock is workspace-internal: two workspaces never contend for it (the queue, not the lock,
coordinates across workspaces — docs/concepts.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

from cv_workspace_client._io.http import HttpApi
from cv_workspace_client._io.retry import retrying
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.errors import LogCompactedError, ProtocolError, WorkspaceError

__all__ = [
    "LOCK_MARGIN_FRACTION",
    "ComputeResult",
    "ComputeStatus",
    "LockAnswer",
    "LockExpiringError",
    "LockPolling",
    "acquire_lock",
    "compute_budget",
    "compute_once",
    "lock_task",
    "release_lock",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ComputeStatus = Literal["present", "computed", "locked"]

#: Share of a lock's lifetime kept free at its end: the compute (call + write) must be done by
#: `expires_at - LOCK_MARGIN_FRACTION * lifetime`. The rest of the lifetime is the budget; the
#: margin (6 s of the 60 s TTL) absorbs the write's last round trip (clock skew between worker and
#: server does not enter: the lock is timed on the worker's clock from the server's durations).
#: Derived from the TTL (docs/configuration.md), not a constant of its own.
LOCK_MARGIN_FRACTION = 0.1

#: The longest `task` the lock routes take (1..256 characters, docs/limits.md).
MAX_LOCK_TASK = 256
#: Hex digits of sha256 standing in for the cut tail of a task too long for its grant suffix:
#: 128 bits, so no two tasks of one grant are made to share a lock.
_TASK_DIGEST_HEX = 32


def lock_task(task: str, scope_key: str | None) -> str:
    """The `task` a compute lock is taken under for a caller of grant `scope_key` (None: the full
    grant, whose locks keep their plain `task`).

    Under a limited grant it is `task@scope_key`, so two grants never share a lock and one grant
    always finds its own (tests/compute/test_compute_lock_grants.py). When that would pass the
    routes' limit (`MAX_LOCK_TASK`), the task's tail is replaced by a digest of the whole task:
    `<head>~<sha256 of task, 32 hex>@scope_key`, exactly the limit long, and the same for the same
    task every time (docs/stages.md).
    """
    if scope_key is None:
        return task
    suffix = f"@{scope_key}"
    if len(task) + len(suffix) <= MAX_LOCK_TASK:
        return f"{task}{suffix}"
    digest = hashlib.sha256(task.encode("utf-8", "surrogatepass")).hexdigest()[:_TASK_DIGEST_HEX]
    head = task[: MAX_LOCK_TASK - len(suffix) - 1 - _TASK_DIGEST_HEX]
    return f"{head}~{digest}{suffix}"


@dataclass(frozen=True, slots=True)
class ComputeResult(Generic[T]):
    """What `compute_once` did.

    - `present`: the value was already there (pre-flight, double-check, or the broadcast of
      another holder's write while waiting); `value` is it.
    - `computed`: this call made the expensive call and its write committed; `value` is it.
    - `locked`: someone else holds the lock and no value appeared (no `wait`, or the deadline
      passed); `value` is None. The caller decides: retry later, or fail the stage so the queue
      re-drives it.
    """

    status: ComputeStatus
    value: T | None = None


class LockExpiringError(WorkspaceError):
    """`compute_lock_expiring`: the compute did not finish within the lock's budget.

    Raised instead of writing late: once the lock may have lapsed another worker can take the key
    over and pay for the same call. The stage should fail so the queue re-drives it (the next
    attempt finds the value if the write landed after all, or computes it under a fresh lock).
    """

    def __init__(self, message: str) -> None:
        super().__init__("compute_lock_expiring", message)


# -- the lock routes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LockAnswer:
    """The server's answer to an acquisition.

    `acquired` with a `token` (ours to release), or locked by `holder` until `expires_at` (epoch
    seconds, the server's clock). `token` is None with `acquired` when the lock is ours but its
    token was lost (see `acquire_lock`): it then lapses at `expires_at` instead of being released.
    `expires_in` (seconds left when the server answered) and `ttl` (the lock's lifetime) are
    durations, free of any clock: None when the server did not send them.
    """

    acquired: bool
    expires_at: float
    token: str | None = None
    holder: str | None = None
    expires_in: float | None = None
    ttl: float | None = None

    def local_span(self, asked_at: float) -> tuple[float, float]:
        """`(acquired_at, expires_at)` of the lock on the clock that read `asked_at` just before
        the acquisition was sent.

        The server's `expires_at` is on the server's clock; a worker whose clock is behind would
        think it had time left after the lock lapsed (and a second worker paid for the same
        call), one whose clock is ahead would never dare compute. The server measured
        `expires_in` after we asked, so `asked_at + expires_in` is never later than the real
        expiry, whatever either clock says. A server that sends no durations: its `expires_at`.
        """
        if self.expires_in is None:
            return asked_at, self.expires_at
        expires_at = asked_at + self.expires_in
        lifetime = self.ttl if self.ttl is not None else self.expires_in
        return expires_at - max(lifetime, self.expires_in), expires_at


def _locks_path(workspace_id: str, verb: str) -> str:
    return f"/v1/workspaces/{quote(workspace_id, safe='')}/locks/{verb}"


def _api(client: WorkspaceClient) -> HttpApi:
    # The client's own session (and connection pool); the lock routes are plain JSON requests.
    return HttpApi(client.session, client.url, client.token)


async def _post_json(
    client: WorkspaceClient, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The JSON object `path` answered, and how many attempts it took."""
    api = _api(client)
    answer: Any = None
    attempts = 0
    async for attempt in retrying(client.config):
        with attempt:
            attempts += 1
            answer = await api.request("POST", path, data=json.dumps(body).encode())
    if not isinstance(answer, dict):
        raise ProtocolError("bad_answer", f"{path}: expected a JSON object")
    return answer, attempts


async def acquire_lock(
    client: WorkspaceClient, workspace_id: str, job_id: str, task: str, holder: str
) -> LockAnswer:
    """`POST .../locks/acquire` (retried on connection errors, 5xx and 429).

    Retrying an acquisition is safe because `holder` names this attempt alone (`compute_once`
    adds a random suffix): if the first answer was lost after the server took the lock, the retry
    is told "locked by `holder`" — by us. That answer comes back as `acquired` without a token:
    the lock is ours, nobody else can take it before it lapses, but we cannot release it. Only
    on a retry, though: answered so at the first attempt, the lock is someone else's who goes by
    the same name (two stages of one worker, say), and it is `locked` like any other.
    """
    answer, attempts = await _post_json(
        client,
        _locks_path(workspace_id, "acquire"),
        {"job_id": job_id, "task": task, "holder": holder},
    )
    try:
        expires_at = float(answer["expires_at"])
        expires_in, ttl = _duration(answer, "expires_in"), _duration(answer, "ttl")
        if answer.get("acquired") is True:
            token = str(answer["token"])
            decided = LockAnswer(True, expires_at, token, holder, expires_in, ttl)
        else:
            other = answer.get("holder")
            if other == holder and attempts > 1:
                decided = LockAnswer(True, expires_at, None, holder, expires_in, ttl)
            else:
                other = other if isinstance(other, str) else None
                decided = LockAnswer(False, expires_at, None, other, expires_in, ttl)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError("bad_answer", f"lock answer: {exc!r}") from None
    log.info(
        "compute lock %s/%s %s",
        job_id,
        task,
        "acquired" if decided.acquired else f"held by {decided.holder}",
        extra={
            "event": "lock_acquired" if decided.acquired else "lock_contended",
            "job_id": job_id,
            "task": task,
            "holder": holder,
        },
    )
    return decided


def _duration(answer: dict[str, Any], name: str) -> float | None:
    """A duration of a lock answer: absent → None; anything but a finite number ≥ 0 → ValueError."""
    raw = answer.get(name)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 <= raw < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds >= 0: {raw!r}")
    return float(raw)


async def release_lock(
    client: WorkspaceClient, workspace_id: str, job_id: str, task: str, token: str
) -> bool:
    """`POST .../locks/release`; True if our lock was deleted (False: it had lapsed already, and
    maybe been taken over — the server only deletes the lock that `token` acquired)."""
    answer, _ = await _post_json(
        client,
        _locks_path(workspace_id, "release"),
        {"job_id": job_id, "task": task, "token": token},
    )
    return answer.get("released") is True


# -- timing (pure) --------------------------------------------------------------------------------


def compute_budget(acquired_at: float, expires_at: float, now: float) -> float:
    """Seconds the compute may still take, given when we asked for the lock, when it expires and
    the time now, all three on one clock (see `LockAnswer.local_span`). ≤ 0 means: do not start.

    The lock's lifetime is `expires_at - acquired_at` (the server's TTL, seen from here); the last
    `LOCK_MARGIN_FRACTION` of it is kept free so the write is committed while the lock is still
    surely ours.
    """
    lifetime = max(0.0, expires_at - acquired_at)
    return expires_at - LOCK_MARGIN_FRACTION * lifetime - now


# -- the protocol ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LockPolling:
    """How a waiting caller retries the acquisition while it follows the broadcast.

    The broadcast of the holder's write is what normally ends a wait. Polling covers the holder
    that released without writing (its call failed) or died (its lock lapses at the TTL): the
    first poll to get the lock takes the key over. The default worker idle poll — 100 ms doubling
    to 2 s — since a waiting stage is an idle worker.
    """

    initial_seconds: float = 0.1
    max_seconds: float = 2.0

    def delay(self, polls: int) -> float:
        """Seconds before poll number `polls + 1`."""
        return float(min(self.max_seconds, self.initial_seconds * 2.0 ** min(polls, 30)))


async def compute_once(
    client: WorkspaceClient,
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], Awaitable[T | None]],
    compute: Callable[[], Awaitable[T]],
    holder: str,
    sub_doc: str | None = None,
    wait: float | None = None,
    lease: Callable[[], None] | None = None,
    polling: LockPolling = LockPolling(),
    now: Callable[[], float] = time.time,
    scope_key: str | None = None,
) -> ComputeResult[T]:
    """Run `compute` at most once across every caller of `(workspace_id, job_id, task)`.

    Args:
        check: the current value, or None if it is not there yet. Called for the pre-flight, the
            double-check inside the lock, and (waiting) after committed ops of `sub_doc`.
        compute: the expensive call **and** its write; it must return only once the write is
            committed (the lock is released right after, and the next caller's check must see
            it). Bounded in time by the lock (see `compute_budget`).
        holder: who we are (the worker id); a random suffix makes each acquisition distinct.
        sub_doc: where the value is written; needed to `wait`.
        wait: seconds to wait for another holder's write when the key is locked (None: return
            `locked` at once). While waiting the acquisition is retried (`polling`, and once
            more at the deadline), so a holder that gave up or died (its lock lapses after the
            server's TTL) is taken over.
        lease: called before each acquisition and before the compute starts; raises to stop (the
            stage's `ensure_lease`: a stage that lost its queue claim must not pay for a call).
        polling: the acquisition retry schedule while waiting.
        now: the clock that times the compute against the lock (injectable); only its
            differences count, so it need not agree with the server's.
        scope_key: the grant the caller works under (`StageRequest.scope_key`; None: the full
            grant). It is part of the lock's key (`lock_task`), so callers under different
            grants never share a lock or wait on each other's write (docs/stages.md).

    Raises:
        LockExpiringError: the compute outran the lock's budget; it is cancelled rather than
            allowed to write after the lock may have been taken over.
        WorkspaceError: the lock routes failed after the client's retries. Whatever `check`,
            `compute` or `lease` raise propagates (the lock is released first).
    """
    if wait is not None and sub_doc is None:
        raise ValueError("wait needs sub_doc: the sub-doc the holder's write is broadcast on")
    task = lock_task(task, scope_key)
    me = f"{holder[:200]}#{secrets.token_hex(6)}"

    # 1. Pre-flight: no lock round trip when the value is already there.
    value = await check()
    if value is not None:
        return ComputeResult("present", value)
    if lease is not None:
        lease()
    # 2. Acquire.
    asked_at = now()
    lock = await acquire_lock(client, workspace_id, job_id, task, me)
    if not lock.acquired:
        # Someone else is on it (`{locked: true}` → wait for the realtime broadcast).
        if wait is None:
            return ComputeResult("locked")
        assert sub_doc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        async with _Follower(client, workspace_id, sub_doc) as follower:
            # The follower holds the head clock: the check sees every write up to it, the
            # subscription every write after it.
            value = await check()
            if value is not None:
                return ComputeResult("present", value)
            polls = 0
            next_poll = loop.time() + polling.delay(polls)
            while not lock.acquired:
                if await follower.changed(until=min(next_poll, deadline)):
                    value = await check()
                    if value is not None:
                        return ComputeResult("present", value)
                # Poll once its time has come, whether or not the sub-doc changed meanwhile: on a
                # busy sub-doc (other cells, other jobs) some op lands before every poll time, and
                # a `continue` here would never poll — a dead holder's lapsed lock would then be
                # taken over only by the stage's re-drive after the wait, not after one TTL.
                # And once more at the deadline: racers arrive within moments of the holder and
                # wait one TTL, so a dead holder's lock lapses just before their deadline — after
                # their last poll (polls are up to `max_seconds` apart). Giving up without asking
                # again would leave a free key to the queue's re-drive, a backoff later.
                at_deadline = loop.time() >= deadline
                if loop.time() < next_poll and not at_deadline:
                    continue  # a change
                if lease is not None:
                    lease()
                polls += 1
                next_poll = loop.time() + polling.delay(polls)
                asked_at = now()
                lock = await acquire_lock(client, workspace_id, job_id, task, me)
                if at_deadline and not lock.acquired:
                    return ComputeResult("locked")
    return await _holding(
        client, workspace_id, job_id, task, lock, asked_at, check, compute, lease, now
    )


async def _holding(
    client: WorkspaceClient,
    workspace_id: str,
    job_id: str,
    task: str,
    lock: LockAnswer,
    asked_at: float,
    check: Callable[[], Awaitable[T | None]],
    compute: Callable[[], Awaitable[T]],
    lease: Callable[[], None] | None,
    now: Callable[[], float],
) -> ComputeResult[T]:
    """Steps 3 to 5, with the lock held."""
    release = True
    try:
        # 3. Double-check: a write may have landed between our pre-flight and our acquisition
        #    (its holder released just before we asked).
        value = await check()
        if value is not None:
            return ComputeResult("present", value)
        if lease is not None:
            lease()
        # 4. Compute, bounded by the lock. The server's TTL is 60 s and the provider may retry
        #    for longer than that (full-jitter retries, docs/configuration.md). A holder still
        #    computing when its lock lapses would race whoever takes the key over: two paid calls,
        #    two writes. So the compute — call and write — must be done `LOCK_MARGIN_FRACTION` of
        #    the lock's lifetime before `expires_at`, or it is cancelled and we raise: the stage
        #    fails, the queue re-drives it, and the next attempt re-checks before paying again.
        #    The lock's span is read on our clock (`LockAnswer.local_span`): the server's
        #    `expires_at` against our clock would be off by however far the two clocks are.
        acquired_at, expires_at = lock.local_span(asked_at)
        budget = compute_budget(acquired_at, expires_at, now())
        if budget <= 0:
            raise LockExpiringError(
                f"lock {job_id}/{task} was granted too close to its expiry to compute under it"
            )
        bound = asyncio.timeout(budget)
        try:
            async with bound:
                computed = await compute()
        except Exception as exc:
            # The compute failed, or outran the lock's budget and was cancelled by it. Either
            # way a write of it may be on its way: a cancelled `apply_op` is not unsent, and one
            # that gave up (`StillPendingError`) waits in the outbox to be resent
            # (docs/client.md). Releasing now would let a waiter double-check before that write
            # lands and pay for the same call again (then the resend writes the cell a second time).
            # So with anything unanswered on the client the key is handed back only once it landed
            # (`wait_synced` also re-sends an op that gave up); otherwise it lapses at its TTL.
            # A failure with nothing on its way (the provider's) hands the key back at once: the
            # next racer retries, once.
            outrun = isinstance(exc, TimeoutError) and bound.expired()
            if outrun or client.pending_count() > 0:
                release = False  # and so it stays if we are cancelled while waiting
                release = await _writes_landed(client, expires_at - now())
            if not outrun:
                # The compute's own failure (a provider read timing out, a write refused): not
                # the lock's — reported as it is, so nobody chases an outrun lock that was not.
                raise
            raise LockExpiringError(
                f"compute of {job_id}/{task} outran its lock budget ({budget:.1f} s); "
                "cancelled before the lock could lapse"
            ) from None
        except asyncio.CancelledError:
            # Cancelled from outside: the stage's heartbeat was answered `lease_lost`, or the
            # drain deadline passed. Mid-call (nothing sent) the key goes back at once, so a
            # waiter takes over now. But mid-write the op is already on its way (a cancelled
            # `apply_op` is not unsent, docs/client.md): released now, the worker that re-drove
            # the request took the key, double-checked before that write landed and paid for
            # the same call again. So with anything unanswered on the client the key is kept;
            # it lapses at its TTL, by when the write is in and the next check finds it. (The
            # pending ops may be another stage's: then the cost is a wait, never a double pay.)
            if client.pending_count() > 0:
                release = False
                log.warning(
                    "compute of %s/%s cancelled with writes unanswered; its lock lapses at "
                    "its TTL instead of being released",
                    job_id,
                    task,
                )
            raise
        return ComputeResult("computed", computed)
    finally:
        # 5. Release — only the lock our acquisition took: the token fences out a lapsed lock
        #    that someone else has taken over since.
        if release and lock.token is not None:
            await _release_quietly(client, workspace_id, job_id, task, lock.token)


async def _writes_landed(client: WorkspaceClient, seconds: float) -> bool:
    """Whether every op the client sent was answered within `seconds` (none pending)."""
    if seconds <= 0:
        return False
    try:
        await client.wait_synced(timeout=seconds)
    except TimeoutError:
        return False
    return True


async def _release_quietly(
    client: WorkspaceClient, workspace_id: str, job_id: str, task: str, token: str
) -> None:
    # A failed release must not hide the compute's own outcome: the lock then lapses at its TTL.
    try:
        released = await release_lock(client, workspace_id, job_id, task, token)
    except WorkspaceError as exc:
        log.warning("release of lock %s/%s failed (%s); it lapses at its TTL", job_id, task, exc)
        return
    if not released:
        log.warning("lock %s/%s had lapsed before its release", job_id, task)


class _Follower:
    """Committed ops of one sub-doc from its head clock on, reduced to "something changed"."""

    def __init__(self, client: WorkspaceClient, workspace_id: str, sub_doc: str) -> None:
        self._client = client
        self._workspace_id = workspace_id
        self._sub_doc = sub_doc
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Follower:
        try:
            head, _ = await self._client.read_ops(
                self._workspace_id, self._sub_doc, since=0, limit=1
            )
        except LogCompactedError as exc:  # the 410 names the head too
            if exc.clock is None:
                raise
            head = exc.clock
        subscription = self._client.subscribe(self._workspace_id, self._sub_doc, since=head)

        async def pump() -> None:
            async with subscription:
                async for _ in subscription:
                    self._changed.set()

        self._task = asyncio.create_task(pump())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def changed(self, *, until: float) -> bool:
        """Wait until an op was committed since the last call (True) or the loop time `until`
        (False). Ops committed meanwhile coalesce: one True covers them all."""
        assert self._task is not None
        if not self._changed.is_set():
            remaining = until - asyncio.get_running_loop().time()
            if remaining > 0:
                waiter = asyncio.ensure_future(self._changed.wait())
                watched: set[asyncio.Future[Any]] = {waiter}
                if not self._task.done():
                    watched.add(self._task)
                try:
                    await asyncio.wait(
                        watched, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    waiter.cancel()
                if self._task.done() and not self._task.cancelled():
                    # A subscription that failed (auth, protocol) ends the wait with its error;
                    # one that ended quietly (client closing) leaves the waiting to the timer.
                    error = self._task.exception()
                    if error is not None:
                        raise error
        if self._changed.is_set():
            self._changed.clear()
            return True
        return False
