"""What the outbox machine writes to and reads from the wire, without I/O: an op's body encoded
once (as the outbox stores it and the server receives it) and a batch's answer checked against
the request it answers. Pure functions; the machine (`_core/machine.py`) decides what follows."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from cv_workspace_client._core.effects import OutboxRow
from cv_workspace_client.errors import (
    OpRejectedError,
    ProtocolError,
    VersionConflictError,
    WorkspaceError,
)
from cv_workspace_client.models import Commit

__all__ = ["commit_time", "dumps_body", "parse_results", "row_size"]


def commit_time(value: Any) -> float | None:
    """An op frame's or log entry's `committed_at` (Unix seconds), or None when the server sent
    none or something that is not a finite number: it is informative, never worth refusing an op
    over (`test_a_commit_time_that_is_absent_or_not_a_number_reads_as_none`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) else None


def dumps_body(body: dict[str, Any]) -> str:
    """Compact UTF-8 JSON, as `json.dumps(separators=(",", ":"), ensure_ascii=False)` writes it
    (orjson is ~15x faster; it refuses integers past 64 bits, which the standard library takes)."""
    try:
        return orjson.dumps(body).decode()
    except orjson.JSONEncodeError:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def row_size(row: OutboxRow) -> int:
    """The op's bytes on the wire: what batches are packed by."""
    return len(row.op_json.encode())


def parse_results(
    op_ids: Sequence[str], results: Any
) -> list[Commit | WorkspaceError] | WorkspaceError:
    """One outcome per op of the batch (in its order), or a `ProtocolError` if the answer does
    not fit the request."""
    if not isinstance(results, list) or len(results) != len(op_ids):
        count = len(results) if isinstance(results, list) else "no"
        return ProtocolError("bad_results", f"{count} results for a batch of {len(op_ids)} ops")
    outcomes: list[Commit | WorkspaceError] = []
    for op_id, result in zip(op_ids, results, strict=True):
        # The server names the op every result answers: one that does not (a proxy that
        # rewrote the answer) could be answering another op of the batch, reordered.
        if not isinstance(result, Mapping) or result.get("op_id") != op_id:
            return ProtocolError("bad_results", f"result does not answer op {op_id}")
        error = result.get("error")
        if isinstance(error, Mapping) and error.get("code") == "version_conflict":
            clock = error.get("clock")
            outcomes.append(
                VersionConflictError(
                    str(error.get("message") or ""),
                    clock=clock if type(clock) is int else None,
                    op_id=op_id,
                )
            )
            continue
        if isinstance(error, Mapping):
            outcomes.append(
                OpRejectedError(
                    str(error.get("code") or "rejected"),
                    str(error.get("message") or ""),
                    op_id=op_id,
                )
            )
            continue
        clock = result.get("clock")
        if "clock" in result and clock is None and result.get("duplicate") is True:
            # A lane op decided before and no longer on record (docs/client.md#exactly-once):
            # acknowledged, never applied again; its clock is not known any more. Only the
            # explicit `"clock": null` says so: an answer with no clock at all does not fit
            # the request and is resent (tests/client/core/test_machine_hostile_answers.py).
            outcomes.append(Commit(clock=0, op_id=op_id, duplicate=True))
            continue
        if not isinstance(clock, int) or isinstance(clock, bool) or clock < 1:
            return ProtocolError("bad_results", f"result for op {op_id} has no valid clock")
        outcomes.append(Commit(clock=clock, op_id=op_id, duplicate=bool(result.get("duplicate"))))
    return outcomes
