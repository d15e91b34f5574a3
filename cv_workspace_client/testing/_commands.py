"""The `cv-server` command lines `LocalServer` runs and the one line it reads back: pure, no
process, socket or clock (tests/client/testing/test_commands.py).

`cv-server serve --port 0` binds a free port itself and prints `cv-server listening on URL`
once it accepts connections: the harness reads the port from that line instead of picking one
and hoping nobody takes it before the bind (docs/operating.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Backend",
    "SettingValue",
    "child_environment",
    "listening_url",
    "serve_args",
    "token_args",
]

#: A `ServerConfig` setting's value as `--set NAME=VALUE` takes it: a number, or `"off"` for
#: one that may be switched off (docs/configuration.md).
SettingValue = int | float | str

_LISTENING = re.compile(r"^cv-server listening on (http://\S+?)/?\s*$")


@dataclass(frozen=True)
class Backend:
    """Where the server keeps its data: the SQLite file `db`, or the PostgreSQL `database_url`
    (which wins; `schema` names an existing schema there, docs/postgres.md)."""

    db: Path | None = None
    database_url: str | None = None
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.db is None and self.database_url is None:
            raise ValueError("a backend needs an SQLite file (db) or a database_url")
        if self.schema is not None and self.database_url is None:
            raise ValueError("schema applies to a database_url only")

    def args(self) -> list[str]:
        """The backend flags every `cv-server` command takes."""
        if self.database_url is not None:
            schema = ["--schema", self.schema] if self.schema is not None else []
            return ["--database-url", self.database_url, *schema]
        return ["--db", str(self.db)]


def serve_args(
    backend: Backend, *, settings: Mapping[str, SettingValue] = {}, log_level: str = "INFO"
) -> list[str]:
    """`cv-server serve` on a free loopback port (`--port 0`), with each setting as `--set`."""
    overrides = [arg for name, value in settings.items() for arg in ("--set", f"{name}={value}")]
    return [
        "serve",
        *backend.args(),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        log_level,
        *overrides,
    ]


def token_args(backend: Backend, workspaces: Iterable[str], ttl: float | None = None) -> list[str]:
    """`cv-server token`: a token granting each of `workspaces` (`*`: all), expiring after `ttl`
    seconds (never without one).

    Raises:
        ValueError: if `workspaces` is empty.
    """
    grants = [arg for workspace in workspaces for arg in ("--workspace", workspace)]
    if not grants:
        raise ValueError("a token grants at least one workspace ('*' grants them all)")
    expiry = ["--ttl", repr(float(ttl))] if ttl is not None else []
    return ["token", *backend.args(), *grants, *expiry]


def listening_url(line: str) -> str | None:
    """The URL in `serve`'s `cv-server listening on URL` line, or None for any other line."""
    match = _LISTENING.match(line)
    return match.group(1) if match else None


def child_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """`parent` without its `CV_*` variables: the server the harness starts is configured by the
    harness's flags alone, never by a `CV_PORT` or `CV_SCHEMA` the test run happens to carry."""
    return {name: value for name, value in parent.items() if not name.startswith("CV_")}
