"""Log lines for the long-running commands (`cv-server serve`, `cv-worker`): `--log-format json`
(one JSON object per line, for a log pipeline) or `text` (for a terminal), and `--log-level`.

A line's fields are its `LogRecord`'s own attributes, given with `extra=` (`request_id`,
`queue_request_id`, `route`, ...): JSON writes each as a member next to `ts`, `level`, `logger`
and `message`; text appends them as `key=value`. With JSON every line the process writes is one
object: warnings and uncaught exceptions go through the same handler (a traceback becomes the
`exc` member, one line).

Whatever the format, a line never carries a bearer token, a claim token, a secret or a provider
key: callers do not log them, and `redact` removes any that slipped into a message or a field
(an exception's text quoting a header, say). See docs/observability.md.

Here, in `cv_mutations`, because both the SDK's commands and the server's write these lines and
`cv_mutations` is the one package both import (the SDK and the server never import each other:
[tool.importlinter] in pyproject.toml); the SDK re-exports it as `cv_workspace_client.logs`.
Standard library only, and no I/O of its own: the formatters are functions of a record, and
`configure_logging` only points the `logging` module at a stream, once, from a command's `main`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import IO, Any, Final, Literal

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "context_fields",
    "log_context",
    "redact",
]

LogFormat = Literal["json", "text"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")

#: What a token, a key or a secret looks like where it could slip into a line: this project's
#: bearer tokens (`cvt1.<payload>.<signature>`), an Authorization value, a `key=value` or JSON
#: member named like a credential, and the common provider key shapes (`sk-...`).
_SECRETS: Final = (
    re.compile(r"cvt1\.[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)?"),
    re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]+"),
    re.compile(
        r"(?i)((?:claim_|access_|refresh_|id_)?token|api[_-]?key|secret|password|authorization)"
        r"(\"?\s*[:=]\s*\"?)(?!<redacted>)[^\s\"'&,;}]+"
    ),
    re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}"),
)
_REPLACEMENTS: Final = (r"<redacted>", r"\1 <redacted>", r"\1\2<redacted>", r"<redacted>")

#: The attributes every LogRecord has: anything else on a record is a field given with `extra=`.
_STANDARD: Final = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


#: Fields every line logged in this context carries (`log_context`): the worker sets the queue
#: request id of the run it executes, so its lock decisions, provider calls and writes say which
#: run they belong to, and the SDK sends it as `X-Request-ID` on that run's HTTP requests.
_CONTEXT: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "cv_log_context", default=None
)


@contextlib.contextmanager
def log_context(**fields: str) -> Iterator[None]:
    """Within the block (and the tasks it starts), every log line carries `fields`."""
    current = _CONTEXT.get() or {}
    token = _CONTEXT.set({**current, **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def context_fields() -> Mapping[str, str]:
    """The fields `log_context` set for the code running now (empty outside any)."""
    return _CONTEXT.get() or {}


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_CONTEXT.get() or {}).items():
            if key not in record.__dict__:
                record.__dict__[key] = value
        return True


def redact(text: str) -> str:
    """`text` with every token, key and secret it holds replaced by `<redacted>`."""
    for pattern, replacement in zip(_SECRETS, _REPLACEMENTS, strict=True):
        text = pattern.sub(replacement, text)
    return text


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
    }


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _plain(value: Any) -> Any:
    """A field as JSON can hold it (anything else by its `str`)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: `ts` (UTC, ISO 8601), `level`, `logger`, `message`, the
    record's fields, and `exc` (the traceback, as one string) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            line.setdefault(key, _plain(value))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return redact(json.dumps(line, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """`<ts> <LEVEL> <logger>: <message> key=value ...`, the traceback on the lines after."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(
            f"{key}={json.dumps(_plain(value), ensure_ascii=False, default=str)}"
            if not isinstance(value, str) or not value or any(c.isspace() for c in value)
            else f"{key}={value}"
            for key, value in _fields(record).items()
        )
        text = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if fields:
            text = f"{text} {fields}"
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return redact(text)


def configure_logging(
    log_format: LogFormat = "text", level: str = "INFO", *, stream: IO[str] | None = None
) -> logging.Handler:
    """Send every log record of the process to `stream` (stderr) in `log_format`, at `level`
    and above; warnings and uncaught exceptions too. Replaces the root logger's handlers.
    Raises `ValueError` for an unknown level or format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}: {log_format!r}")
    levelno = logging.getLevelNamesMapping().get(level.upper())
    if levelno is None:
        raise ValueError(f"not a logging level: {level!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(levelno)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception
    return handler


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """What the interpreter would print as "Exception ignored in ...", as one log record."""
    exc = unraisable.exc_value
    logging.getLogger("unraisable").error(
        "exception ignored in %r: %s",
        unraisable.object,
        unraisable.err_msg or "",
        exc_info=None if exc is None else (type(exc), exc, unraisable.exc_traceback),
    )


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None:
        return
    logging.getLogger("uncaught").critical(
        "uncaught exception in thread %s",
        args.thread.name if args.thread is not None else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("uncaught").critical("uncaught exception", exc_info=(kind, exc, tb))
