"""The values the schedule verbs answer with (docs/queue.md, "Schedules"). Pure data: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from cv_workspace_client.errors import ProtocolError

__all__ = ["MissedPolicy", "OverlapPolicy", "Schedule"]

#: Due times missed while no scheduler ran: enqueue none, the latest, or all (up to a bound).
MissedPolicy = Literal["skip", "one", "all"]
#: While the last firing's request is still live: enqueue nothing, or enqueue anyway.
OverlapPolicy = Literal["skip", "queue"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One schedule as the server shows it. `next_fire_at` is its next due time (None while
    paused); `last_fired_at` / `last_request_id` its latest firing and the request it enqueued;
    `skipped` the due times it enqueued nothing for. Times are epoch seconds, UTC. `raw` keeps
    the JSON as received."""

    schedule_id: str
    workspace_id: str
    name: str
    enqueue: dict[str, Any]
    cron: str | None = None
    interval_seconds: int | None = None
    missed: MissedPolicy = "one"
    overlap: OverlapPolicy = "skip"
    paused: bool = False
    enqueue_grant: dict[str, Any] | None = None
    created_at: float | None = None
    next_fire_at: float | None = None
    last_fired_at: float | None = None
    last_request_id: str | None = None
    skipped: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Schedule:
        if not isinstance(data, dict):
            raise ProtocolError("bad_answer", "a schedule must be a JSON object")
        try:
            return cls(
                schedule_id=str(data["schedule_id"]),
                workspace_id=str(data["workspace_id"]),
                name=str(data["name"]),
                enqueue=dict(data["enqueue"]),
                cron=data.get("cron"),
                interval_seconds=data.get("interval_seconds"),
                missed=data.get("missed", "one"),
                overlap=data.get("overlap", "skip"),
                paused=bool(data.get("paused", False)),
                enqueue_grant=data.get("enqueue_grant"),
                created_at=data.get("created_at"),
                next_fire_at=data.get("next_fire_at"),
                last_fired_at=data.get("last_fired_at"),
                last_request_id=data.get("last_request_id"),
                skipped=int(data.get("skipped", 0)),
                raw=data,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError("bad_answer", f"schedule: {exc!r}") from None

    def to_json(self) -> dict[str, Any]:
        """The schedule as the server sent it (what the CLI and the MCP tools print)."""
        return (
            dict(self.raw)
            if self.raw
            else {
                "schedule_id": self.schedule_id,
                "workspace_id": self.workspace_id,
                "name": self.name,
                "cron": self.cron,
                "interval_seconds": self.interval_seconds,
                "enqueue": self.enqueue,
                "missed": self.missed,
                "overlap": self.overlap,
                "paused": self.paused,
                "enqueue_grant": self.enqueue_grant,
                "created_at": self.created_at,
                "next_fire_at": self.next_fire_at,
                "last_fired_at": self.last_fired_at,
                "last_request_id": self.last_request_id,
                "skipped": self.skipped,
            }
        )
