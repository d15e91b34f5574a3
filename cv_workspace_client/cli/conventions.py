"""What `cv-worker` and `cv-workspace` share, and how they say it
(tests/cli/test_conventions.py): the exit statuses `--help` prints (`EXIT_CODES`), one
error style (a line on stderr, or a JSON object with `--json`) that argparse's own refusals follow
too, answers as JSON on stdout, a reader of stdout that leaves early, and the checks of durations
and counts every command makes before it sends anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from typing import Any, NoReturn

from cv_workspace_client._version import package_version
from cv_workspace_client.errors import ForbiddenError, WorkspaceError

__all__ = [
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_READER_GONE",
    "EXIT_TERMINATED",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "HELP_LAYOUT",
    "CommandParser",
    "ErrorStyle",
    "UsageError",
    "announce",
    "need_count",
    "need_seconds",
    "package_version",
    "parse_json_arg",
    "print_error",
    "print_json",
    "reader_gone",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
#: 128 + the signal, what a shell reports for a process the signal ended: a script sees the same
#: status whether the command died of the signal or (as here) exited because of it.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_READER_GONE = 128 + signal.SIGPIPE

#: The exit statuses, as every command's `--help` prints them (tests/cli/test_conventions.py,
#: `test_every_flag_has_help_and_every_help_lists_the_exit_statuses`).
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
HELP_LAYOUT: dict[str, Any] = {
    "epilog": EXIT_CODES,
    "formatter_class": argparse.RawDescriptionHelpFormatter,
}


class UsageError(Exception):
    """An argument that cannot work (a flag, a URL, a token, a `--stages` module): the command
    prints it in the one error style and exits with `EXIT_USAGE`, before anything is sent."""


class CommandParser(argparse.ArgumentParser):
    """argparse's own refusals (a missing --stage, `--limit abc`) in the commands' one error
    style: one line on stderr, or the JSON object with `--json` (an agent parsing stderr reads
    every error the same way). Exit 2. Subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        print_error(UsageError(f"{self.prog}: {message}"))
        raise SystemExit(EXIT_USAGE)


class ErrorStyle:
    """How the running command prints errors: its name, and whether as JSON (`--json`). Set
    from the arguments before they are parsed, so that argparse's own refusals follow it."""

    prog = "cv-workspace"
    json = False

    @classmethod
    def set(cls, prog: str, argv: list[str] | None) -> None:
        cls.prog = prog
        cls.json = "--json" in (sys.argv[1:] if argv is None else argv)


def need_seconds(name: str, value: float, *, positive: bool = False) -> None:
    """A duration argument must be a finite number of seconds: `inf` overflows aiohttp's timers
    (a traceback), `nan` and negative values silently act as zero (the drain cancels at once, a
    wait ends before it began) — all usage errors, refused before anything is sent."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise UsageError(f"{name} must be a finite number of seconds {bound}, not {value!r}")


def need_count(name: str, value: int | None) -> None:
    """A count of requests or attempts below 1 means nothing: `--limit 0 --all` listed no
    request at all (as if there were none), and the server refused the others (exit 1)."""
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1, not {value}")


def print_json(data: Any) -> None:
    """An answer on stdout: indented JSON with sorted keys, flushed at once."""
    print(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False), flush=True)


def reader_gone() -> int:
    """The reader of stdout left (`... | head -1`): exit quietly, as the Python docs' note on
    SIGPIPE advises. stdout is pointed at /dev/null first, so that the interpreter's final
    flush of what is still buffered cannot raise again ("Exception ignored ..." and exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


def announce(line: str) -> None:
    """A long-running command's line for whoever watches it start (`cv-worker ... ready`). When
    nobody reads it any more (a `| head -1` that has exited), the work goes on: the command's
    job is the queue, not its stdout. Later output goes to /dev/null."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        reader_gone()


def print_error(exc: BaseException) -> None:
    """One error, in the commands' one style: `prog: message (code)` on one line, or with
    `--json` the object `{"error": {"code", "message"}}`. A refusal for a missing scope names
    the scopes that would do, in the line and as `required_scopes`
    (tests/cli/test_conventions.py::test_a_missing_scope_is_named_in_the_error)."""
    code = exc.code if isinstance(exc, WorkspaceError) else "usage"
    message = exc.message if isinstance(exc, WorkspaceError) else str(exc)
    scopes = exc.required_scopes if isinstance(exc, ForbiddenError) else ()
    if scopes:
        needed = " or ".join(scopes)
        message = f"{message}; the token needs the {needed} scope (cv-server token --scope)"
    if ErrorStyle.json:
        error: dict[str, object] = {"code": code, "message": message}
        if scopes:
            error["required_scopes"] = list(scopes)
        line = json.dumps({"error": error})
    else:
        text = " ".join(message.split())  # one line, whatever the server's message held
        line = text if code == "usage" else f"{text} ({code})"
        if not line.startswith(("cv-worker", "cv-workspace")):
            line = f"{ErrorStyle.prog}: {line}"
    print(line, file=sys.stderr, flush=True)


def parse_json_arg(raw: str, flag: str = "--input") -> Any:
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
        raise UsageError(f"{flag} is not JSON: {exc}") from None
    except RecursionError:
        raise UsageError(f"{flag} is nested too deeply") from None
