"""A compute lock's key under a grant (docs/stages.md): `task@<grant key>` for a limited grant,
the plain task for the full one; never longer than the lock routes take (256 characters), the
same for the same task and grant, different for two grants. Against the real server on loopback."""

from __future__ import annotations

from pydantic import JsonValue

from cv_workspace_client.compute import MAX_LOCK_TASK, ComputeResult, compute_once, lock_task

from .conftest import OpenClient
from .helpers import JOB, WS

GRANT_A = "a" * 16
GRANT_B = "b" * 16


async def nothing_yet() -> JsonValue | None:
    return None


def test_a_limited_grant_suffixes_the_task_and_the_full_grant_keeps_it() -> None:
    assert lock_task("eval:fit", None) == "eval:fit"
    assert lock_task("eval:fit", GRANT_A) == f"eval:fit@{GRANT_A}"


def test_a_task_too_long_for_its_suffix_is_cut_to_the_limit_with_a_digest_of_the_whole() -> None:
    for length in (MAX_LOCK_TASK - 17, MAX_LOCK_TASK - 16, MAX_LOCK_TASK, 5000):
        task = "t" * length
        key = lock_task(task, GRANT_A)
        assert len(key) <= MAX_LOCK_TASK, length
        assert key.endswith(f"@{GRANT_A}")
        assert key == lock_task(task, GRANT_A)  # deterministic
    assert len(lock_task("t" * (MAX_LOCK_TASK - 17), GRANT_A)) == MAX_LOCK_TASK
    # Two long tasks with one head are two locks: the digest is of the whole task.
    head = "h" * MAX_LOCK_TASK
    assert lock_task(head + "1", GRANT_A) != lock_task(head + "2", GRANT_A)


def test_two_grants_get_two_keys_and_one_grant_the_same_key() -> None:
    for task in ("eval:fit", "x" * 1000):
        assert lock_task(task, GRANT_A) != lock_task(task, GRANT_B)
        assert lock_task(task, GRANT_A) != lock_task(task, None)
        assert lock_task(task, GRANT_A) == lock_task(task, GRANT_A)


async def test_a_task_of_the_full_length_locks_per_grant_on_the_server(
    server_url: str, open_client: OpenClient
) -> None:
    client = await open_client(server_url)
    task = "eval:" + "x" * (MAX_LOCK_TASK - 5)  # as long as a full grant's task may be
    seen: dict[str, ComputeResult[JsonValue]] = {}

    async def under_a() -> JsonValue:
        # While grant A holds the lock: A again finds it held, B takes a lock of its own.
        seen["a"] = await compute_once(
            client,
            WS,
            JOB,
            task,
            check=nothing_yet,
            compute=lambda: done("a2"),
            holder="w2",
            scope_key=GRANT_A,
        )
        seen["b"] = await compute_once(
            client,
            WS,
            JOB,
            task,
            check=nothing_yet,
            compute=lambda: done("b"),
            holder="w3",
            scope_key=GRANT_B,
        )
        return "a"

    async def done(value: str) -> JsonValue:
        return value

    first = await compute_once(
        client, WS, JOB, task, check=nothing_yet, compute=under_a, holder="w1", scope_key=GRANT_A
    )
    assert first == ComputeResult("computed", "a")
    assert seen["a"] == ComputeResult("locked")
    assert seen["b"] == ComputeResult("computed", "b")
