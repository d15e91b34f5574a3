"""A writer process for multi-instance acceptance tests: sends N `node.increment` ops, each with
an op_id minted once before its first send. When the instance it talks to stops answering
(connection refused or reset, timeout, 5xx), it moves on to the next URL of its list and resends
the very same op (same op_id) until one answers. Every acknowledged op is printed on stdout as
`op_id clock duplicate` (flushed at once), so the test follows the acknowledgements as they come.

Usage: python -m tests.acceptance.failover_writer URL[,URL...] TOKEN WS SUB_DOC COUNT DEADLINE_S
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

import aiohttp

from cv_mutations import new_op_id

#: Pause before resending to the next instance: it bounds the busy loop while every instance is
#: down; the deadline bounds the whole run.
RESEND_PAUSE_S = 0.05


async def main(
    urls: list[str],
    token: str,
    ws: str,
    sub_doc: str,
    count: int,
    acks: TextIO,
    deadline_s: float,
) -> int:
    deadline = time.monotonic() + deadline_s
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=10)
    current = 0
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(count):
            op = {"type": "node.increment", "node_id": "n", "field": "count", "by": 1}
            op["op_id"] = new_op_id()  # minted once, before the first send
            while True:
                if time.monotonic() > deadline:
                    return 2
                endpoint = f"{urls[current]}/v1/workspaces/{ws}/docs/{sub_doc}/ops"
                try:
                    async with session.post(endpoint, json={"ops": [op]}, headers=headers) as r:
                        if r.status >= 500:
                            raise aiohttp.ClientError(f"status {r.status}")
                        if r.status != 200:
                            print(f"refused: {r.status} {await r.text()}", file=sys.stderr)
                            return 3
                        body = await r.json()
                except (TimeoutError, aiohttp.ClientError):
                    current = (current + 1) % len(urls)  # fail over; same op, same op_id
                    await asyncio.sleep(RESEND_PAUSE_S)
                    continue
                result = body["results"][0]
                if "clock" not in result:
                    print(f"rejected: {result}", file=sys.stderr)
                    return 4
                acks.write(f"{op['op_id']} {result['clock']} {int(result['duplicate'])}\n")
                break
    return 0


if __name__ == "__main__":
    urls, token, ws, sub_doc, count, deadline = sys.argv[1:7]
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each ack at once
    code = asyncio.run(
        main(urls.split(","), token, ws, sub_doc, int(count), sys.stdout, float(deadline))
    )
    sys.exit(code)
