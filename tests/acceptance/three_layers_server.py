"""The real server app (`create_app`) as a process, with the default durations shrunk so a
SIGKILLed worker's lease and locks lapse within the test's time bound. `cv-server serve` has no
flags for them (and `short_server` none for the lock TTL); everything else is `cv-server serve`'s
own path: the same app, run by the same function.

Usage: python -m tests.acceptance.three_layers_server --db PATH --port P
           [--lease S] [--lock-ttl S] [--backoff S]
Prints `cv-server listening on http://127.0.0.1:P` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from cv_server.cli import _serve
from cv_server.config import ServerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lease", type=float, default=120.0)
    parser.add_argument("--lock-ttl", type=float, default=60.0)
    parser.add_argument("--backoff", type=float, default=30.0)
    args = parser.parse_args()
    config = ServerConfig(
        db_path=args.db,
        lease_seconds=args.lease,
        compute_lock_ttl_seconds=args.lock_ttl,
        failure_backoff_seconds=args.backoff,
    )
    # Run exactly as `cv-server serve` runs the app (banner, signals, drain).
    asyncio.run(_serve(config, "127.0.0.1", args.port))


if __name__ == "__main__":
    main()
