"""cv_mutations: typed workspace ops with an `OpIdEnvelope`, and the pure reducers that apply them.

See docs/concepts.md. Everything here is pure: no I/O, no clock, no asyncio. Two modules are not
about ops, and are not imported here: `cv_mutations.logs` (the log line formats both packages'
commands write) and `cv_mutations.cli_flags` (the flags both declare with an environment variable).
"""

from cv_mutations.envelope import META_MAX_BYTES, OpIdEnvelope
from cv_mutations.fingerprint import canonical_json, fingerprint
from cv_mutations.ids import (
    is_valid_sub_doc,
    is_valid_workspace_id,
    new_op_id,
)
from cv_mutations.ops import (
    OP_ADAPTER,
    OP_TYPES,
    InvalidOp,
    NodeDelete,
    NodeIncrement,
    NodeInsert,
    NodeMove,
    NodeUpdate,
    Op,
    parse_op,
)
from cv_mutations.reducers import REJECTION_CODES, OpRejected, Undo, apply_op
from cv_mutations.state import ROOT, InvalidState, Node, SubDocState

__all__ = [
    "META_MAX_BYTES",
    "OP_ADAPTER",
    "OP_TYPES",
    "REJECTION_CODES",
    "ROOT",
    "InvalidOp",
    "InvalidState",
    "Node",
    "NodeDelete",
    "NodeIncrement",
    "NodeInsert",
    "NodeMove",
    "NodeUpdate",
    "Op",
    "OpIdEnvelope",
    "OpRejected",
    "SubDocState",
    "Undo",
    "apply_op",
    "canonical_json",
    "fingerprint",
    "is_valid_sub_doc",
    "is_valid_workspace_id",
    "new_op_id",
    "parse_op",
]
