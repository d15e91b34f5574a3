"""Two commands (DESIGN §12): `cv-worker` runs stage handlers; `cv-workspace` submits and inspects
work from a shell or an agent, with no browser present.

    cv-worker --url URL --token TOKEN --stages pkg.module:STAGES [--concurrency N]
              [--worker-class C] [--provider fake | --provider openai --provider-url U --model M]
              [--outbox PATH]
    cv-workspace enqueue --workspace W --stage S [--job-id J] [--input JSON] [--wait]
    cv-workspace requests list|show|wait|replay|rerun ...

`--url` / `--token` default to the environment's `CV_URL` / `CV_TOKEN`. Answers are JSON on
stdout; errors are JSON on stderr. Exit codes: 0 success; 1 refused by the server, or a waited
request ended with an error payload or in poison; 2 bad usage; 3 the wait timed out (the request
goes on — its id is in the answer).

Also runnable as `python -m cv_workspace_client.cli worker|workspace ARGS`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cv_workspace_client._queue_api import QueueClient
from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.providers import CountingFakeProvider, OpenAICompatibleProvider, Provider
from cv_workspace_client.queue_models import RequestOutcome
from cv_workspace_client.stage import Handler, Stage
from cv_workspace_client.worker import Worker, WorkerConfig

__all__ = ["load_stages", "worker_main", "workspace_main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3

#: Environment variable holding the provider's API key (never a command-line argument: it would
#: show in `ps`).
PROVIDER_KEY_ENV = "CV_PROVIDER_API_KEY"


class UsageError(Exception):
    pass


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("CV_URL"), help="server URL ($CV_URL)")
    parser.add_argument("--token", default=os.environ.get("CV_TOKEN"), help="token ($CV_TOKEN)")


def _need_url(args: argparse.Namespace) -> str:
    if not args.url:
        raise UsageError("--url (or $CV_URL) is required")
    # A URL that is not http(s) with a host fails every call before a byte is sent, as a
    # connection error: `cv-worker` retried such claims forever (exit only by signal) instead
    # of naming the bad argument.
    try:
        parts = urlsplit(str(args.url))
        host = parts.hostname
    except ValueError:  # an unbalanced IPv6 bracket, say
        host = None
    if not host or parts.scheme not in ("http", "https"):
        raise UsageError(f"--url must be an http:// or https:// URL with a host, not {args.url!r}")
    return str(args.url)


def _need_seconds(name: str, value: float, *, positive: bool = False) -> None:
    """A duration argument must be a finite number of seconds: `inf` overflows aiohttp's timers
    (a traceback), `nan` and negative values silently act as zero (the drain cancels at once, a
    wait ends before it began) — all usage errors, refused before anything is sent."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise UsageError(f"{name} must be a finite number of seconds {bound}, not {value!r}")


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False), flush=True)


def _print_error(exc: BaseException) -> None:
    code = exc.code if isinstance(exc, WorkspaceError) else "usage"
    message = exc.message if isinstance(exc, WorkspaceError) else str(exc)
    print(json.dumps({"error": {"code": code, "message": message}}), file=sys.stderr, flush=True)


# -- cv-worker -------------------------------------------------------------------------------------


def load_stages(spec: str) -> dict[str, Handler | Stage]:
    """Import `pkg.module:NAME`, a dict of stage name → handler or `Stage`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--stages must look like pkg.module:NAME, not {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    stages = getattr(module, attr, None)
    if not isinstance(stages, Mapping) or not stages:
        raise UsageError(f"{spec} must be a non-empty dict of stage name -> handler or Stage")
    for name, stage in stages.items():
        if not isinstance(name, str) or not (isinstance(stage, Stage) or callable(stage)):
            raise UsageError(f"{spec}[{name!r}] must be a handler or a Stage")
    return dict(stages)


def _worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cv-worker", description="Run stage handlers.")
    _common(parser)
    parser.add_argument("--stages", required=True, help="pkg.module:STAGES (a dict)")
    parser.add_argument("--worker-class", default=None, help="claim this class for every stage")
    parser.add_argument("--worker-id", default=None, help="shown as claimed_by on its rows")
    parser.add_argument("--concurrency", type=int, default=1, help="stages run at once")
    parser.add_argument("--provider", choices=["openai", "fake"], default=None)
    parser.add_argument("--provider-url", default=None, help="OpenAI-compatible base URL")
    parser.add_argument("--model", default=None)
    parser.add_argument("--outbox", default=None, help="SQLite file for the durable op outbox")
    defaults = WorkerConfig()
    parser.add_argument("--heartbeat-seconds", type=float, default=defaults.heartbeat_seconds)
    parser.add_argument("--drain-seconds", type=float, default=defaults.drain_seconds)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _provider(args: argparse.Namespace) -> Provider | None:
    if args.provider is None:
        return None
    if args.provider == "fake":
        return CountingFakeProvider()
    if not args.provider_url or not args.model:
        raise UsageError("--provider openai needs --provider-url and --model")
    return OpenAICompatibleProvider(
        args.provider_url, os.environ.get(PROVIDER_KEY_ENV), model=args.model
    )


async def _run_worker(args: argparse.Namespace, stages: dict[str, Handler | Stage]) -> int:
    from cv_workspace_client.client import WorkspaceClient  # the full SDK: outbox, websockets

    config = WorkerConfig(
        concurrency=args.concurrency,
        heartbeat_seconds=args.heartbeat_seconds,
        drain_seconds=args.drain_seconds,
    )
    provider = _provider(args)
    try:
        async with WorkspaceClient(_need_url(args), token=args.token, outbox=args.outbox) as client:
            worker = Worker(
                client,
                stages,
                args.worker_class,
                worker_id=args.worker_id,
                provider=provider,
                config=config,
            )
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.stop)  # seed 004 §9: drain, then exit 0
            print(f"cv-worker {worker.worker_id} ready", flush=True)
            stats = await worker.run()
            logging.getLogger("cv_workspace_client.worker").info("drained: %s", stats)
            return EXIT_OK if stats.clean else EXIT_FAILED
    finally:
        if isinstance(provider, OpenAICompatibleProvider):
            await provider.aclose()


def worker_main(argv: list[str] | None = None) -> int:
    """`cv-worker`: run until SIGTERM/SIGINT, drain, exit 0 (1 if the drain deadline cancelled
    stages, or the server refused the token)."""
    args = _worker_parser().parse_args(argv)
    try:
        # Validated here, not left to `logging`/`WorkerConfig`: their ValueError would escape
        # as a traceback with exit 1 instead of a usage error (exit 2).
        try:
            logging.basicConfig(
                level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
            )
        except ValueError:
            raise UsageError(f"--log-level {args.log_level!r} is not a logging level") from None
        if args.concurrency < 1:
            raise UsageError("--concurrency must be >= 1")
        _need_seconds("--heartbeat-seconds", args.heartbeat_seconds, positive=True)
        _need_seconds("--drain-seconds", args.drain_seconds)
        stages = load_stages(args.stages)
        return asyncio.run(_run_worker(args, stages))
    except UsageError as exc:
        _print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        _print_error(exc)
        return EXIT_FAILED


# -- cv-workspace ----------------------------------------------------------------------------------


def _add_enqueue_args(parser: argparse.ArgumentParser, *, rerun_flag: bool) -> None:
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--branch-path", default=None)
    parser.add_argument("--input", default=None, help="JSON")
    parser.add_argument("--idempotency-key", default=None)
    parser.add_argument("--worker-class", default=None)
    parser.add_argument("--max-dequeues", type=int, default=None)
    if rerun_flag:
        parser.add_argument("--rerun", action="store_true", help="re-run a finished request")
    parser.add_argument("--wait", action="store_true", help="wait for the result")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait")


def _workspace_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cv-workspace", description="Submit and inspect work.")
    commands = parser.add_subparsers(dest="command", required=True)
    enqueue = commands.add_parser("enqueue", help="queue a stage request")
    _common(enqueue)
    _add_enqueue_args(enqueue, rerun_flag=True)

    requests = commands.add_parser("requests", help="inspect and steer requests")
    verbs = requests.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="requests by status, oldest first")
    _common(listing)
    listing.add_argument("--status", choices=["pending", "in_progress", "done", "poison"])
    listing.add_argument("--workspace", default=None)
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument(
        "--all", action="store_true", help="every matching request, fetched --limit at a time"
    )
    for verb, text in (
        ("show", "one request"),
        ("replay", "put a poison request back in the queue, by hand"),
    ):
        sub = verbs.add_parser(verb, help=text)
        _common(sub)
        sub.add_argument("workspace")
        sub.add_argument("request_id")
    wait = verbs.add_parser("wait", help="wait for a request's result")
    _common(wait)
    wait.add_argument("workspace")
    wait.add_argument("request_id")
    wait.add_argument("--timeout", type=float, default=60.0)
    rerun = verbs.add_parser("rerun", help="run a finished request again (enqueue --rerun)")
    _common(rerun)
    _add_enqueue_args(rerun, rerun_flag=False)
    return parser


def _outcome_exit(outcome: RequestOutcome) -> int:
    if outcome.timed_out:
        return EXIT_TIMEOUT
    return EXIT_OK if outcome.ok else EXIT_FAILED


async def _enqueue(client: QueueClient, args: argparse.Namespace, *, rerun: bool) -> int:
    if args.wait:
        _need_seconds("--timeout", args.timeout)
    try:
        payload = None if args.input is None else json.loads(args.input)
    except ValueError as exc:
        raise UsageError(f"--input is not JSON: {exc}") from None
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
    if not args.wait:
        _print(answer.to_json())
        return EXIT_OK
    outcome = await client.wait_request(args.workspace, answer.request_id, timeout=args.timeout)
    _print({"enqueued": answer.to_json(), **outcome.to_json()})
    return _outcome_exit(outcome)


async def _workspace(args: argparse.Namespace) -> int:
    async with QueueClient(_need_url(args), args.token) as client:
        if args.command == "enqueue":
            return await _enqueue(client, args, rerun=args.rerun)
        if args.verb == "rerun":
            return await _enqueue(client, args, rerun=True)
        if args.verb == "list":
            if args.all:
                rows = [
                    row
                    async for row in client.iter_requests(
                        status=args.status, workspace_id=args.workspace, page=args.limit
                    )
                ]
            else:
                rows = await client.list_requests(
                    status=args.status, workspace_id=args.workspace, limit=args.limit
                )
            _print({"requests": [row.raw for row in rows]})
        elif args.verb == "show":
            _print((await client.get_request(args.workspace, args.request_id)).raw)
        elif args.verb == "replay":
            _print((await client.replay_request(args.workspace, args.request_id)).raw)
        elif args.verb == "wait":
            _need_seconds("--timeout", args.timeout)
            outcome = await client.wait_request(
                args.workspace, args.request_id, timeout=args.timeout
            )
            _print(outcome.to_json())
            return _outcome_exit(outcome)
        return EXIT_OK


def workspace_main(argv: list[str] | None = None) -> int:
    """`cv-workspace`: see the module docstring."""
    args = _workspace_parser().parse_args(argv)
    try:
        return asyncio.run(_workspace(args))
    except UsageError as exc:
        _print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        _print_error(exc)
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """`python -m cv_workspace_client.cli worker|workspace ARGS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "workspace":
        return workspace_main(argv[1:])
    print("usage: python -m cv_workspace_client.cli worker|workspace ARGS", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
