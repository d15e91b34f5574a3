"""`Reads`, the part of `WorkspaceClient` that reads: a sub-doc's state and its log, retried like
any idempotent request (full jitter, `retry_attempts` tries), and the log reads a subscription
catches up with (retried for as long as the server is down)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cv_mutations import SubDocState, is_valid_sub_doc, is_valid_workspace_id
from cv_workspace_client._io.http import HttpApi, log_answer, state_answer
from cv_workspace_client._io.retry import retrying
from cv_workspace_client.config import ClientConfig
from cv_workspace_client.errors import InvalidRequestError, LogCompactedError
from cv_workspace_client.models import Committed, Snapshot

__all__ = ["Reads", "check_ids"]


class Reads:
    """Reads over the `HttpApi` that `api()` gives (it raises while the client is not open),
    retried under `config`'s policy."""

    def __init__(self, config: ClientConfig, api: Callable[[], HttpApi]) -> None:
        self.config = config
        self._api = api

    async def get_state(self, workspace_id: str, sub_doc: str) -> tuple[int, SubDocState]:
        """The sub-doc's head clock and state (retried like any idempotent read)."""
        check_ids(workspace_id, sub_doc)
        http = self._api()
        result: tuple[int, SubDocState] | None = None
        async for attempt in retrying(self.config):
            with attempt:
                # Read inside the attempt: an answer that does not fit (a proxy's, a half-deployed
                # server's) is retried like one that never came, not raised at the first try.
                result = state_answer(await http.get_state(workspace_id, sub_doc))
        assert result is not None
        return result

    async def read_ops(
        self, workspace_id: str, sub_doc: str, since: int = 0, limit: int | None = None
    ) -> tuple[int, list[Committed]]:
        """The head clock and committed ops after `since` (one page of at most `limit`)."""
        check_ids(workspace_id, sub_doc)
        return await self._read_log(
            workspace_id, sub_doc, since, limit or self.config.catchup_page, forever=False
        )

    # -- StreamOwner ---------------------------------------------------------------------------

    async def read_log(
        self, workspace_id: str, sub_doc: str, since: int, limit: int
    ) -> tuple[int, Sequence[Committed | Snapshot]]:
        """A subscription's catch-up read. Behind the horizon (410 `log_compacted`) it reads
        the state instead and answers it as one `Snapshot` (docs/client.md)."""
        # A subscription never gives up on a retryable error: it resumes when the server is back.
        try:
            return await self._read_log(workspace_id, sub_doc, since, limit, forever=True)
        except LogCompactedError:
            pass
        http = self._api()
        answer: Any = None
        async for attempt in retrying(self.config, forever=True):
            with attempt:
                answer = await http.get_state(workspace_id, sub_doc)
        clock, state = state_answer(answer)
        return clock, [Snapshot(clock, state)]

    async def _read_log(
        self, workspace_id: str, sub_doc: str, since: int, limit: int, *, forever: bool
    ) -> tuple[int, list[Committed]]:
        http = self._api()
        answer: Any = None
        result: tuple[int, list[Committed]] | None = None
        async for attempt in retrying(self.config, forever=forever):
            with attempt:
                answer = await http.read_ops(workspace_id, sub_doc, since, limit)
                if not forever:  # as in `get_state`
                    result = log_answer(answer)
        # A subscription's read retries a server that is down forever, not an answer it cannot
        # read: an op the log itself cannot parse would be re-read for good. It fails typed.
        return result if result is not None else log_answer(answer)


def check_ids(workspace_id: str, sub_doc: str | None) -> None:
    """Refuse ids the server would refuse, before anything is written (None: no sub-doc)."""
    if not is_valid_workspace_id(workspace_id):
        raise InvalidRequestError("invalid_id", f"workspace_id {workspace_id!r} is not valid")
    if sub_doc is not None and not is_valid_sub_doc(sub_doc):
        raise InvalidRequestError("invalid_id", f"sub_doc {sub_doc!r} is not valid")
