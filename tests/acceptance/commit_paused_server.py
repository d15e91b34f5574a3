"""`cv-server` that stops answering once a commit to the sub-doc `PAUSED_SUB_DOC` is durable: for
the acceptance test that SIGKILLs a server between committing an apply and answering it.

Usage: python -m tests.acceptance.commit_paused_server MARKER <cv-server arguments>

It wraps `cv_server.publish.publish`, which runs right after the commit and before the answer:
for that sub-doc it writes MARKER (the commit is durable) and blocks the event loop, so no answer
is ever sent. Test-only: it lives in the tests, and the product has no such hook.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import cv_server.publish
from cv_server.cli import main as cv_server_main

__all__ = ["PAUSED_SUB_DOC"]

PAUSED_SUB_DOC = "paused"
#: Far longer than any test waits: the test SIGKILLs the process long before.
_FROZEN_SECONDS = 600.0


def main(argv: list[str]) -> int:
    marker = Path(argv[0])
    publish = cv_server.publish.publish

    def publish_then_freeze(
        app: Any, workspace_id: str, sub_doc: str, outcomes: Any, entries: Any
    ) -> None:
        if sub_doc == PAUSED_SUB_DOC and entries:
            marker.write_text("committed\n")
            time.sleep(_FROZEN_SECONDS)  # blocks the loop: nothing is published nor answered
        publish(app, workspace_id, sub_doc, outcomes, entries)

    cv_server.publish.publish = publish_then_freeze
    return cv_server_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
