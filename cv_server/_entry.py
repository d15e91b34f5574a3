"""The `cv-server` console script: names the missing extra before anything imports it.

`pip install cv-workspace` alone installs the SDK; the server's backends need the `server` extra
(sqlite-utils, uvloop, prometheus-client). Without it every command, `--help` included, prints
which extra to install and exits 2 (tests/test_packaging.py)."""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["main"]

#: Modules of the `server` extra that `cv-server` cannot run without.
SERVER_EXTRA_MODULES = ("sqlite_utils", "prometheus_client")

EXIT_USAGE = 2


def missing_server_extra() -> list[str]:
    """The `server` extra's modules that are not installed."""
    return [name for name in SERVER_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    missing = missing_server_extra()
    if missing:
        print(
            # This interpreter's pip: it sees the installed cv-workspace, so it needs no index
            # to add the extra (docs/install.md; tests/test_packaging.py).
            f"cv-server: the server needs the `server` extra ({', '.join(missing)} is not"
            f" installed): {sys.executable} -m pip install 'cv-workspace[server]'"
            " ('cv-workspace[server,postgres]' for PostgreSQL)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from cv_server.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
