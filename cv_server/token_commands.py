"""`cv-server token` (mint) and `cv-server token revoke ID` (docs/operating.md, "Tokens and
scopes", "Revoking a token"). Split from `cv_server.cli` for length; the shared helpers (the
backend flags, reading the secret) stay there and are passed in."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from cv_server.auth import check_grant, mint_token, new_token_id, token_id_expiry, token_id_of
from cv_server.scopes import ALL_SCOPES
from cv_server.sqlite.revocations import revoke_in_file
from cv_server.stores import DatabaseUnusable

__all__ = ["DEFAULT_TTL_SECONDS", "add_token_parser", "mint", "revoke"]

#: A minted token's lifetime unless `--ttl` says otherwise: seven days. Long enough for a
#: deploy cycle (a worker's or CI's token is re-minted with each release), short enough that a
#: token nobody remembers dies on its own, and that the revocation list, whose entries last
#: until the token would have expired, stays small.
DEFAULT_TTL_SECONDS: Final = 7 * 24 * 3600

_NO_EXPIRY_WARNING: Final = (
    "cv-server token: warning: this token never expires; only `cv-server token revoke` (by its"
    " id) or `cv-server rotate-secret` (every token) withdraws it"
)


def add_token_parser(
    commands: Any,
    add_backend_args: Callable[[argparse.ArgumentParser], None],
    layout: dict[str, Any],
) -> argparse.ArgumentParser:
    token: argparse.ArgumentParser = commands.add_parser(
        "token",
        help="mint a bearer token (printed alone on stdout), or revoke one (`token revoke`)",
        **layout,
    )
    add_backend_args(token)
    token.add_argument(
        "--workspace",
        action="append",
        help="a workspace the token grants (repeatable; * grants every workspace; required)",
    )
    token.add_argument(
        "--scope",
        action="append",
        choices=sorted(ALL_SCOPES),
        help="what the token may do (repeatable; default: every scope). See docs/operating.md,"
        " 'Tokens and scopes'",
    )
    token.add_argument(
        "--sub-doc",
        action="append",
        help="limit the token to this sub-doc, or to those starting with a prefix given as"
        " 'notes*' (repeatable; default: every sub-doc)",
    )
    token.add_argument(
        "--ttl",
        type=float,
        default=None,
        help=f"seconds until it expires (default {DEFAULT_TTL_SECONDS}, seven days: a leaked or"
        " forgotten token dies on its own; 0 never expires, with a warning)",
    )
    token.add_argument(
        "--no-expiry",
        action="store_true",
        help="a token that never expires (as --ttl 0), with a warning on stderr",
    )
    actions = token.add_subparsers(dest="token_command", metavar="{revoke}")
    revoke_parser = actions.add_parser(
        "revoke",
        help="revoke one token by its id: refused on every server from the next request",
        **layout,
    )
    _add_backend_overrides(token, revoke_parser)
    revoke_parser.add_argument(
        "token_id",
        metavar="ID",
        help="the token's id (its `jti`, as the revoke route and docs/operating.md show), or the"
        " token itself",
    )
    return token


def _add_backend_overrides(
    token: argparse.ArgumentParser, revoke_parser: argparse.ArgumentParser
) -> None:
    """The backend flags again after `revoke`, with no default of their own: argparse lets a
    subcommand's defaults overwrite what the parent parsed, so `token --db X revoke ID` would
    otherwise revoke in the default file. A flag given on either side of `revoke` is used, the
    later one winning; the environment is the parent's default (tests/server/test_cli_token.py,
    `test_revoke_takes_backend_flags_on_either_side_of_the_subcommand`)."""
    for action in token._actions:
        if action.dest in ("db", "database_url", "schema"):
            typed: dict[str, Any] = {} if action.type is None else {"type": action.type}
            revoke_parser.add_argument(
                *action.option_strings,
                dest=action.dest,
                default=argparse.SUPPRESS,
                # The parent's "(env: CV_DB)" tail: the variable still applies, through it.
                help=f"as {action.option_strings[0]} before `revoke`"
                + (action.help or "")[(action.help or "").rfind(" (env: ") :],
                **typed,
            )


def ttl_of(args: argparse.Namespace) -> float | None:
    """The ttl the flags ask for (None: never), warning on stderr for a token that never
    expires."""
    if args.no_expiry or args.ttl == 0:
        print(_NO_EXPIRY_WARNING, file=sys.stderr, flush=True)
        return None
    return DEFAULT_TTL_SECONDS if args.ttl is None else args.ttl


def check_mint_args(token: argparse.ArgumentParser, args: argparse.Namespace) -> float | None:
    """Refuse arguments that cannot make a working token before the database is read; the
    ttl to mint with."""
    if not args.workspace:
        token.error("the following arguments are required: --workspace")
    ttl = None if (args.no_expiry or args.ttl == 0) else args.ttl
    try:
        check_grant(args.workspace, ttl, scopes=args.scope, sub_docs=args.sub_doc)
    except ValueError as exc:
        raise SystemExit(f"cv-server token: {exc}") from None
    return ttl_of(args)


def mint(secret: bytes, args: argparse.Namespace, ttl: float | None) -> str:
    """Mint the token the flags describe (its id, which `token revoke` takes, is inside)."""
    now = time.time()
    return mint_token(
        secret,
        args.workspace,
        now=now,
        ttl=ttl,
        scopes=args.scope,
        sub_docs=args.sub_doc,
        # Fresh, never derived: two tokens minted alike for two workers are revoked apart.
        token_id=new_token_id(None if ttl is None else int(now + ttl)),
    )


def revoke(args: argparse.Namespace, database_url: str | None, db_path: Path) -> str:
    """Revoke `args.token_id` in the database (a server serving it notices; docs/operating.md);
    the line to print."""
    try:
        token_id = token_id_of(args.token_id) if "." in args.token_id else args.token_id
        expires_at = token_id_expiry(token_id)
    except ValueError as exc:
        raise SystemExit(f"cv-server token revoke: {exc}") from None
    if database_url:
        from cv_server.pg.stores import revoke_token_in  # needs the postgres extra

        schema, newly = asyncio.run(revoke_token_in(database_url, token_id, expires_at))
        where = f"schema {schema!r}"
    else:
        if not db_path.exists():
            raise SystemExit(f"cv-server token revoke: {db_path} does not exist")
        try:
            newly = revoke_in_file(db_path, token_id, expires_at)
        except DatabaseUnusable as exc:
            raise SystemExit(f"cv-server token revoke: cannot write {db_path}: {exc}") from None
        where = str(db_path)
    already = "" if newly else " (it was already)"
    return f"revoked {token_id} in {where}{already}; servers refuse it from now on"
