"""Identifier rules shared by every package (docs/concepts.md).

Kept in one place so the server, the client and the schemas can never disagree on what a valid
workspace, sub-doc, node or op id is.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from nanoid import generate as _nanoid_generate
from pydantic import StringConstraints

__all__ = [
    "NANOID_ALPHABET",
    "ClientId",
    "NodeId",
    "OpId",
    "SubDocId",
    "WorkspaceId",
    "is_valid_sub_doc",
    "is_valid_workspace_id",
    "new_op_id",
]

#: The nanoid default alphabet: URL-safe, so an op_id can travel in a path or a header unescaped.
NANOID_ALPHABET: Final = "_-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: A minted op_id: 21 chars of a 64-symbol alphabet is 126 bits, collision-free in practice.
OP_ID_LENGTH: Final = 21

OP_ID_PATTERN: Final = r"^[A-Za-z0-9_-]{8,64}$"
WORKSPACE_ID_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
SUB_DOC_PATTERN: Final = r"^[a-z0-9_.-]{1,64}$"
NODE_ID_PATTERN: Final = r"^[A-Za-z0-9_.:-]{1,128}$"

#: A client's id: the op_id alphabet and lengths (the SDK mints one like an op_id).
CLIENT_ID_PATTERN: Final = OP_ID_PATTERN
ClientId = Annotated[str, StringConstraints(pattern=CLIENT_ID_PATTERN)]
OpId = Annotated[str, StringConstraints(pattern=OP_ID_PATTERN)]
WorkspaceId = Annotated[str, StringConstraints(pattern=WORKSPACE_ID_PATTERN)]
SubDocId = Annotated[str, StringConstraints(pattern=SUB_DOC_PATTERN)]
NodeId = Annotated[str, StringConstraints(pattern=NODE_ID_PATTERN)]

_WORKSPACE_RE: Final = re.compile(WORKSPACE_ID_PATTERN)
_SUB_DOC_RE: Final = re.compile(SUB_DOC_PATTERN)


def new_op_id() -> str:
    """Mint a fresh op_id (a 21-char nanoid).

    Call it once per user intent, *before* the op is first sent, and keep the result with the op
    for every retry and replay: a second mint for the same intent is what makes a retry apply twice.
    """
    return str(_nanoid_generate(NANOID_ALPHABET, OP_ID_LENGTH))


def is_valid_workspace_id(value: str) -> bool:
    return _WORKSPACE_RE.fullmatch(value) is not None


def is_valid_sub_doc(value: str) -> bool:
    return _SUB_DOC_RE.fullmatch(value) is not None
