"""The README's SDK example, runnable: `python examples/quickstart.py URL TOKEN`.

Start a server first (`./scripts/serve` prints the URL and a token for workspace "demo").
Run it twice: the second run shows the insert answered `node_exists` and the counter going on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from cv_mutations import NodeIncrement, NodeInsert
from cv_workspace_client import OpRejectedError, Snapshot, StillPendingError, WorkspaceClient


async def main(url: str, token: str) -> None:
    # The outbox file makes every op durable before its first send: kill this process at any
    # point and the next run replays what was pending, under the same op_ids.
    async with WorkspaceClient(url, token=token, outbox="quickstart.outbox.db") as client:
        try:
            try:
                await client.apply_op(
                    "demo", "tree", NodeInsert(node_id="counter", parent_id="root")
                )
            except OpRejectedError as exc:
                print(f"insert answered {exc.code} (already there from an earlier run)")
            commit = await client.apply_op(
                "demo", "tree", NodeIncrement(node_id="counter", field="n", by=1)
            )
        except StillPendingError as exc:
            # No answer (server down, or the token refused): not lost. The op stays in the outbox
            # under exc.op_id and is replayed on the next run's connect. Never re-submit it as a
            # new op — that would be a second intent. The insert is guarded too: it is the first
            # op, so it is the one that meets a server that is not there.
            print(f"no answer ({exc.last_error}); {exc.op_id} stays pending in the outbox")
            return
        print(f"committed at clock {commit.clock} (op_id {commit.op_id})")

        clock, state = await client.get_state("demo", "tree")
        print("counter =", state.nodes["counter"].fields["n"], "at clock", clock)

        # Every committed op after `since`, each exactly once, in order; reconnects by itself.
        async with client.subscribe("demo", "tree", since=max(0, clock - 2)) as ops:
            async for committed in ops:
                if isinstance(committed, Snapshot):  # the ops before were compacted away
                    print("state at", committed.clock)
                    continue
                print("op", committed.clock, committed.op.type)
                if committed.clock >= clock:
                    break


def parse_args(argv: list[str]) -> argparse.Namespace:
    """URL and TOKEN, or the usage and exit 2 (tests/acceptance/test_readme_commands.py)."""
    parser = argparse.ArgumentParser(
        prog="python examples/quickstart.py",
        description="Apply two ops, read the state and follow the ops, against a running server"
        " (start one with ./scripts/serve: it prints the URL and a token).",
    )
    parser.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8080")
    parser.add_argument("token", metavar="TOKEN", help="a token for workspace 'demo'")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    asyncio.run(main(args.url, args.token))
