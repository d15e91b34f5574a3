"""What a token may do and to which sub-docs (docs/operating.md, "Tokens and scopes").

Pure values shared by the token format (`cv_server.auth`), the route table
(`cv_server.http.routes.ROUTE_SCOPES`) and the socket's frames: a leaf, so nothing here imports
the HTTP edge.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, get_args

__all__ = [
    "ALL_SCOPES",
    "SUB_DOC_GRANT_PATTERN",
    "Scope",
    "check_scopes",
    "check_sub_doc_grants",
    "enqueue_grant",
    "grant_allows_sub_doc",
    "grant_scope_key",
    "sub_doc_granted",
]

#: `read`: a sub-doc's state and log, subscribe; `write`: apply ops; `enqueue`: enqueue and
#: read, wait on and cancel requests; `work`: claim, heartbeat, complete, fail, results, compute
#: locks; `operate`: the queue listing, replay, discard, cancel of any request, locks listing,
#: token revocation.
Scope = Literal["read", "write", "enqueue", "work", "operate"]
ALL_SCOPES: Final[frozenset[str]] = frozenset(get_args(Scope))

#: A sub-doc grant: an exact sub-doc id (`[a-z0-9_.-]{1,64}`), or a prefix ending in `*`
#: (`notes*` grants `notes`, `notes.2024`, `notes-x`...). `*` is never part of a sub-doc id,
#: so the two forms cannot be confused; `*` alone grants every sub-doc.
SUB_DOC_GRANT_PATTERN: Final = r"^[a-z0-9_.-]{0,64}\*$|^[a-z0-9_.-]{1,64}$"
_GRANT_RE: Final = re.compile(SUB_DOC_GRANT_PATTERN)


def check_scopes(scopes: Iterable[str]) -> None:
    """Raise `ValueError` unless `scopes` is a non-empty set of known scopes."""
    scopes = list(scopes)
    if not scopes:
        raise ValueError("a token must carry at least one scope")
    unknown = sorted(set(scopes) - ALL_SCOPES)
    if unknown:
        raise ValueError(
            f"unknown scope {unknown[0]!r}: expected one of {', '.join(sorted(ALL_SCOPES))}"
        )


def check_sub_doc_grants(grants: Iterable[str]) -> None:
    """Raise `ValueError` unless each grant is a sub-doc id or a prefix ending in `*`."""
    grants = list(grants)
    if not grants:
        raise ValueError("a sub-doc limit must name at least one sub-doc or prefix")
    for grant in grants:
        if _GRANT_RE.fullmatch(grant) is None:
            raise ValueError(
                f"sub-doc grant {grant!r} must be a sub-doc id ([a-z0-9_.-]{{1,64}}) or a"
                " prefix of one followed by '*'"
            )


def sub_doc_granted(grants: frozenset[str] | None, sub_doc: str) -> bool:
    """Whether `sub_doc` is inside `grants` (None: no limit, every sub-doc)."""
    if grants is None or sub_doc in grants:
        return True
    return any(g.endswith("*") and sub_doc.startswith(g[:-1]) for g in grants)


def enqueue_grant(scopes: frozenset[str], sub_docs: frozenset[str] | None) -> dict[str, Any] | None:
    """The grant a request records from its enqueuer's verified token (docs/queue.md, "Whose
    grant a stage runs under"): `{"scopes": [...], "sub_docs": [...] | null}`, or None for a
    token with every scope and every sub-doc, whose requests keep the ids they always had."""
    if scopes >= ALL_SCOPES and sub_docs is None:
        return None
    return {"scopes": sorted(scopes), "sub_docs": None if sub_docs is None else sorted(sub_docs)}


def grant_scope_key(grant: Mapping[str, Any] | None) -> str | None:
    """A short key naming `grant` (None for the full grant): part of a deterministic request id
    and of compute-lock keys, so that work done under one grant is never shared with another
    (tests/worker/test_enqueue_grant.py)."""
    if grant is None:
        return None
    canonical = json.dumps(grant, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def grant_allows_sub_doc(grant: Mapping[str, Any] | None, sub_doc: str) -> bool:
    """Whether a request enqueued under `grant` may have `sub_doc` read or written for it."""
    if grant is None:
        return True
    grants = grant.get("sub_docs")
    return sub_doc_granted(None if grants is None else frozenset(grants), sub_doc)
