"""`cv-worker`: run stage handlers (docs/stages.md).

    cv-worker --url URL --token-file PATH --stages pkg.module:STAGES [--concurrency N]
              [--worker-class C] [--provider fake | --provider openai --provider-url U --model M]
              [--outbox PATH]

It waits until the server answers, prints `cv-worker ID ready`, claims and runs requests until
SIGTERM/SIGINT, then drains: running stages get `--drain-seconds` to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from cv_mutations.cli_flags import add_argument
from cv_workspace_client._fakes.provider import CountingFakeProvider
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
    EXIT_USAGE,
    HELP_LAYOUT,
    CommandParser,
    ErrorStyle,
    UsageError,
    announce,
    need_seconds,
    package_version,
    print_error,
)
from cv_workspace_client.cli.stages_module import load_stages
from cv_workspace_client.errors import WorkspaceError
from cv_workspace_client.logs import LOG_FORMATS, JsonFormatter, configure_logging
from cv_workspace_client.providers import OpenAICompatibleProvider, Provider, default_model
from cv_workspace_client.stage import Handler, Stage
from cv_workspace_client.worker import Worker, WorkerConfig

__all__ = ["PROVIDER_KEY_ENV", "worker_main"]

#: Environment variable holding the provider's API key (never a command-line argument: it would
#: show in `ps`).
PROVIDER_KEY_ENV = "CV_PROVIDER_API_KEY"


def _worker_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="cv-worker",
        description="Run stage handlers: claim requests, run them, complete them (docs/stages.md).",
        **HELP_LAYOUT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    add_connection_args(parser)
    add_argument(
        parser,
        "--stages",
        envvar="CV_STAGES",
        help="pkg.module:STAGES, a dict of stage name -> handler; the module is looked for in"
        " the current directory first (required)",
    )
    add_argument(
        parser,
        "--worker-class",
        envvar="CV_WORKER_CLASS",
        help="claim this worker class for every stage",
    )
    add_argument(
        parser,
        "--worker-id",
        envvar="CV_WORKER_ID",
        help="shown as claimed_by on the rows it holds (default: host and pid)",
    )
    add_argument(
        parser,
        "--concurrency",
        envvar="CV_CONCURRENCY",
        type=int,
        default=1,
        help="stages run at once (default 1)",
    )
    add_argument(
        parser,
        "--provider",
        envvar="CV_PROVIDER",
        choices=["openai", "fake"],
        help="the provider handed to stages: an OpenAI-compatible API, or the counting fake"
        f" for tests; the API key is read from ${PROVIDER_KEY_ENV}",
    )
    add_argument(
        parser,
        "--provider-url",
        envvar="CV_PROVIDER_URL",
        help="with --provider openai: the API's base URL",
    )
    add_argument(
        parser,
        "--model",
        envvar="CV_MODEL",
        help="with --provider openai: the model name sent with every call",
    )
    add_argument(
        parser,
        "--outbox",
        envvar="CV_OUTBOX",
        help="SQLite file for the durable op outbox: stage writes survive a worker's restart"
        " (default: in memory)",
    )
    add_argument(
        parser,
        "--transport",
        envvar="CV_WORKER_TRANSPORT",
        choices=["channel", "http"],
        default="channel",
        help="claim and report over the worker channel (falling back to HTTP when the server"
        " has none), or over HTTP only (default channel)",
    )
    defaults = WorkerConfig()
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=defaults.heartbeat_seconds,
        help=f"how often a running stage renews its lease (default {defaults.heartbeat_seconds:g})",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=defaults.drain_seconds,
        help="on SIGTERM, how long running stages may take to finish before they are cancelled"
        f" (default {defaults.drain_seconds:g})",
    )
    add_argument(
        parser,
        "--log-level",
        envvar="CV_LOG_LEVEL",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )
    add_argument(
        parser,
        "--log-format",
        envvar="CV_LOG_FORMAT",
        choices=LOG_FORMATS,
        default="text",
        help="json: every line the worker writes is one JSON object, each line of a stage run"
        " carrying its queue_request_id (default text; docs/observability.md)",
    )
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


def _log_start(
    worker_id: str, stages: dict[str, Handler | Stage], kind: str | None, provider: Provider | None
) -> None:
    """One line saying what this worker runs: its stages, and the provider and model it hands
    them (`--model`), so a misconfigured worker shows before its first run
    (tests/cli/test_worker_provider_log.py)."""
    model = default_model(provider)
    logging.getLogger("cv_workspace_client.worker").info(
        "worker %s: stages %s; provider %s%s",
        worker_id,
        ", ".join(sorted(stages)),
        kind or "none",
        f", model {model}" if model else "",
        extra={
            "event": "worker_started",
            "worker": worker_id,
            "stages": sorted(stages),
            "provider": kind,
            "model": model,
        },
    )


async def _wait_for_server(url: str, config: WorkerConfig) -> None:
    """Return once the server at `url` answers `GET /readyz` with 200; until then, say on
    stderr why not, once per reason, and try again on the worker's idle schedule (100 ms
    doubling to 2 s). `ready` means a reachable server, never merely a started process
    (tests/cli/test_conventions.py). A URL that answers as something other than a
    cv-server is a usage error, at once."""
    import aiohttp

    delay = config.idle_initial_seconds
    said = ""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                async with session.get(url + "/readyz", allow_redirects=False) as response:
                    if response.status == 200:
                        return
                    if response.status in (404, 405) or response.status < 500:
                        raise UsageError(
                            f"cv-worker: {url} is not a cv-server (GET /readyz answered"
                            f" {response.status}): is --url right?"
                        )
                    why = f"it answers {response.status} to GET /readyz (starting or stopping)"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                why = f"cannot reach it ({type(exc).__name__}: {exc})"
            if why != said:
                logging.getLogger("cv_workspace_client.worker").warning(
                    "waiting for the server at %s: %s; retrying (is the server up, is --url"
                    " right?)",
                    url,
                    why,
                )
                said = why
            await asyncio.sleep(delay)
            delay = min(delay * 2, config.idle_max_seconds)


async def _run_worker(args: argparse.Namespace, stages: dict[str, Handler | Stage]) -> int:
    from cv_workspace_client.client import WorkspaceClient  # the full SDK: outbox, websockets

    config = WorkerConfig(
        concurrency=args.concurrency,
        heartbeat_seconds=args.heartbeat_seconds,
        drain_seconds=args.drain_seconds,
        transport=args.transport,
    )
    provider = _provider(args)
    try:
        refresh = token_file_provider(args.token_file) if args.token_file else None
        async with WorkspaceClient(
            need_url(args), token=need_token(args), token_provider=refresh, outbox=args.outbox
        ) as client:
            worker = Worker(
                client,
                stages,
                args.worker_class,
                worker_id=args.worker_id,
                provider=provider,
                config=config,
            )
            # Before any claim, so before the drain's handlers: a signal while waiting ends the
            # process with nothing claimed.
            await _wait_for_server(client.url, config)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.stop)  # drain, then exit 0 (docs/stages.md)
            _log_start(worker.worker_id, stages, args.provider, provider)
            ready = f"cv-worker {worker.worker_id} ready"
            if args.log_format == "json":  # every line one JSON object, the ready line too
                record = logging.LogRecord("cv_worker", logging.INFO, __file__, 0, ready, (), None)
                record.__dict__.update(event="ready", worker=worker.worker_id)
                ready = JsonFormatter().format(record)
            announce(ready)
            stats = await worker.run()
            logging.getLogger("cv_workspace_client.worker").info("drained: %s", stats)
            return EXIT_OK if stats.clean else EXIT_FAILED
    finally:
        if isinstance(provider, OpenAICompatibleProvider):
            await provider.aclose()


def worker_main(argv: list[str] | None = None) -> int:
    """`cv-worker`: run until SIGTERM/SIGINT, drain, exit 0 (1 if the drain deadline cancelled
    stages, or the server refused the token; 130 if interrupted before it was ready, while
    its stages were still loading, say)."""
    ErrorStyle.set("cv-worker", argv)
    try:
        args = _worker_parser().parse_args(argv)
        if not args.stages:
            raise UsageError("cv-worker: --stages (or $CV_STAGES) is required")
        # Validated here, not left to `logging`/`WorkerConfig`: their ValueError would escape
        # as a traceback with exit 1 instead of a usage error (exit 2).
        try:
            configure_logging(args.log_format, args.log_level)
        except ValueError:
            raise UsageError(f"--log-level {args.log_level!r} is not a logging level") from None
        if args.concurrency < 1:
            raise UsageError("--concurrency must be >= 1")
        need_seconds("--heartbeat-seconds", args.heartbeat_seconds, positive=True)
        need_seconds("--drain-seconds", args.drain_seconds)
        need_url(args)
        need_token(args)
        stages = load_stages(args.stages)
        return asyncio.run(_run_worker(args, stages))
    except UsageError as exc:
        print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        print_error(exc)
        return EXIT_FAILED
    except KeyboardInterrupt:  # before the drain's handler was installed: nothing claimed yet
        return EXIT_INTERRUPTED
