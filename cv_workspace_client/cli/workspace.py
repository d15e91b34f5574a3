"""`cv-workspace`: submit and inspect stage work from a shell or an agent, with no browser present
(docs/queue.md, docs/mcp.md).

    cv-workspace enqueue --workspace W --stage S [--job-id J] [--input JSON] [--wait]
    cv-workspace requests list|show|wait|replay|discard|rerun|cancel --workspace W ...
    cv-workspace schedules add|list|show|pause|resume|delete|run-now --workspace W ...
    cv-workspace mcp [--transport stdio | --transport http --host H --port P] [--outbox PATH]

Answers are JSON on stdout; an error is one line on stderr (`--json`: a JSON object `{"error":
{"code", "message"}}` instead), and so is every retry of a call, as it happens. SIGINT and
SIGTERM end a wait cleanly: the request goes on, its id is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from cv_mutations.cli_flags import add_argument
from cv_workspace_client._queue.requester import QueueClient
from cv_workspace_client.cli.connection import (
    add_connection_args,
    need_token,
    need_url,
    token_file_provider,
)
from cv_workspace_client.cli.conventions import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    HELP_LAYOUT,
    CommandParser,
    ErrorStyle,
    UsageError,
    announce,
    need_count,
    need_seconds,
    package_version,
    parse_json_arg,
    print_error,
    print_json,
    reader_gone,
)
from cv_workspace_client.cli.progress import Progress, watching
from cv_workspace_client.cli.schedules import add_schedule_commands, run_schedule_command
from cv_workspace_client.errors import ForbiddenError, WorkspaceError
from cv_workspace_client.queue_models import (
    STATUSES,
    EnqueuedRequest,
    QueuedRequest,
    RequestOutcome,
)

__all__ = ["workspace_main"]

#: `cv-workspace mcp --transport http`'s default port: apart from cv-server's 8080 and the port
#: the README gives the fake provider (the plan: docs/configuration.md#ports, pinned by
#: tests/test_docs.py).
MCP_HTTP_PORT = 8765


async def _interruptible(main: Coroutine[Any, Any, int]) -> int:
    """`main`, cancelled by SIGTERM as asyncio.run cancels it on SIGINT: the command then ends
    cleanly (a cancelled wait prints what it must, the session closes) instead of being killed
    outright mid-write. `asyncio.CancelledError` comes out of `asyncio.run`."""
    task = asyncio.current_task()
    assert task is not None
    if threading.current_thread() is not threading.main_thread():
        return await main  # signals reach the main thread only (an embedding app, tests)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await main
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


class _WarningLine(logging.Formatter):
    """A warning (a retry, say) in the commands' style: `cv-workspace: ...`, or `--json`'s
    `{"warning": ...}`."""

    def format(self, record: logging.LogRecord) -> str:
        message = " ".join(record.getMessage().split())
        if ErrorStyle.json:
            return json.dumps({"warning": message})
        return f"{ErrorStyle.prog}: {message}"


def _warnings_to_stderr() -> logging.Handler:
    """`cv-workspace` says every retry on stderr as it happens: a call waiting out a server
    that does not answer is never silent (tests/cli/test_conventions.py). The caller
    removes the handler when the command ends."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_WarningLine())
    handler.setLevel(logging.WARNING)
    logging.getLogger("cv_workspace_client").addHandler(handler)
    return handler


def _add_workspace_arg(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """`--workspace W` on every command that touches a workspace ($CV_WORKSPACE)."""
    add_argument(
        parser,
        "--workspace",
        envvar="CV_WORKSPACE",
        required=required,
        help="the workspace"
        + ("" if required else "; without it, every workspace a `*` token grants"),
    )


def _add_enqueue_args(parser: argparse.ArgumentParser, *, rerun_flag: bool) -> None:
    _add_workspace_arg(parser)
    parser.add_argument("--stage", required=True, help="the stage to run, e.g. evaluate")
    parser.add_argument(
        "--job-id", default=None, help="the job the stage works on (part of the request id)"
    )
    parser.add_argument(
        "--branch-path", default=None, help="the branch of the job (part of the request id)"
    )
    parser.add_argument("--input", default=None, help="the stage's input, as JSON")
    parser.add_argument(
        "--idempotency-key",
        default=None,
        help="the same key sent again returns the first answer, never a second request",
    )
    parser.add_argument(
        "--worker-class", default=None, help="only workers of this class may claim it"
    )
    parser.add_argument(
        "--max-dequeues",
        type=int,
        default=None,
        help="claims before the request is parked as poison (default: the server's)",
    )
    if rerun_flag:
        parser.add_argument("--rerun", action="store_true", help="re-run a finished request")
    parser.add_argument("--wait", action="store_true", help="wait for the result")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="with --wait: seconds to wait; the request goes on after (default 60)",
    )
    _progress_arg(parser)


def _progress_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="status changes and bulk counts on stderr (default: when stderr is a terminal)",
    )


def _progress(args: argparse.Namespace) -> Progress:
    enabled = args.progress
    if enabled is None:
        enabled = sys.stderr.isatty()
    return Progress(bool(enabled))


def _request_args(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    _add_workspace_arg(parser)
    parser.add_argument("request_id", help="the request's id, as enqueue printed it")


def _workspace_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="cv-workspace",
        description="Submit and inspect stage work (docs/queue.md).",
        **HELP_LAYOUT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    enqueue = commands.add_parser("enqueue", help="queue a stage request", **HELP_LAYOUT)
    add_connection_args(enqueue)
    _add_enqueue_args(enqueue, rerun_flag=True)

    requests = commands.add_parser("requests", help="inspect and steer requests", **HELP_LAYOUT)
    verbs = requests.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="requests by status, oldest first", **HELP_LAYOUT)
    add_connection_args(listing)
    listing.add_argument(
        "--status",
        choices=list(STATUSES),
        help="only requests in this status",
    )
    _add_workspace_arg(listing, required=False)
    listing.add_argument(
        "--limit", type=int, default=100, help="requests per page (default 100, at most 1000)"
    )
    listing.add_argument(
        "--all", action="store_true", help="every matching request, fetched --limit at a time"
    )
    _progress_arg(listing)
    for verb, text in (
        ("show", "one request"),
        ("replay", "put a poison request back in the queue, by hand"),
        (
            "discard",
            "delete a poison request for good instead of replaying it (prints the row as it"
            " was); only poison can be",
        ),
        (
            "cancel",
            "cancel a request: a pending one at once, one in progress once its worker stops "
            "(the answer then says cancel_requested); a done or poison one cannot be",
        ),
    ):
        _request_args(verbs.add_parser(verb, help=text, **HELP_LAYOUT))
    wait = verbs.add_parser("wait", help="wait for a request's result", **HELP_LAYOUT)
    _request_args(wait)
    wait.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait; the request goes on after (default 60)",
    )
    _progress_arg(wait)
    rerun = verbs.add_parser(
        "rerun", help="run a finished request again (enqueue --rerun)", **HELP_LAYOUT
    )
    add_connection_args(rerun)
    _add_enqueue_args(rerun, rerun_flag=False)

    add_schedule_commands(commands, _add_workspace_arg)

    mcp = commands.add_parser(
        "mcp",
        help="serve the workspace tools to agents over MCP (needs the `mcp` extra)",
        description="Serve MCP tools (get_state, apply_ops, enqueue, wait_request, ...) and "
        "sub-doc resources over one SDK client: over stdio (how an agent host starts a tool "
        "server) or streamable HTTP (docs/mcp.md).",
        **HELP_LAYOUT,
    )
    add_connection_args(mcp)
    add_argument(
        mcp,
        "--transport",
        envvar="CV_MCP_TRANSPORT",
        choices=["stdio", "http"],
        default="stdio",
        help="stdio (default: the agent host starts this command) or http, streamable HTTP at "
        "http://HOST:PORT/mcp",
    )
    add_argument(
        mcp,
        "--host",
        envvar="CV_MCP_HOST",
        default="127.0.0.1",
        help="with --transport http: the address to bind (default 127.0.0.1: whoever reaches "
        "it acts with this command's token)",
    )
    add_argument(
        mcp,
        "--port",
        envvar="CV_MCP_PORT",
        type=int,
        default=MCP_HTTP_PORT,
        help=f"with --transport http: the port (default {MCP_HTTP_PORT}, beside cv-server's 8080;"
        " 0: a free one)",
    )
    add_argument(
        mcp,
        "--outbox",
        envvar="CV_OUTBOX",
        help="SQLite file for the durable op outbox: ops not yet answered survive a restart of "
        "this command, one per file (default: in memory)",
    )
    return parser


def _outcome_exit(outcome: RequestOutcome) -> int:
    if outcome.timed_out:
        return EXIT_TIMEOUT
    return EXIT_OK if outcome.ok else EXIT_FAILED


async def _enqueue(client: QueueClient, args: argparse.Namespace, *, rerun: bool) -> int:
    if args.wait:
        need_seconds("--timeout", args.timeout)
    need_count("--max-dequeues", args.max_dequeues)
    payload = None if args.input is None else parse_json_arg(args.input)
    answer = await client.enqueue(
        args.workspace,
        stage=args.stage,
        job_id=args.job_id,
        branch_path=args.branch_path,
        input=payload,
        rerun=rerun,
        idempotency_key=args.idempotency_key,
        worker_class=args.worker_class,
        max_dequeues=args.max_dequeues,
    )
    if answer.input_differs:
        _warn_input_differs(answer, rerun=rerun)
    if not args.wait:
        print_json(answer.to_json())
        return EXIT_OK
    try:
        async with watching(
            functools.partial(client.get_request, args.workspace, answer.request_id),
            _progress(args),
        ) as watch:
            watch.enqueued(answer)
            outcome = await client.wait_request(
                args.workspace, answer.request_id, timeout=args.timeout
            )
            watch.seen(outcome.request)
    except asyncio.CancelledError:  # SIGINT/SIGTERM: the wait ends, the request goes on
        interrupted = {"request_id": answer.request_id, "status": "interrupted"}
        print_json({"enqueued": answer.to_json(), **interrupted})
        raise
    print_json({"enqueued": answer.to_json(), **outcome.to_json()})
    return _outcome_exit(outcome)


def _warn_input_differs(answer: EnqueuedRequest, *, rerun: bool) -> None:
    """The enqueue coalesced into a request whose input is not `--input`: say so on stderr, in
    the commands' one style (`--json`: `{"warning": {"code", "message"}}`), and how to run it
    on this input. The answer on stdout stays the answer."""
    if answer.status in ("pending", "in_progress"):
        how = "it is still running: once it finished, enqueue again with --rerun to run yours"
    else:
        how = "enqueue again with --rerun to run it on yours"
    message = (
        f"request {answer.request_id} already exists with another input, which it keeps: "
        f"your --input was not used; {how}"
    )
    if rerun:
        message = (
            f"request {answer.request_id} is still running with another input, which it "
            "keeps: your --input was not used; --rerun again once it finished"
        )
    if ErrorStyle.json:
        line = json.dumps({"warning": {"code": "input_differs", "message": message}})
    else:
        line = f"{ErrorStyle.prog}: warning: {message} (input_differs)"
    print(line, file=sys.stderr, flush=True)


async def _mcp(args: argparse.Namespace) -> int:
    """`cv-workspace mcp`: one `WorkspaceClient` for the process lifetime, its tools served
    until the agent host closes stdin (stdio) or the process is signalled (HTTP). Nothing but
    the protocol goes to stdout on stdio; the HTTP transport prints its URL there."""
    try:
        from cv_workspace_client import mcp_server
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in ("mcp", "mcp_types", "uvicorn"):
            raise
        raise UsageError(
            # This interpreter's pip: it sees the installed cv-workspace, so it needs no index
            # to add the extra (docs/install.md).
            f"cv-workspace mcp needs the mcp extra: {sys.executable} -m pip install"
            " 'cv-workspace[mcp]'"
        ) from None
    from cv_workspace_client.client import WorkspaceClient

    url, token = need_url(args), need_token(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be within 0..65535, not {args.port}")
    refresh = token_file_provider(args.token_file) if args.token_file else None
    async with WorkspaceClient(
        url, token=token, token_provider=refresh, outbox=args.outbox
    ) as client:
        if args.transport == "stdio":
            await mcp_server.serve_stdio(client)
        else:
            try:
                await mcp_server.serve_http(
                    client,
                    args.host,
                    args.port,
                    ready=lambda where: announce(f"cv-workspace mcp listening on {where}"),
                )
            except mcp_server.ListenFailed as exc:  # exit 1, as a port `cv-server` cannot use
                raise WorkspaceError("listen_failed", str(exc)) from None
    return EXIT_OK


async def _list(client: QueueClient, args: argparse.Namespace) -> list[QueuedRequest]:
    if args.all:
        progress = _progress(args)
        rows = []
        async for row in client.iter_requests(
            status=args.status, workspace_id=args.workspace, page=args.limit
        ):
            rows.append(row)
            if len(rows) % args.limit == 0:
                progress.count(f"fetched {len(rows)} requests")
        progress.done(f"fetched {len(rows)} requests")
        return rows
    return await client.list_requests(
        status=args.status, workspace_id=args.workspace, limit=args.limit
    )


async def _workspace(args: argparse.Namespace) -> int:
    if args.command == "mcp":
        return await _mcp(args)
    url, token = need_url(args), need_token(args)
    if getattr(args, "verb", None) == "list" and args.command == "requests":
        need_count("--limit", args.limit)
    async with QueueClient(url, token) as client:
        if args.command == "enqueue":
            return await _enqueue(client, args, rerun=args.rerun)
        if args.command == "schedules":
            return await run_schedule_command(client, args)
        if args.verb == "rerun":
            return await _enqueue(client, args, rerun=True)
        if args.verb == "list":
            try:
                rows = await _list(client, args)
            except ForbiddenError:
                if args.workspace is not None:
                    raise
                raise UsageError(
                    "cv-workspace requests list: --workspace W (or $CV_WORKSPACE) is required:"
                    " the token does not grant every workspace"
                ) from None
            print_json({"requests": [row.raw for row in rows]})
        elif args.verb == "show":
            print_json((await client.get_request(args.workspace, args.request_id)).raw)
        elif args.verb == "replay":
            print_json((await client.replay_request(args.workspace, args.request_id)).raw)
        elif args.verb == "discard":
            print_json((await client.discard_request(args.workspace, args.request_id)).raw)
        elif args.verb == "cancel":
            print_json((await client.cancel_request(args.workspace, args.request_id)).raw)
        elif args.verb == "wait":
            need_seconds("--timeout", args.timeout)
            async with watching(
                functools.partial(client.get_request, args.workspace, args.request_id),
                _progress(args),
            ) as watch:
                outcome = await client.wait_request(
                    args.workspace, args.request_id, timeout=args.timeout
                )
                watch.seen(outcome.request)
            print_json(outcome.to_json())
            return _outcome_exit(outcome)
        return EXIT_OK


def workspace_main(argv: list[str] | None = None) -> int:
    """`cv-workspace`: see the module docstring."""
    ErrorStyle.set("cv-workspace", argv)
    warnings = _warnings_to_stderr()
    try:
        args = _workspace_parser().parse_args(argv)
        return asyncio.run(_interruptible(_workspace(args)))
    except UsageError as exc:
        print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        print_error(exc)
        return EXIT_FAILED
    except BrokenPipeError:
        return reader_gone()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:  # by SIGTERM (`_interruptible`)
        return EXIT_TERMINATED
    finally:
        logging.getLogger("cv_workspace_client").removeHandler(warnings)
