"""`cv-server`: serve the op-log, set up its database, mint tokens, rotate their secret.

A flag backed by an environment variable names it at the end of its help (`(env: CV_PORT)`); a
flag given wins over it. Errors are one line on stderr. Reference: docs/configuration.md,
docs/operating.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.util
import logging
import math
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from aiohttp import web

from cv_mutations.cli_flags import add_argument
from cv_mutations.logs import LOG_FORMATS, JsonFormatter, LogFormat, configure_logging
from cv_server import token_commands
from cv_server.app import create_app
from cv_server.config import ServerConfig
from cv_server.errors import CvServerError
from cv_server.serving import ServerRunner
from cv_server.sqlite.meta import read_sqlite_token_secret, rotate_sqlite_token_secret
from cv_server.sqlite.stores import hold_serving_lock, set_up_sqlite_database
from cv_server.stores import DatabaseUnusable
from cv_server.token_commands import add_token_parser

__all__ = ["EXIT_CODES", "main"]

log = logging.getLogger("cv_server.cli")

DEFAULT_DB = Path("data/cv.db")

EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_READER_GONE = 128 + signal.SIGPIPE

#: The exit statuses, as `--help` prints them (tests/cli/test_conventions.py).
EXIT_CODES = """exit status:
  0    success (serve: stopped by SIGTERM/SIGINT after draining)
  1    a setting, a database or a port that cannot work (one line on stderr says which)
  2    bad usage: an argument the parser refuses, or the `server` extra is not installed
  130  interrupted (Ctrl-C) before serving
  141  the reader of stdout left before the output was written (`... | head -c 0`)"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cv-workspace")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class _MissingPostgresExtra(CvServerError):
    """`--database-url` without asyncpg installed."""


def _needs_asyncpg(database_url: str | None) -> None:
    if not database_url:
        return
    if importlib.util.find_spec("asyncpg") is None:
        raise _MissingPostgresExtra(
            "--database-url needs the postgres extra (asyncpg):"
            f" {sys.executable} -m pip install 'cv-workspace[server,postgres]'"
        )


#: What a bad database, a bad setting or a taken port raise at start-up: reported in one line
#: and exit status 1 (a supervisor restarting on a traceback would only loop), with the
#: traceback kept for --log-level DEBUG. Both backends raise a database they cannot serve (a
#: file SQLite cannot read; a missing PostgreSQL schema, database or role) as the seam's
#: `DatabaseUnusable`: their drivers' errors never reach this module.
_STARTUP_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnusable,
    ValueError,
    OSError,
    _MissingPostgresExtra,
)


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    add_argument(
        parser,
        "--db",
        envvar="CV_DB",
        type=Path,
        help=f"the SQLite file, the embedded default backend (default {DEFAULT_DB})",
    )
    add_argument(
        parser,
        "--database-url",
        envvar="CV_DATABASE_URL",
        help="PostgreSQL DSN, the scale-out backend; wins over --db (docs/postgres.md)",
    )
    add_argument(
        parser,
        "--schema",
        envvar="CV_SCHEMA",
        help="with --database-url: the (existing) schema to keep the tables in",
    )


def _with_schema(database_url: str, schema: str | None) -> str:
    """The DSN with `schema` as its search_path (asyncpg sends unknown query parameters as
    session settings), so every connection of the server, LISTEN included, works in it."""
    if schema is None:
        return database_url
    from cv_server.pg.pool import is_valid_schema_name

    if not is_valid_schema_name(schema):
        raise SystemExit(f"cv-server: invalid schema name {schema!r}")
    parts = urlsplit(database_url)
    query = [
        (k, v)
        for k, v in parse_qsl(parts.query)
        if k != "search_path" and not (k == "options" and "search_path" in v)
    ]
    query.append(("search_path", schema))
    return urlunsplit(parts._replace(query=urlencode(query)))


_SETTABLE = {
    f.name: f.type
    for f in dataclasses.fields(ServerConfig)
    if f.type in ("int", "float", "float | None", "str")
    and f.name not in ("db_path", "database_url", "token_secret")
}
#: What switches off a setting that may be None (`--set socket_heartbeat_seconds=off`).
_OFF = frozenset({"off", "none"})


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`NAME=VALUE` pairs for the numeric ServerConfig settings (its constants and limits, listed
    in docs/configuration.md): every constant is configurable without code, and tests shrink
    leases this way."""
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        kind = _SETTABLE.get(name)
        if not sep or kind is None:
            raise SystemExit(f"cv-server: --set {item!r}: settable: {', '.join(sorted(_SETTABLE))}")
        if kind == "str":  # text (problem_type_base): taken as given, checked by ServerConfig
            overrides[name] = raw
            continue
        if kind == "float | None" and raw.strip().lower() in _OFF:
            overrides[name] = None
            continue
        try:
            value = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise SystemExit(f"cv-server: --set {item!r}: not a number") from None
        # Every setting is a size, a count or a duration: `nan`, `inf` or a negative one would be
        # accepted silently and break the server later (a negative drain deadline cancels
        # in-flight commits before they are acknowledged; a nan lease never expires).
        if not math.isfinite(value) or value < 0:
            raise SystemExit(f"cv-server: --set {item!r}: must be a finite number >= 0")
        overrides[name] = value
    return overrides


def _port(raw: str) -> int:
    """A TCP port: one past 65535 was wrapped by the bind (`--port 99999` served on 34463, a
    port the operator never asked for) and a negative one refused later, as a start-up error."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not within 0..65535")
    return port


def _log_level(raw: str) -> str:
    """A `logging` level name, in any case (as `cv-worker` takes it): `logging.basicConfig`
    raised a ValueError traceback for an unknown one, and for `debug` in lower case."""
    level = raw.upper()
    if level not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(f"not a logging level: {raw!r}")
    return level


def _log_format(raw: str) -> LogFormat:
    """`text` or `json`."""
    for known in LOG_FORMATS:
        if raw == known:
            return known
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_FORMATS)}: {raw!r}")


def _reader_gone() -> int:
    """The reader of stdout left: exit quietly, as the Python docs' note on SIGPIPE advises.
    stdout is pointed at /dev/null first, so that the interpreter's final flush of what is
    still buffered cannot raise again ("Exception ignored ..." and exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


#: Every command's help ends with the exit statuses, laid out as written.
_HELP_LAYOUT: dict[str, Any] = {
    "epilog": EXIT_CODES,
    "formatter_class": argparse.RawDescriptionHelpFormatter,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cv-server", description=__doc__, **_HELP_LAYOUT)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server", **_HELP_LAYOUT)
    _add_backend_args(serve)
    add_argument(
        serve,
        "--host",
        envvar="CV_HOST",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, loopback only)",
    )
    add_argument(
        serve,
        "--port",
        envvar="CV_PORT",
        type=_port,
        default=8080,
        help="TCP port; 0 picks a free one (default 8080)",
    )
    add_argument(
        serve,
        "--log-level",
        envvar="CV_LOG_LEVEL",
        type=_log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )
    add_argument(
        serve,
        "--log-format",
        envvar="CV_LOG_FORMAT",
        type=_log_format,
        default="text",
        help="text, or json: every line the server writes is one JSON object (default text;"
        " docs/observability.md)",
    )
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a ServerConfig setting, e.g. --set lease_seconds=5 (repeatable; every"
        " setting is in docs/configuration.md)",
    )

    init = commands.add_parser(
        "init",
        help="create the database (tables, token secret) unless it exists; idempotent",
        **_HELP_LAYOUT,
    )
    _add_backend_args(init)

    token = add_token_parser(commands, _add_backend_args, _HELP_LAYOUT)
    token.set_defaults(token_parser=token)  # for its own usage errors

    rotate = commands.add_parser(
        "rotate-secret",
        help="replace the token secret: every token minted before is refused from then on",
        **_HELP_LAYOUT,
    )
    _add_backend_args(rotate)
    return parser


def _say(line: str, log_format: LogFormat, **fields: Any) -> None:
    """A line on stdout for whoever watches the start (`cv-server listening on ...`): with
    `--log-format json`, the same words as one JSON object, so that every line is one."""
    if log_format == "json":
        record = logging.LogRecord("cv_server", logging.INFO, __file__, 0, line, (), None)
        record.__dict__.update(fields)
        line = JsonFormatter().format(record)
    print(line, flush=True)


async def _serve(
    config: ServerConfig, host: str, port: int, log_format: LogFormat = "text"
) -> None:
    serving_lock = None
    if not config.database_url and config.db_path is not None:
        # One server per SQLite file: a second one would leave the first's cached sub-doc
        # heads behind the disk (see `hold_serving_lock`). Held until the process exits.
        try:
            serving_lock = hold_serving_lock(config.db_path)
        except DatabaseUnusable as exc:
            raise SystemExit(f"cv-server: cannot start: {exc}") from None
    try:
        await _serve_app(config, host, port, log_format)
    finally:
        if serving_lock is not None:  # after the stores closed: every write is on disk
            serving_lock.close()


async def _serve_app(config: ServerConfig, host: str, port: int, log_format: LogFormat) -> None:
    backend = "postgresql" if config.database_url else "sqlite"
    log.info("starting: opening the %s stores", backend, extra={"step": "open_stores"})
    app = create_app(config)
    # The drain deadline (`drain_seconds`, docs/configuration.md) bounds how long in-flight
    # requests may take to finish.
    # aiohttp spends `shutdown_timeout` twice on a handler that is still running: once waiting
    # for it, then again after failing its body reads, before it cancels it. A handler that
    # reads no body (an SSE request stream waiting for its outcome) thus held SIGTERM for twice
    # the deadline (50 s: past a 30 s termination grace period, i.e. SIGKILL). Half each way
    # keeps the total within the deadline; a commit in flight is shielded and still awaited.
    # aiohttp reads a timeout of 0 as "none": `drain_seconds=0` (drain nothing) held SIGTERM
    # forever behind a request whose body never came. The smallest float is its "zero".
    runner = ServerRunner(
        app, shutdown_timeout=config.drain_seconds / 2 or math.ulp(0.0), access_log=None
    )
    try:
        _needs_asyncpg(config.database_url)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
    except _STARTUP_ERRORS as exc:
        log.debug("start-up failed", exc_info=True)
        await runner.cleanup()
        raise SystemExit(f"cv-server: cannot start: {exc}") from None
    bound_port = runner.addresses[0][1]
    # Start-up objects (modules, routes, stores) never die: keep them out of every collection.
    # With 10,000 sockets open, full collections otherwise stall the loop for 0.1-1.5 s
    # (bench/oplog.py scenario d); fewer young collections cost little memory here.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    try:
        _say(
            f"cv-server listening on http://{host}:{bound_port}",
            log_format,
            step="listening",
            url=f"http://{host}:{bound_port}",
        )
    except BrokenPipeError:
        # Nobody reads the line any more (a `| head -1` that has exited): serving is the job,
        # the line a courtesy. The server died of it, a traceback, before serving a request.
        _reader_gone()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info(
        "stopping: no new connections; draining in-flight requests (at most %.0f s)",
        config.drain_seconds,
        extra={"step": "drain"},
    )
    # Stop accepting, close sockets with 1001, let in-flight commits finish, then close stores.
    await runner.cleanup()
    log.info("stopped", extra={"step": "stopped"})


async def _init(db_path: Path, database_url: str | None) -> str:
    """Create the database and its token secret, or leave an existing one as it is: what
    `serve` does at start, without serving. So that a first token can be minted before the
    first start (`scripts/serve`), while `token` itself never creates a database.

    Returns the line to print: which of the two it was, so that a mistyped path (a new
    database) does not look like a start on the real one."""
    if database_url:
        from cv_server.pg.stores import set_up_deployment  # needs the postgres extra

        done = await set_up_deployment(database_url)
        if done.created:
            return f"set up schema {done.schema!r}"
        return f"schema {done.schema!r} is already set up; its token secret is kept"
    existed = _holds_a_secret(db_path)
    await set_up_sqlite_database(db_path)
    if existed:
        return f"{db_path} is already set up; its token secret is kept"
    return f"set up a new database at {db_path}"


def _holds_a_secret(db_path: Path) -> bool:
    """Whether `db_path` is a database with a token secret already (read only). A file SQLite
    cannot read is left to the open that follows, whose error is the one to report."""
    if not db_path.is_file():
        return False
    try:
        return read_sqlite_token_secret(db_path) is not None
    except DatabaseUnusable:
        return False


def _sqlite_token_secret(db_path: Path, command: str = "token") -> bytes:
    """The secret of the existing database `db_path`, read without writing a byte: only `init`
    and `serve` create a database. `token` created one for a mistyped `--db` (a new file with a new
    secret) and printed a token that no server accepts, with exit 0; into an unrelated SQLite
    file it wrote the server's tables. `command` names the one refused (`rotate-secret` too)."""
    if not db_path.exists():
        raise SystemExit(
            f"cv-server {command}: no database at {db_path} (a typo in --db?): create it with"
            f" `cv-server init --db {db_path}`"
        )
    if not db_path.is_file():  # SQLite's word for a directory is "disk I/O error"
        raise SystemExit(f"cv-server {command}: {db_path} is not a database file")
    try:
        secret = read_sqlite_token_secret(db_path)
    except DatabaseUnusable as exc:
        raise SystemExit(
            f"cv-server {command}: cannot read the token secret of {db_path}: {exc}"
        ) from None
    if secret is None:
        raise SystemExit(
            f"cv-server {command}: {db_path} holds no token secret: not a cv-server database, or"
            " one `cv-server init` (or `serve`) has not set up yet"
        )
    return secret


_ROTATED = "every token minted before is now refused: mint new ones with `cv-server token`"


def _rotate_sqlite(db_path: Path) -> str:
    """Replace the secret of the existing database `db_path`, unless a server is serving it.

    Refused while served: the embedded server reads the secret once, at start, and has no way
    to hear of a new one (no second process shares its file to tell it). Rotated under it, it
    would go on accepting every token of the old secret, the leaked one, while the operator
    believes them refused. Stopping it first is the honest order, and the restart takes
    seconds. The serving lock is held during the write, so no server can start meanwhile."""
    _sqlite_token_secret(db_path, "rotate-secret")  # an existing cv-server database, or refused
    try:
        lock = hold_serving_lock(db_path)
    except DatabaseUnusable:
        holder = Path(f"{db_path}.lock").read_text().strip() or "?"
        raise SystemExit(
            f"cv-server rotate-secret: {db_path} is being served by cv-server (pid {holder}):"
            " stop the server first, rotate, then start it again"
        ) from None
    try:
        rotated = rotate_sqlite_token_secret(db_path)
    except DatabaseUnusable as exc:
        raise SystemExit(
            f"cv-server rotate-secret: cannot replace the token secret of {db_path}: {exc}"
        ) from None
    finally:
        if lock is not None:
            lock.close()
    if not rotated:  # its secret went away since it was read: nothing was written
        raise SystemExit(f"cv-server rotate-secret: {db_path} holds no token secret")
    return f"replaced the token secret of {db_path}; {_ROTATED}"


def _rotate_postgres(database_url: str) -> str:
    try:
        _needs_asyncpg(database_url)
        from cv_server.pg.stores import rotate_token_secret  # needs the postgres extra

        schema = asyncio.run(rotate_token_secret(database_url))
    except _STARTUP_ERRORS as exc:
        raise SystemExit(
            f"cv-server rotate-secret: cannot rotate the token secret: {exc}"
        ) from None
    return (
        f"replaced the token secret of schema {schema!r}; {_ROTATED}"
        " (running instances follow without a restart)"
    )


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run the server on uvloop when it is installed (the `server` extra brings it): aiohttp's
    per-request cost is mostly event-loop work, which uvloop does in C."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before serving (waiting for the database, say)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        configure_logging(args.log_format, args.log_level)
        database_url = args.database_url and _with_schema(args.database_url, args.schema)
        try:
            config = dataclasses.replace(
                ServerConfig(db_path=args.db or DEFAULT_DB, database_url=database_url),
                **parse_overrides(args.set),
            )
        except ValueError as exc:  # a setting that cannot work (ServerConfig says which)
            raise SystemExit(f"cv-server: --set: {exc}") from None
        _run(_serve(config, args.host, args.port, args.log_format))
        return 0
    if args.command == "init":
        database_url = args.database_url and _with_schema(args.database_url, args.schema)
        try:
            _needs_asyncpg(database_url)
            done = asyncio.run(_init(args.db or DEFAULT_DB, database_url))
        except _STARTUP_ERRORS as exc:
            raise SystemExit(f"cv-server init: cannot set up the database: {exc}") from None
        print(f"cv-server init: {done}")
        return 0
    if args.command == "token" and args.token_command == "revoke":
        database_url = args.database_url and _with_schema(args.database_url, args.schema)
        try:
            _needs_asyncpg(database_url)
            done = token_commands.revoke(args, database_url, args.db or DEFAULT_DB)
        except _STARTUP_ERRORS as exc:
            raise SystemExit(f"cv-server token revoke: {exc}") from None
        print(f"cv-server token revoke: {done}", flush=True)
        return 0
    if args.command == "token":
        database_url = args.database_url and _with_schema(args.database_url, args.schema)
        # Before the database is read: the arguments alone are wrong.
        ttl = token_commands.check_mint_args(args.token_parser, args)
        if database_url:
            try:
                _needs_asyncpg(database_url)
                from cv_server.pg.stores import read_token_secret  # needs the postgres extra

                secret = asyncio.run(read_token_secret(database_url))
            except _STARTUP_ERRORS as exc:
                raise SystemExit(f"cv-server: cannot read the token secret: {exc}") from None
        else:
            secret = _sqlite_token_secret(args.db or DEFAULT_DB)
        token = token_commands.mint(secret, args, ttl)
        try:
            print(token, flush=True)
        except BrokenPipeError:
            return _reader_gone()
        return 0
    if args.command == "rotate-secret":
        database_url = args.database_url and _with_schema(args.database_url, args.schema)
        if database_url:
            done = _rotate_postgres(database_url)
        else:
            done = _rotate_sqlite(args.db or DEFAULT_DB)
        try:  # the secret is replaced by now: a reader gone only loses the report of it
            print(f"cv-server rotate-secret: {done}", flush=True)
        except BrokenPipeError:
            return _reader_gone()
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
