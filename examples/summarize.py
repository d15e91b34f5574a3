"""A stage that summarizes a note once, however many workers race for it (docs/stages.md)."""

from __future__ import annotations

from typing import Any

from cv_mutations import NodeInsert, NodeUpdate
from cv_workspace_client import ExpectedError, OpRejectedError, Stage, StageContext

NOTES = "notes"  # the sub-doc: one node per note, its summary a field of it


async def summarize(ctx: StageContext) -> dict[str, Any]:
    text = ctx.input.get("text") if isinstance(ctx.input, dict) else None
    if not isinstance(text, str) or not text or ctx.job_id is None:
        # An answer, not a failure: the request completes with this error and is never retried.
        raise ExpectedError("invalid_input", "needs a job_id and an input {'text': '...'}")
    if ctx.provider is None:
        raise RuntimeError("start cv-worker with --provider")  # a failure: retried, maybe elsewhere
    provider, note = ctx.provider, ctx.job_id

    try:  # a write under an op_id derived from (request, run, key): a re-driven run dedupes
        await ctx.apply_op(NOTES, NodeInsert(node_id=note, parent_id="root"), key="note")
    except OpRejectedError as exc:
        if exc.code != "node_exists":  # another request made the note first: just as good
            raise

    async def check() -> str | None:  # the value if it is already there
        _, state = await ctx.client.get_state(ctx.workspace_id, NOTES)
        summary = state.nodes[note].fields.get("summary")
        return summary if isinstance(summary, str) else None

    async def compute() -> str:  # the paid call and its write, under the compute lock
        answer = await provider.complete(f"Summarize in one line:\n\n{text}")
        update = NodeUpdate(node_id=note, set={"summary": answer.text})
        await ctx.apply_op(NOTES, update, key="summary")
        return answer.text

    # At most one compute per (workspace, note, "summary"); a racer waits for the holder's write.
    result = await ctx.compute(
        note, "summary", check=check, compute=compute, sub_doc=NOTES, wait=60
    )
    if result.status == "locked":  # still being computed elsewhere: fail, the queue re-drives it
        raise RuntimeError(f"the summary of {note} is still being computed elsewhere")
    return {"note": note, "summary": result.value, "computed": result.status == "computed"}


STAGES = {"summarize": Stage(summarize)}
