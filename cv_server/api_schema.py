"""`python -m cv_server.api_schema --check | --write`: the checked-in `schemas/openapi.json`
against the document the server's routes generate (`cv_server.http.openapi`).

The shell around the document builder: it builds an app and hands it to `build_document`, so
`cv_server.http.openapi` never imports `cv_server.app` (which imports it for `@documented`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web

from cv_server.app import create_app
from cv_server.config import ServerConfig
from cv_server.http.openapi import (
    OPENAPI_PATH,
    build_document,
    render_document,
    undocumented_routes,
)

__all__ = ["main"]


def _app() -> web.Application:
    # Never started: the stores open in the app's cleanup context, so the path is not touched.
    return create_app(ServerConfig(db_path=Path("unused.db"), token_secret=b"x" * 32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cv_server.api_schema",
        description="Write or check schemas/openapi.json against the server's routes.",
    )
    parser.add_argument("--write", action="store_true", help="regenerate the checked-in file")
    parser.add_argument("--check", action="store_true", help="exit 1 if it is out of date")
    parser.add_argument("--path", type=Path, default=OPENAPI_PATH)
    args = parser.parse_args(argv)
    app = _app()
    missing = undocumented_routes(app)
    if missing:
        print(f"routes without @documented: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render_document(build_document(app))
    if args.write:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(text, encoding="utf-8")
        return 0
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(
                f"{args.path.name} is out of date: run python -m cv_server.api_schema --write",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
