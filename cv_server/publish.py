"""Commit, then publish: the one step every write route takes (docs/concepts.md).

An op is broadcast to subscribers only once its commit is durable, and every commit's outcomes
are counted. The HTTP route (`cv_server.http.docs`) and the websocket (`cv_server.http.socket`)
both write through here, so neither can publish what was not committed
(tests/server/test_oplog_pipeline.py, tests/server/http/test_socket_ordering.py).
"""

from __future__ import annotations

from aiohttp import web

from cv_server.keys import HUB, METRICS, STORES
from cv_server.oplog import AppendEnqueued, IncomingOp, LogEntry, Outcome, Rejected
from cv_server.oplog.pipeline import VERSION_CONFLICT
from cv_server.queue.model import EnqueueAsk

__all__ = ["commit_and_publish", "commit_enqueue_and_publish", "conflict_of", "publish"]


def conflict_of(outcomes: list[Outcome]) -> Rejected | None:
    """The `version_conflict` of a compare-and-set append, if it met one: the whole request is
    then answered 409 (a socket: an `error` frame) carrying the head clock (docs/ops.md#conflicts).
    """
    for outcome in outcomes:
        if type(outcome) is Rejected and outcome.code == VERSION_CONFLICT:
            return outcome
    return None


async def commit_and_publish(
    app: web.Application,
    workspace_id: str,
    sub_doc: str,
    ops: list[IncomingOp],
    atomic: bool,
    if_clock: int | None = None,
) -> list[Outcome]:
    """Commit, and only once the commit is durable, publish (docs/concepts.md).

    Shielded by callers: a client that hangs up mid-request must not cancel the publish of a
    commit that happened anyway.
    """
    outcomes, entries = await app[STORES].oplog.append(
        workspace_id, sub_doc, ops, atomic=atomic, if_clock=if_clock
    )
    publish(app, workspace_id, sub_doc, outcomes, entries)
    return outcomes


async def commit_enqueue_and_publish(
    app: web.Application,
    workspace_id: str,
    sub_doc: str,
    ops: list[IncomingOp],
    enqueue: list[EnqueueAsk],
    atomic: bool,
    if_clock: int | None = None,
) -> AppendEnqueued:
    """`commit_and_publish` for an apply with `enqueue`: the ops and the requests commit in one
    transaction (`OpLogStore.append_enqueuing`, which announces the requests to the queue's
    listeners after it); the ops are broadcast after it too. Shielded by callers, as that."""
    done = await app[STORES].oplog.append_enqueuing(
        workspace_id, sub_doc, ops, enqueue, atomic=atomic, if_clock=if_clock
    )
    publish(app, workspace_id, sub_doc, done.outcomes, done.entries)
    return done


def publish(
    app: web.Application,
    workspace_id: str,
    sub_doc: str,
    outcomes: list[Outcome],
    entries: list[LogEntry],
) -> None:
    """Broadcast what a commit produced and count its outcomes: right after the commit is
    durable, never before (docs/concepts.md)."""
    app[HUB].publish(workspace_id, sub_doc, entries)
    app[METRICS].record_outcomes(outcomes)
