"""`python -m cv_server.api_schema --check | --write`: the checked-in `schemas/openapi.json`
against the document the server's routes generate (`cv_server.openapi`)."""

from __future__ import annotations

from cv_server.openapi import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
