"""The schedule verbs (docs/queue.md, "Schedules"): add, list, read, pause, resume, delete and
run a workspace's schedules — and `ScheduleMethods`, which `QueueMethods` (so `WorkspaceClient`
and `QueueClient`) mixes in.

Retries follow what a repeat would do: reads, pause, resume and delete are safe to repeat (a
repeat after a lost answer changes nothing more; a delete's repeat answers `NotFoundError`,
which then means the first attempt deleted it, so it is not retried); `add` is not retried (its
repeat answers `schedule_exists`); `run` is not retried either (each run enqueues a request).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

from cv_workspace_client._queue.transport import QueueHost, call, retried, ws_path
from cv_workspace_client.queue_models import EnqueuedRequest
from cv_workspace_client.schedule_models import MissedPolicy, OverlapPolicy, Schedule

__all__ = [
    "ScheduleMethods",
    "add_schedule",
    "delete_schedule",
    "get_schedule",
    "list_schedules_page",
    "run_schedule",
    "set_schedule_paused",
]


async def add_schedule(host: QueueHost, workspace_id: str, body: Mapping[str, Any]) -> Schedule:
    """`POST /v1/workspaces/{ws}/schedules`. Raises `InvalidRequestError` (`schedule_exists`,
    `invalid_field`). Not retried: a repeat after a lost answer would find its own schedule."""
    _, answer, _ = await call(host, "POST", ws_path(workspace_id, "schedules"), body=dict(body))
    return Schedule.from_json(answer)


async def list_schedules_page(
    host: QueueHost, workspace_id: str, *, limit: int = 100, after: str | None = None
) -> tuple[list[Schedule], str | None]:
    """One page of the workspace's schedules by name, and the `after` of the next page (None:
    the last page)."""
    params = [("limit", str(limit))] + ([("after", after)] if after is not None else [])
    answer = await retried(host, "GET", ws_path(workspace_id, "schedules"), params=params)
    rows = [Schedule.from_json(row) for row in answer["schedules"]]
    return rows, answer.get("next_after")


async def get_schedule(host: QueueHost, workspace_id: str, name: str) -> Schedule:
    """`GET .../schedules/{name}`; `NotFoundError` (`schedule_not_found`) if there is none."""
    answer = await retried(host, "GET", ws_path(workspace_id, "schedules", name))
    return Schedule.from_json(answer)


async def set_schedule_paused(
    host: QueueHost, workspace_id: str, name: str, paused: bool
) -> Schedule:
    """`POST .../schedules/{name}/pause` or `/resume` (retried: a repeat changes nothing)."""
    verb = "pause" if paused else "resume"
    answer = await retried(host, "POST", ws_path(workspace_id, "schedules", name, verb), body={})
    return Schedule.from_json(answer)


async def delete_schedule(host: QueueHost, workspace_id: str, name: str) -> None:
    """`DELETE .../schedules/{name}`; `NotFoundError` if there is none."""
    await call(host, "DELETE", ws_path(workspace_id, "schedules", name))


async def run_schedule(host: QueueHost, workspace_id: str, name: str) -> EnqueuedRequest:
    """`POST .../schedules/{name}/run`: enqueue a firing now. Raises `ForbiddenError`
    (`grant_exceeded`) for a token whose grant does not cover the schedule's."""
    path = ws_path(workspace_id, "schedules", name, "run")
    _, answer, _ = await call(host, "POST", path, body={})
    return EnqueuedRequest(
        request_id=str(answer["request_id"]),
        status=answer["status"],
        coalesced=bool(answer["coalesced"]),
        stream_url=str(answer["stream_url"]),
    )


class ScheduleMethods:
    """The schedule verbs of a queue client (a `QueueHost`)."""

    def _host(self) -> QueueHost:
        return cast(QueueHost, self)

    async def add_schedule(
        self,
        workspace_id: str,
        name: str,
        *,
        stage: str,
        cron: str | None = None,
        every_seconds: int | None = None,
        input: Any = None,
        job_id: str | None = None,
        branch_path: str | None = None,
        worker_class: str | None = None,
        max_dequeues: int | None = None,
        missed: MissedPolicy = "one",
        overlap: OverlapPolicy = "skip",
        paused: bool = False,
    ) -> Schedule:
        """Add a schedule that enqueues `stage` (with these enqueue arguments) at each due time:
        exactly one of `cron` (five UTC fields) and `every_seconds`. Each firing's request runs
        under this client's token's grant. Raises `InvalidRequestError` (`schedule_exists`,
        `invalid_field`)."""
        enqueue: dict[str, Any] = {"stage": stage}
        for key, value in (
            ("input", input),
            ("job_id", job_id),
            ("branch_path", branch_path),
            ("worker_class", worker_class),
            ("max_dequeues", max_dequeues),
        ):
            if value is not None:
                enqueue[key] = value
        body: dict[str, Any] = {
            "name": name,
            "enqueue": enqueue,
            "missed": missed,
            "overlap": overlap,
            "paused": paused,
        }
        if cron is not None:
            body["cron"] = cron
        if every_seconds is not None:
            body["interval_seconds"] = every_seconds
        return await add_schedule(self._host(), workspace_id, body)

    async def list_schedules(self, workspace_id: str, *, limit: int = 100) -> list[Schedule]:
        """The workspace's first `limit` schedules by name (`iter_schedules` for all)."""
        rows, _ = await list_schedules_page(self._host(), workspace_id, limit=limit)
        return rows

    async def iter_schedules(
        self, workspace_id: str, *, page: int = 100
    ) -> AsyncGenerator[Schedule, None]:
        """Every schedule of the workspace by name, fetched `page` at a time."""
        after: str | None = None
        while True:
            rows, after = await list_schedules_page(
                self._host(), workspace_id, limit=page, after=after
            )
            for row in rows:
                yield row
            if after is None or not rows:
                return

    async def get_schedule(self, workspace_id: str, name: str) -> Schedule:
        """The schedule as it stands (next and last firing). Raises `NotFoundError`."""
        return await get_schedule(self._host(), workspace_id, name)

    async def pause_schedule(self, workspace_id: str, name: str) -> Schedule:
        """Stop the schedule firing until `resume_schedule`. Raises `NotFoundError`."""
        return await set_schedule_paused(self._host(), workspace_id, name, True)

    async def resume_schedule(self, workspace_id: str, name: str) -> Schedule:
        """Fire again from its next due time after now (nothing from the pause is caught up).
        Raises `NotFoundError`."""
        return await set_schedule_paused(self._host(), workspace_id, name, False)

    async def delete_schedule(self, workspace_id: str, name: str) -> None:
        """Delete the schedule (the requests it enqueued stay). Raises `NotFoundError`."""
        await delete_schedule(self._host(), workspace_id, name)

    async def run_schedule(self, workspace_id: str, name: str) -> EnqueuedRequest:
        """Enqueue a firing of the schedule now, out of turn. Raises `NotFoundError`, or
        `ForbiddenError` (`grant_exceeded`) if this token's grant does not cover the
        schedule's."""
        return await run_schedule(self._host(), workspace_id, name)
