"""A real SDK process for tests/server/test_exactly_once_after_absence.py: a `WorkspaceClient`
on a durable outbox, driven line by line on stdin.

    python exactly_once_client.py URL TOKEN OUTBOX WORKSPACE SUB_DOC

`submit N`: queue N `node.increment`s of node "n" (not awaited) and answer `stored K` once the
outbox file holds every op submitted so far (the test cuts every answer while it submits);
`sync`: wait until the outbox is empty, answer `synced`. The test SIGKILLs it whenever it likes."""

from __future__ import annotations

import asyncio
import sys

from cv_mutations import NodeIncrement
from cv_workspace_client import ClientConfig, WorkspaceClient


async def main(url: str, token: str, outbox: str, workspace: str, sub_doc: str) -> None:
    config = ClientConfig(
        ops_over_websocket=False,
        retry_attempts=10_000,
        retry_base_seconds=0.01,
        retry_cap_seconds=0.05,
        request_timeout_seconds=5.0,
    )
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[object]] = []
    submitted = 0
    async with WorkspaceClient(url, token=token, outbox=outbox, config=config) as client:
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
            if line[0] == "submit":
                for _ in range(int(line[1])):
                    op = NodeIncrement(node_id="n", field="c", by=1)
                    tasks.append(asyncio.create_task(client.apply_op(workspace, sub_doc, op)))
                submitted += int(line[1])
                # The rows the outbox file holds (the file is locked to this process): the write
                # is the pump's, on a later tick, so it is waited for, not assumed.
                outbox_now = client._outbox
                assert outbox_now is not None
                while (stored := len(await outbox_now.pending())) < submitted:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                print(f"stored {stored}", flush=True)
            elif line[0] == "sync":
                await client.wait_synced(timeout=60)
                print("synced", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
