"""How a command reaches the server: `--url`, and the bearer token from `--token` or from
`--token-file`, which `cv-worker` and `cv-workspace mcp` read again whenever the server refuses the
token they hold (a file a secret manager rotates in place; docs/operating.md). A path in the URL
is kept as a prefix of every route (a server behind a reverse proxy at `https://gateway/cv`).
"""

from __future__ import annotations

import argparse
import asyncio
import re

from cv_mutations.cli_flags import add_argument
from cv_workspace_client._core.url import check_server_url
from cv_workspace_client._io.auth import TokenProvider
from cv_workspace_client._io.retry import backoff_for
from cv_workspace_client.cli.conventions import UsageError
from cv_workspace_client.config import ClientConfig

__all__ = ["add_connection_args", "need_token", "need_url", "token_file_provider"]


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """`--url`, `--token`, `--token-file` (each with its environment variable) and `--json` on
    `parser`; the command then checks them with `need_url` and `need_token`."""
    add_argument(parser, "--url", envvar="CV_URL", help="the server's http(s) URL")
    add_argument(
        parser,
        "--token",
        envvar="CV_TOKEN",
        help="bearer token; prefer --token-file: a flag shows in `ps`",
    )
    add_argument(
        parser,
        "--token-file",
        envvar="CV_TOKEN_FILE",
        help="file holding the token, read again whenever the server refuses it: a token a "
        "secret manager rotates in place",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print errors as a JSON object on stderr instead of one line of text",
    )


def need_url(args: argparse.Namespace) -> str:
    """The server URL the command was given, checked.

    Raises:
        UsageError: if there is none, or it is not an http(s) URL a client can use.
    """
    if not args.url:
        raise UsageError("--url (or $CV_URL) is required")
    try:
        check_server_url(str(args.url))
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    return str(args.url)


#: RFC 6750's b64token: what a bearer token may hold (`cv-server token` mints within it).
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def need_token(args: argparse.Namespace) -> str:
    """Every route the commands call needs the token: a missing one was the server's 401 (exit
    1, as if refused), and one with a newline or a non-ASCII character a traceback from aiohttp
    (which refuses such a header). Never quoted back: it is a secret."""
    if args.token_file:
        if args.token:
            raise UsageError("give --token ($CV_TOKEN) or --token-file ($CV_TOKEN_FILE), not both")
        return _read_token_file(str(args.token_file))
    if not args.token:
        raise UsageError("--token, $CV_TOKEN, --token-file or $CV_TOKEN_FILE is required")
    if not _BEARER_TOKEN.fullmatch(str(args.token)):
        raise UsageError(
            "--token (or $CV_TOKEN) is not a bearer token: letters, digits and -._~+/ only "
            "(a stray newline or space?)"
        )
    return str(args.token)


def _read_token_file(path: str) -> str:
    """The token in `path`, without the line end editors and `echo` add."""
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--token-file {path!r} cannot be read: {exc}") from None
    if not _BEARER_TOKEN.fullmatch(token):
        raise UsageError(f"--token-file {path!r} does not hold a bearer token")
    return token


def token_file_provider(path: str, config: ClientConfig | None = None) -> TokenProvider:
    """A `token_provider` that reads `path` again: when the server refuses the token, the file
    may hold a fresh one by now (a Kubernetes projected token, a Vault agent's sink).

    A file caught mid-rotation (a writer that truncates, then writes; one that removes, then
    creates) is read again with the client's retry policy (`config`: full jitter,
    `retry_attempts` reads). Read once, its empty content failed the refresh, the refused
    claim stood, and the worker stopped with exit 1 on a rotation that was going well."""
    policy = config or ClientConfig()
    backoff = backoff_for(policy)

    async def read() -> str:
        failures = 0
        while True:
            try:
                return await asyncio.to_thread(_read_token_file, path)
            except UsageError:
                failures += 1
                if failures >= policy.retry_attempts:
                    raise
            await policy.sleep(backoff(failures))

    return read
