"""Two commands: `cv-worker` runs stage handlers; `cv-workspace` submits and inspects work from a
shell or an agent, with no browser present.

    cv-worker --url URL --token-file PATH --stages pkg.module:STAGES [--concurrency N]
              [--worker-class C] [--provider fake | --provider openai --provider-url U --model M]
              [--outbox PATH]
    cv-workspace enqueue --workspace W --stage S [--job-id J] [--input JSON] [--wait]
    cv-workspace requests list|show|wait|replay|rerun|cancel --workspace W ...
    cv-workspace mcp [--transport stdio | --transport http --host H --port P] [--outbox PATH]

A flag backed by an environment variable names it at the end of its help (`(env: CV_URL)`;
`CV_TOKEN_FILE`, `CV_WORKSPACE`, ...); a flag given wins over it. `--token-file` reads the token
from a file, which `cv-worker` reads again whenever the server refuses the token it holds (a file
a secret manager rotates); `--token` also works but shows in `ps`. A path in the URL is kept as a
prefix of every route (a server behind a reverse proxy at `https://gateway/cv`). Answers are JSON
on stdout; an error is one line on stderr (`--json`: a JSON object `{"error": {"code",
"message"}}` instead). The exit statuses are `EXIT_CODES`, printed by `--help`. Reference:
docs/stages.md, docs/queue.md.

Also runnable as `python -m cv_workspace_client.cli worker|workspace ARGS`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Coroutine, Mapping
from typing import Any, NoReturn

from cv_mutations.cli_flags import add_argument
from cv_workspace_client._core.url import check_server_url
from cv_workspace_client._io.auth import TokenProvider
from cv_workspace_client._io.retry import backoff_for
from cv_workspace_client._queue.requester import QueueClient
from cv_workspace_client.cli.progress import Progress, watching
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import ForbiddenError, WorkspaceError
from cv_workspace_client.logs import LOG_FORMATS, JsonFormatter, configure_logging
from cv_workspace_client.providers import OpenAICompatibleProvider, Provider
from cv_workspace_client.queue_models import (
    STATUSES,
    EnqueuedRequest,
    QueuedRequest,
    RequestOutcome,
)
from cv_workspace_client.stage import Handler, Stage
from cv_workspace_client.testing import CountingFakeProvider
from cv_workspace_client.worker import Worker, WorkerConfig

__all__ = ["EXIT_CODES", "load_stages", "worker_main", "workspace_main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
#: 128 + the signal, what a shell reports for a process the signal ended: a script sees the same
#: status whether the command died of the signal or (as here) exited because of it.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_READER_GONE = 128 + signal.SIGPIPE

#: The exit statuses, as `--help` prints them (tests/worker/test_cli_help.py).
EXIT_CODES = """exit status:
  0    success (cv-worker: drained after SIGTERM/SIGINT)
  1    refused by the server, a waited request ended with an error payload, in poison or
       cancelled, or (cv-worker) the drain deadline cancelled stages
  2    bad usage: a flag, a URL, a token or a --stages module that cannot work
  3    the wait timed out: the request goes on, its id is in the answer
  130  interrupted by SIGINT (enqueue --wait still prints the request id, status interrupted)
  141  the reader of stdout left early (`... | head -1`)
  143  terminated by SIGTERM (as 130)"""

#: Every command's help ends with the exit statuses, laid out as written.
_HELP_LAYOUT: dict[str, Any] = {
    "epilog": EXIT_CODES,
    "formatter_class": argparse.RawDescriptionHelpFormatter,
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cv-workspace")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


#: Environment variable holding the provider's API key (never a command-line argument: it would
#: show in `ps`).
PROVIDER_KEY_ENV = "CV_PROVIDER_API_KEY"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (a missing --stage, `--limit abc`) in the commands' one error
    style: one line on stderr, or the JSON object with `--json` (an agent parsing stderr reads
    every error the same way). Exit 2. Subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        _print_error(UsageError(f"{self.prog}: {message}"))
        raise SystemExit(EXIT_USAGE)


class _ErrorStyle:
    """How the running command prints errors: its name, and whether as JSON (`--json`). Set
    from the arguments before they are parsed, so that argparse's own refusals follow it."""

    prog = "cv-workspace"
    json = False

    @classmethod
    def set(cls, prog: str, argv: list[str] | None) -> None:
        cls.prog = prog
        cls.json = "--json" in (sys.argv[1:] if argv is None else argv)


def _common(parser: argparse.ArgumentParser) -> None:
    add_argument(parser, "--url", envvar="CV_URL", help="the server's http(s) URL")
    add_argument(
        parser,
        "--token",
        envvar="CV_TOKEN",
        help="bearer token; prefer --token-file: a flag shows in `ps`",
    )
    add_argument(
        parser,
        "--token-file",
        envvar="CV_TOKEN_FILE",
        help="file holding the token, read again whenever the server refuses it: a token a "
        "secret manager rotates in place",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print errors as a JSON object on stderr instead of one line of text",
    )


def _need_url(args: argparse.Namespace) -> str:
    if not args.url:
        raise UsageError("--url (or $CV_URL) is required")
    try:
        check_server_url(str(args.url))
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    return str(args.url)


#: RFC 6750's b64token: what a bearer token may hold (`cv-server token` mints within it).
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def _need_token(args: argparse.Namespace) -> str:
    """Every route the commands call needs the token: a missing one was the server's 401 (exit
    1, as if refused), and one with a newline or a non-ASCII character a traceback from aiohttp
    (which refuses such a header). Never quoted back: it is a secret."""
    if args.token_file:
        if args.token:
            raise UsageError("give --token ($CV_TOKEN) or --token-file ($CV_TOKEN_FILE), not both")
        return _read_token_file(str(args.token_file))
    if not args.token:
        raise UsageError("--token, $CV_TOKEN, --token-file or $CV_TOKEN_FILE is required")
    if not _BEARER_TOKEN.fullmatch(str(args.token)):
        raise UsageError(
            "--token (or $CV_TOKEN) is not a bearer token: letters, digits and -._~+/ only "
            "(a stray newline or space?)"
        )
    return str(args.token)


def _read_token_file(path: str) -> str:
    """The token in `path`, without the line end editors and `echo` add."""
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--token-file {path!r} cannot be read: {exc}") from None
    if not _BEARER_TOKEN.fullmatch(token):
        raise UsageError(f"--token-file {path!r} does not hold a bearer token")
    return token


def _token_file_provider(path: str, config: ClientConfig | None = None) -> TokenProvider:
    """A `token_provider` that reads `path` again: when the server refuses the token, the file
    may hold a fresh one by now (a Kubernetes projected token, a Vault agent's sink).

    A file caught mid-rotation (a writer that truncates, then writes; one that removes, then
    creates) is read again with the client's retry policy (`config`: full jitter,
    `retry_attempts` reads). Read once, its empty content failed the refresh, the refused
    claim stood, and the worker stopped with exit 1 on a rotation that was going well."""
    policy = config or ClientConfig()
    backoff = backoff_for(policy)

    async def read() -> str:
        failures = 0
        while True:
            try:
                return await asyncio.to_thread(_read_token_file, path)
            except UsageError:
                failures += 1
                if failures >= policy.retry_attempts:
                    raise
            await policy.sleep(backoff(failures))

    return read


def _need_seconds(name: str, value: float, *, positive: bool = False) -> None:
    """A duration argument must be a finite number of seconds: `inf` overflows aiohttp's timers
    (a traceback), `nan` and negative values silently act as zero (the drain cancels at once, a
    wait ends before it began) — all usage errors, refused before anything is sent."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise UsageError(f"{name} must be a finite number of seconds {bound}, not {value!r}")


def _need_count(name: str, value: int | None) -> None:
    """A count of requests or attempts below 1 means nothing: `--limit 0 --all` listed no
    request at all (as if there were none), and the server refused the others (exit 1)."""
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1, not {value}")


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False), flush=True)


def _reader_gone() -> int:
    """The reader of stdout left (`... | head -1`): exit quietly, as the Python docs' note on
    SIGPIPE advises. stdout is pointed at /dev/null first, so that the interpreter's final
    flush of what is still buffered cannot raise again ("Exception ignored ..." and exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


def _announce(line: str) -> None:
    """A long-running command's line for whoever watches it start (`cv-worker ... ready`). When
    nobody reads it any more (a `| head -1` that has exited), the work goes on: the command's
    job is the queue, not its stdout. Later output goes to /dev/null."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _reader_gone()


def _parse_input(raw: str) -> Any:
    """`--input` as JSON, strictly: Python's parser also takes NaN, Infinity and numbers past
    a float (1e999 → inf), which are not JSON — the server refused the body as malformed (exit
    1, blaming the server for the caller's argument). Nesting past the recursion limit was a
    RecursionError traceback."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} does not fit in a float")
        return value

    try:
        return json.loads(raw, parse_constant=refuse_constant, parse_float=finite)
    except ValueError as exc:
        raise UsageError(f"--input is not JSON: {exc}") from None
    except RecursionError:
        raise UsageError("--input is nested too deeply") from None


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
        if _ErrorStyle.json:
            return json.dumps({"warning": message})
        return f"{_ErrorStyle.prog}: {message}"


def _warnings_to_stderr() -> logging.Handler:
    """`cv-workspace` says every retry on stderr as it happens: a call waiting out a server
    that does not answer is never silent (tests/worker/test_cli_startup.py). The caller
    removes the handler when the command ends."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_WarningLine())
    handler.setLevel(logging.WARNING)
    logging.getLogger("cv_workspace_client").addHandler(handler)
    return handler


def _print_error(exc: BaseException) -> None:
    """One error, in the commands' one style: `prog: message (code)` on one line, or with
    `--json` the object `{"error": {"code", "message"}}`."""
    code = exc.code if isinstance(exc, WorkspaceError) else "usage"
    message = exc.message if isinstance(exc, WorkspaceError) else str(exc)
    if _ErrorStyle.json:
        line = json.dumps({"error": {"code": code, "message": message}})
    else:
        text = " ".join(message.split())  # one line, whatever the server's message held
        line = text if code == "usage" else f"{text} ({code})"
        if not line.startswith(("cv-worker", "cv-workspace")):
            line = f"{_ErrorStyle.prog}: {line}"
    print(line, file=sys.stderr, flush=True)


# -- cv-worker -------------------------------------------------------------------------------------


def _current_directory_on_path() -> str | None:
    """Put the current directory first on `sys.path`, as `python -m` and uvicorn do, and return
    it. The `cv-worker` console script is run as a file, so Python put the script's directory
    there instead (`.venv/bin`): a stages module next to the user, as the README has it, was
    "No module named". Left there (uvicorn's way, not celery's import-time-only one): a stage
    that imports a sibling module only when it first runs must find it too. Not under `python
    -P` / `PYTHONSAFEPATH`, which ask for no such entry; nor when the directory is gone."""
    if sys.flags.safe_path:
        return None
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        return None
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def _import_failure(module_name: str, exc: Exception, cwd: str | None) -> UsageError:
    """Why `--stages` could not be imported, in one line: a module that is not there (a wrong
    name, or another directory), or one that failed while it ran (its own bug, or a dependency
    it lacks: named with the file and line; the traceback under --log-level DEBUG). A
    SyntaxError or an exception the module raised was a traceback with exit 1."""
    if isinstance(exc, ModuleNotFoundError) and (
        exc.name == module_name or module_name.startswith(f"{exc.name}.")
    ):
        where = f"in the current directory ({cwd}) nor " if cwd else ""
        hint = (
            f" (a module name, not a file: {module_name[:-3]})"
            if module_name.endswith(".py")
            else ""
        )
        return UsageError(f"--stages: {exc}: not {where}on the Python path{hint}")
    logging.getLogger(__name__).debug("importing %s failed", module_name, exc_info=exc)
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and not isinstance(exc, SyntaxError):  # a SyntaxError names its file and line
        what += f" ({frames[-1].filename}, line {frames[-1].lineno})"
    return UsageError(f"--stages: importing {module_name!r} failed: {what}")


def load_stages(spec: str) -> dict[str, Handler | Stage]:
    """Import `pkg.module:NAME`, a dict of stage name → handler or `Stage`. The module is looked
    for in the current directory first, as `python -m` does; this puts that directory on
    `sys.path` (see `_current_directory_on_path`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr or not all(part.isidentifier() for part in module_name.split(".")):
        # `./mymod:STAGES`, `.mymod:STAGES` (a relative name was a TypeError traceback).
        raise UsageError(f"--stages must look like pkg.module:NAME, not {spec!r}")
    cwd = _current_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the module raises while it runs: its own bug
        raise _import_failure(module_name, exc, cwd) from None
    stages = getattr(module, attr, None)
    if not isinstance(stages, Mapping) or not stages:
        raise UsageError(f"{spec} must be a non-empty dict of stage name -> handler or Stage")
    for name, stage in stages.items():
        if not isinstance(name, str) or not (isinstance(stage, Stage) or callable(stage)):
            raise UsageError(f"{spec}[{name!r}] must be a handler or a Stage")
    return dict(stages)


def _worker_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cv-worker",
        description="Run stage handlers: claim requests, run them, complete them (docs/stages.md).",
        **_HELP_LAYOUT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _common(parser)
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


async def _wait_for_server(url: str, config: WorkerConfig) -> None:
    """Return once the server at `url` answers `GET /readyz` with 200; until then, say on
    stderr why not, once per reason, and try again on the worker's idle schedule (100 ms
    doubling to 2 s). `ready` means a reachable server, never merely a started process
    (tests/worker/test_cli_startup.py). A URL that answers as something other than a
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
    )
    provider = _provider(args)
    try:
        refresh = _token_file_provider(args.token_file) if args.token_file else None
        async with WorkspaceClient(
            _need_url(args), token=_need_token(args), token_provider=refresh, outbox=args.outbox
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
            ready = f"cv-worker {worker.worker_id} ready"
            if args.log_format == "json":  # every line one JSON object, the ready line too
                record = logging.LogRecord("cv_worker", logging.INFO, __file__, 0, ready, (), None)
                record.__dict__.update(event="ready", worker=worker.worker_id)
                ready = JsonFormatter().format(record)
            _announce(ready)
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
    _ErrorStyle.set("cv-worker", argv)
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
        _need_seconds("--heartbeat-seconds", args.heartbeat_seconds, positive=True)
        _need_seconds("--drain-seconds", args.drain_seconds)
        _need_url(args)
        _need_token(args)
        stages = load_stages(args.stages)
        return asyncio.run(_run_worker(args, stages))
    except UsageError as exc:
        _print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        _print_error(exc)
        return EXIT_FAILED
    except KeyboardInterrupt:  # before the drain's handler was installed: nothing claimed yet
        return EXIT_INTERRUPTED


# -- cv-workspace ----------------------------------------------------------------------------------


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
    _common(parser)
    _add_workspace_arg(parser)
    parser.add_argument("request_id", help="the request's id, as enqueue printed it")


def _workspace_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cv-workspace",
        description="Submit and inspect stage work (docs/queue.md).",
        **_HELP_LAYOUT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    enqueue = commands.add_parser("enqueue", help="queue a stage request", **_HELP_LAYOUT)
    _common(enqueue)
    _add_enqueue_args(enqueue, rerun_flag=True)

    requests = commands.add_parser("requests", help="inspect and steer requests", **_HELP_LAYOUT)
    verbs = requests.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="requests by status, oldest first", **_HELP_LAYOUT)
    _common(listing)
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
            "cancel",
            "cancel a request: a pending one at once, one in progress once its worker stops "
            "(the answer then says cancel_requested); a done or poison one cannot be",
        ),
    ):
        _request_args(verbs.add_parser(verb, help=text, **_HELP_LAYOUT))
    wait = verbs.add_parser("wait", help="wait for a request's result", **_HELP_LAYOUT)
    _request_args(wait)
    wait.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait; the request goes on after (default 60)",
    )
    _progress_arg(wait)
    rerun = verbs.add_parser(
        "rerun", help="run a finished request again (enqueue --rerun)", **_HELP_LAYOUT
    )
    _common(rerun)
    _add_enqueue_args(rerun, rerun_flag=False)

    mcp = commands.add_parser(
        "mcp",
        help="serve the workspace tools to agents over MCP (needs the `mcp` extra)",
        description="Serve MCP tools (get_state, apply_ops, enqueue, wait_request, ...) and "
        "sub-doc resources over one SDK client: over stdio (how an agent host starts a tool "
        "server) or streamable HTTP (docs/mcp.md).",
        **_HELP_LAYOUT,
    )
    _common(mcp)
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
        envvar="CV_HOST",
        default="127.0.0.1",
        help="with --transport http: the address to bind (default 127.0.0.1: whoever reaches "
        "it acts with this command's token)",
    )
    add_argument(
        mcp,
        "--port",
        envvar="CV_PORT",
        type=int,
        default=8000,
        help="with --transport http: the port (default 8000; 0: a free one)",
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
        _need_seconds("--timeout", args.timeout)
    _need_count("--max-dequeues", args.max_dequeues)
    payload = None if args.input is None else _parse_input(args.input)
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
        _print(answer.to_json())
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
        _print({"enqueued": answer.to_json(), **interrupted})
        raise
    _print({"enqueued": answer.to_json(), **outcome.to_json()})
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
    if _ErrorStyle.json:
        line = json.dumps({"warning": {"code": "input_differs", "message": message}})
    else:
        line = f"{_ErrorStyle.prog}: warning: {message} (input_differs)"
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
            "cv-workspace mcp needs the mcp extra: pip install 'cv-workspace[mcp]'"
        ) from None
    from cv_workspace_client.client import WorkspaceClient

    url, token = _need_url(args), _need_token(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be within 0..65535, not {args.port}")
    refresh = _token_file_provider(args.token_file) if args.token_file else None
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
                    ready=lambda where: _announce(f"cv-workspace mcp listening on {where}"),
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
    url, token = _need_url(args), _need_token(args)
    if getattr(args, "verb", None) == "list":
        _need_count("--limit", args.limit)
    async with QueueClient(url, token) as client:
        if args.command == "enqueue":
            return await _enqueue(client, args, rerun=args.rerun)
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
            _print({"requests": [row.raw for row in rows]})
        elif args.verb == "show":
            _print((await client.get_request(args.workspace, args.request_id)).raw)
        elif args.verb == "replay":
            _print((await client.replay_request(args.workspace, args.request_id)).raw)
        elif args.verb == "cancel":
            _print((await client.cancel_request(args.workspace, args.request_id)).raw)
        elif args.verb == "wait":
            _need_seconds("--timeout", args.timeout)
            async with watching(
                functools.partial(client.get_request, args.workspace, args.request_id),
                _progress(args),
            ) as watch:
                outcome = await client.wait_request(
                    args.workspace, args.request_id, timeout=args.timeout
                )
                watch.seen(outcome.request)
            _print(outcome.to_json())
            return _outcome_exit(outcome)
        return EXIT_OK


def workspace_main(argv: list[str] | None = None) -> int:
    """`cv-workspace`: see the module docstring."""
    _ErrorStyle.set("cv-workspace", argv)
    warnings = _warnings_to_stderr()
    try:
        args = _workspace_parser().parse_args(argv)
        return asyncio.run(_interruptible(_workspace(args)))
    except UsageError as exc:
        _print_error(exc)
        return EXIT_USAGE
    except WorkspaceError as exc:
        _print_error(exc)
        return EXIT_FAILED
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:  # by SIGTERM (`_interruptible`)
        return EXIT_TERMINATED
    finally:
        logging.getLogger("cv_workspace_client").removeHandler(warnings)


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
