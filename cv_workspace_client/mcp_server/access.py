"""Which tools the MCP server's token lets it offer (docs/mcp.md, "Tools and scopes").

Each tool needs one of the scopes of the server route it calls (docs/operating.md, "Tokens and
scopes"); the server offers only the tools its token allows and says in its instructions which
it left out and why. The token's scopes are read from its own payload without the secret: it is
this client's token, and the server still checks every call. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from typing import Final

__all__ = ["TOOL_SCOPES", "hidden_tools_note", "token_scopes", "tool_allowed"]

#: tool -> the scopes that may call it (any one), as the routes it calls require them.
TOOL_SCOPES: Final[dict[str, frozenset[str]]] = {
    "get_state": frozenset({"read"}),
    "read_ops": frozenset({"read"}),
    "apply_ops": frozenset({"write"}),
    "enqueue": frozenset({"enqueue"}),
    "get_request": frozenset({"enqueue", "operate"}),
    "wait_request": frozenset({"enqueue", "operate"}),
    "cancel_request": frozenset({"enqueue", "operate"}),
    "list_requests": frozenset({"operate"}),
    "replay_request": frozenset({"operate"}),
    "discard_request": frozenset({"operate"}),
    "add_schedule": frozenset({"enqueue"}),
    "list_schedules": frozenset({"enqueue", "operate"}),
    "pause_schedule": frozenset({"enqueue", "operate"}),
    "resume_schedule": frozenset({"enqueue", "operate"}),
    "delete_schedule": frozenset({"enqueue", "operate"}),
    "run_schedule": frozenset({"enqueue"}),
}


def token_scopes(token: str | None) -> frozenset[str] | None:
    """The scopes `token` names (`sc` in its payload), or None when it names none or cannot be
    read: every scope (a token minted before scopes, or one supplied later by a provider)."""
    if token is None:
        return None
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, binascii.Error):
        return None
    scopes = payload.get("sc") if isinstance(payload, dict) else None
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        return None
    return frozenset(scopes)


def tool_allowed(tool: str, scopes: frozenset[str] | None) -> bool:
    """Whether a token with `scopes` (None: all) may call `tool`."""
    return scopes is None or not scopes.isdisjoint(TOOL_SCOPES[tool])


def hidden_tools_note(tools: Iterable[str], scopes: frozenset[str] | None) -> str:
    """One sentence naming the tools left out for `scopes` and the scope each needs ("" when
    none is)."""
    hidden = [
        f"{tool} (needs the {' or '.join(sorted(TOOL_SCOPES[tool]))} scope)"
        for tool in tools
        if not tool_allowed(tool, scopes)
    ]
    if not hidden:
        return ""
    return " This server's token does not allow, so it does not offer: " + ", ".join(hidden) + "."
