"""A writer process for acceptance tests: sends N `node.increment` ops, each with an op_id minted
once before its first send, retrying connection failures with the same op_id until answered.
Every acknowledged op is appended to OUT as `op_id clock` (flushed), so the test knows exactly
what was acknowledged even if this process is killed.

Usage: python -m tests.acceptance.writer URL TOKEN WORKSPACE SUB_DOC COUNT OUT DEADLINE_S
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

import aiohttp

from cv_mutations import new_op_id


async def main(
    url: str, token: str, ws: str, sub_doc: str, count: int, acks: TextIO, deadline_s: float
) -> int:
    deadline = time.monotonic() + deadline_s
    headers = {"Authorization": f"Bearer {token}"}
    endpoint = f"{url}/v1/workspaces/{ws}/docs/{sub_doc}/ops"
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(count):
            op = {"type": "node.increment", "node_id": "n", "field": "count", "by": 1}
            op["op_id"] = new_op_id()  # minted once, before the first send
            while True:
                if time.monotonic() > deadline:
                    return 2
                try:
                    async with session.post(endpoint, json={"ops": [op]}, headers=headers) as r:
                        if r.status >= 500:
                            raise aiohttp.ClientError(f"status {r.status}")
                        body = await r.json()
                except (TimeoutError, aiohttp.ClientError):
                    await asyncio.sleep(0.05)  # the server is restarting: back off, resend
                    continue
                result = body["results"][0]
                acks.write(f"{op['op_id']} {result['clock']}\n")
                break
    return 0


if __name__ == "__main__":
    url, token, ws, sub_doc, count, out, deadline = sys.argv[1:8]
    with open(out, "a", buffering=1) as acks_file:  # line-buffered: each ack reaches the file
        code = asyncio.run(main(url, token, ws, sub_doc, int(count), acks_file, float(deadline)))
    sys.exit(code)
