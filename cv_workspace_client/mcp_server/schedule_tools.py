"""The schedule tools of the MCP server (docs/mcp.md; docs/queue.md, "Schedules"): add, list,
pause, resume, delete and run a workspace's schedules. Each raises `WorkspaceError` on a
failure, which the server turns into a tool error with the server's problem code."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field, JsonValue

from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.mcp_server.answers import EnqueueAnswer

__all__ = [
    "SCHEDULE_ANNOTATIONS",
    "SCHEDULE_TOOL_NAMES",
    "ScheduleAnswer",
    "ScheduleListAnswer",
    "ScheduleTools",
]

#: The schedule tools, by name: part of the contract (docs/mcp.md).
SCHEDULE_TOOL_NAMES: Final = (
    "add_schedule",
    "list_schedules",
    "pause_schedule",
    "resume_schedule",
    "delete_schedule",
    "run_schedule",
)

_CHANGES = ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False)
#: `pause_schedule` and `resume_schedule` are idempotent (repeated, they change nothing more);
#: `add_schedule` answers `schedule_exists` when repeated and `run_schedule` enqueues each time.
SCHEDULE_ANNOTATIONS: Final[dict[str, ToolAnnotations]] = {
    "add_schedule": ToolAnnotations(destructive_hint=False, open_world_hint=False),
    "list_schedules": ToolAnnotations(read_only_hint=True, open_world_hint=False),
    "pause_schedule": _CHANGES,
    "resume_schedule": _CHANGES,
    "delete_schedule": ToolAnnotations(
        destructive_hint=True, idempotent_hint=False, open_world_hint=False
    ),
    "run_schedule": ToolAnnotations(destructive_hint=False, open_world_hint=False),
}

WorkspaceId = Annotated[str, Field(description="the workspace's id")]
Name = Annotated[str, Field(description="the schedule's name, unique in the workspace")]


class ScheduleAnswer(BaseModel):
    """A schedule as the server shows it: `next_fire_at` (null while paused), `last_fired_at`
    and `last_request_id` (its latest firing), `skipped`; times are epoch seconds, UTC."""

    schedule: dict[str, JsonValue]


class ScheduleListAnswer(BaseModel):
    """`list_schedules`: the workspace's schedules by name."""

    schedules: list[dict[str, JsonValue]] = Field(default_factory=list)


class ScheduleTools:
    """The schedule tools' bodies, over `client`."""

    client: WorkspaceClient

    async def add_schedule(
        self,
        workspace_id: WorkspaceId,
        name: Name,
        stage: Annotated[str, Field(description="the stage each firing enqueues")],
        cron: Annotated[
            str | None, Field(description="five UTC fields: minute hour day month weekday")
        ] = None,
        every_seconds: Annotated[
            int | None, Field(ge=1, description="an interval in whole seconds")
        ] = None,
        input: Annotated[Any, Field(description="the stage's input (any JSON)")] = None,
        job_id: str | None = None,
        missed: Annotated[
            Literal["skip", "one", "all"],
            Field(description="due times missed while no scheduler ran: none, latest, all"),
        ] = "one",
        overlap: Annotated[
            Literal["skip", "queue"],
            Field(description="while the last firing's request is live: skip or enqueue"),
        ] = "skip",
    ) -> ScheduleAnswer:
        """Add a schedule that enqueues `stage` at each due time (exactly one of `cron` and
        `every_seconds`). Its firings run under this server's token's grant. A name the
        workspace already has answers `schedule_exists`."""
        added = await self.client.add_schedule(
            workspace_id,
            name,
            stage=stage,
            cron=cron,
            every_seconds=every_seconds,
            input=input,
            job_id=job_id,
            missed=missed,
            overlap=overlap,
        )
        return ScheduleAnswer(schedule=added.to_json())

    async def list_schedules(self, workspace_id: WorkspaceId) -> ScheduleListAnswer:
        """The workspace's schedules by name, with their next and last firing."""
        rows = [s.to_json() async for s in self.client.iter_schedules(workspace_id)]
        return ScheduleListAnswer(schedules=rows)

    async def pause_schedule(self, workspace_id: WorkspaceId, name: Name) -> ScheduleAnswer:
        """Stop a schedule firing until `resume_schedule`."""
        return ScheduleAnswer(
            schedule=(await self.client.pause_schedule(workspace_id, name)).to_json()
        )

    async def resume_schedule(self, workspace_id: WorkspaceId, name: Name) -> ScheduleAnswer:
        """Fire a paused schedule again, from its next due time after now (nothing from the
        pause is caught up)."""
        return ScheduleAnswer(
            schedule=(await self.client.resume_schedule(workspace_id, name)).to_json()
        )

    async def delete_schedule(self, workspace_id: WorkspaceId, name: Name) -> ScheduleAnswer:
        """Delete a schedule; answers it as it was. The requests it enqueued stay."""
        found = await self.client.get_schedule(workspace_id, name)
        await self.client.delete_schedule(workspace_id, name)
        return ScheduleAnswer(schedule=found.to_json())

    async def run_schedule(self, workspace_id: WorkspaceId, name: Name) -> EnqueueAnswer:
        """Enqueue a firing of the schedule now, out of turn; answers the request (wait for it
        with `wait_request`). A schedule added under a wider grant answers `grant_exceeded`."""
        ran = await self.client.run_schedule(workspace_id, name)
        return EnqueueAnswer(
            request_id=ran.request_id,
            status=ran.status,
            coalesced=ran.coalesced,
            input_differs=False,
            replayed=False,
        )
