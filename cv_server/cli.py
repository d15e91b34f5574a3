"""`cv-server`: serve the op-log, mint tokens (DESIGN §12)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from cv_server.app import create_app
from cv_server.auth import mint_token
from cv_server.backends import open_sqlite_database
from cv_server.config import ServerConfig
from cv_server.meta import sqlite_token_secret

__all__ = ["main"]

DEFAULT_DB = Path("data/cv.db")


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", type=Path, default=None, help=f"SQLite file (default {DEFAULT_DB})")
    parser.add_argument(
        "--database-url", default=None, help="PostgreSQL DSN; wins over --db (scale-out backend)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cv-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server")
    _add_backend_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    serve.add_argument("--log-level", default="INFO")

    token = commands.add_parser("token", help="mint a bearer token (printed alone on stdout)")
    _add_backend_args(token)
    token.add_argument("--workspace", action="append", required=True, help="repeatable; * = all")
    token.add_argument("--ttl", type=float, default=None, help="seconds until it expires")
    return parser


async def _serve(config: ServerConfig, host: str, port: int) -> None:
    app = create_app(config)
    # The drain deadline of seed 004 bounds how long in-flight requests may take to finish.
    runner = web.AppRunner(app, shutdown_timeout=config.drain_seconds, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    print(f"cv-server listening on http://{host}:{bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Stop accepting, close sockets with 1001, let in-flight commits finish, then close stores.
    await runner.cleanup()


async def _token(db_path: Path, workspaces: list[str], ttl: float | None) -> str:
    db = await open_sqlite_database(str(db_path))
    try:
        secret = await sqlite_token_secret(db)
    finally:
        await db.close()
    return mint_token(secret, workspaces, now=time.time(), ttl=ttl)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
        config = ServerConfig(db_path=args.db or DEFAULT_DB, database_url=args.database_url)
        asyncio.run(_serve(config, args.host, args.port))
        return 0
    if args.command == "token":
        if args.database_url:
            print("cv-server token: --database-url is not supported yet", file=sys.stderr)
            return 2
        print(asyncio.run(_token(args.db or DEFAULT_DB, args.workspace, args.ttl)))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
