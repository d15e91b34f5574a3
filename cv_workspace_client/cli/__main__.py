"""`python -m cv_workspace_client.cli worker|workspace ARGS`: either command, without its console
script."""

from __future__ import annotations

import sys

from cv_workspace_client.cli.conventions import EXIT_USAGE
from cv_workspace_client.cli.worker import worker_main
from cv_workspace_client.cli.workspace import workspace_main

__all__ = ["main"]


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
