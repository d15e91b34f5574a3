"""`cv-workspace schedules`: a workspace's schedules from a shell (docs/queue.md, "Schedules").

    cv-workspace schedules add NAME --workspace W (--cron "0 3 * * *" | --every SECONDS)
        --stage S [--input JSON] [--missed skip|one|all] [--overlap skip|queue] [--paused]
    cv-workspace schedules list|show|pause|resume|delete|run-now --workspace W [NAME]

Answers are JSON on stdout, as the rest of `cv-workspace`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cv_workspace_client._queue.requester import QueueClient
from cv_workspace_client.cli.connection import add_connection_args
from cv_workspace_client.cli.conventions import (
    EXIT_OK,
    HELP_LAYOUT,
    UsageError,
    need_count,
    parse_json_arg,
    print_json,
)

__all__ = ["add_schedule_commands", "run_schedule_command"]

_VERBS = {
    "show": "one schedule: its next due time, its last firing and the request it enqueued",
    "pause": "stop a schedule firing until resumed",
    "resume": "fire again from the next due time after now (nothing from the pause is caught up)",
    "delete": "delete a schedule (the requests it enqueued stay)",
    "run-now": "enqueue a firing now, out of turn (its next due time unchanged)",
}


def add_schedule_commands(
    commands: argparse._SubParsersAction[Any],
    add_workspace_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add `schedules add|list|show|pause|resume|delete|run-now` to `commands` (the
    `cv-workspace` subparsers); `add_workspace_arg(parser)` adds its `--workspace`."""
    schedules = commands.add_parser(
        "schedules", help="time-driven enqueues: add and steer schedules", **HELP_LAYOUT
    )
    verbs = schedules.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser(
        "add",
        help="add a schedule that enqueues a stage at each due time (UTC)",
        **HELP_LAYOUT,
    )
    add_connection_args(add)
    add_workspace_arg(add)
    add.add_argument("name", help="the schedule's name, unique in the workspace ([A-Za-z0-9_.-])")
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='five UTC fields, minute hour day month weekday: "0 3 * * *"')
    when.add_argument("--every", type=int, help="an interval in whole seconds")
    add.add_argument("--stage", required=True, help="the stage each firing enqueues")
    add.add_argument("--input", default=None, help="the stage's input, as JSON")
    add.add_argument("--job-id", default=None, help="the job of each firing's request")
    add.add_argument("--branch-path", default=None, help="the branch of each firing's request")
    add.add_argument("--worker-class", default=None, help="only workers of this class may claim")
    add.add_argument(
        "--max-dequeues", type=int, default=None, help="claims before poison (default: server's)"
    )
    add.add_argument(
        "--missed",
        choices=["skip", "one", "all"],
        default="one",
        help="due times missed while no scheduler ran: none, the latest (default), or all",
    )
    add.add_argument(
        "--overlap",
        choices=["skip", "queue"],
        default="skip",
        help="while the last firing's request is live: enqueue nothing (default) or enqueue",
    )
    add.add_argument("--paused", action="store_true", help="add it paused")
    listing = verbs.add_parser("list", help="the workspace's schedules by name", **HELP_LAYOUT)
    add_connection_args(listing)
    add_workspace_arg(listing)
    listing.add_argument("--limit", type=int, default=100, help="schedules per page (default 100)")
    for verb, text in _VERBS.items():
        parser = verbs.add_parser(verb, help=text, **HELP_LAYOUT)
        add_connection_args(parser)
        add_workspace_arg(parser)
        parser.add_argument("name", help="the schedule's name")


async def run_schedule_command(client: QueueClient, args: argparse.Namespace) -> int:
    """Run the `schedules` verb `args` name and print its answer."""
    ws = args.workspace
    if args.verb == "add":
        if args.every is not None and args.every < 1:
            raise UsageError(f"--every must be >= 1, not {args.every}")
        need_count("--max-dequeues", args.max_dequeues)
        added = await client.add_schedule(
            ws,
            args.name,
            stage=args.stage,
            cron=args.cron,
            every_seconds=args.every,
            input=None if args.input is None else parse_json_arg(args.input),
            job_id=args.job_id,
            branch_path=args.branch_path,
            worker_class=args.worker_class,
            max_dequeues=args.max_dequeues,
            missed=args.missed,
            overlap=args.overlap,
            paused=args.paused,
        )
        print_json(added.to_json())
    elif args.verb == "list":
        need_count("--limit", args.limit)
        rows = [s.to_json() async for s in client.iter_schedules(ws, page=args.limit)]
        print_json({"schedules": rows})
    elif args.verb == "show":
        print_json((await client.get_schedule(ws, args.name)).to_json())
    elif args.verb == "pause":
        print_json((await client.pause_schedule(ws, args.name)).to_json())
    elif args.verb == "resume":
        print_json((await client.resume_schedule(ws, args.name)).to_json())
    elif args.verb == "delete":
        await client.delete_schedule(ws, args.name)
        print_json({"deleted": args.name})
    elif args.verb == "run-now":
        print_json((await client.run_schedule(ws, args.name)).to_json())
    return EXIT_OK
