"""Helpers for apps to write their own resend tests: a real server to test against, a network
that fails on demand, a way to crash a client and start a new one on the same outbox, and a
provider fake that counts its calls (`CountingFakeProvider`: a stage's expensive call made once,
however many workers race for it).

`LocalServer` runs a real `cv-server` process (the `server` extra) on a temporary SQLite file,
or a PostgreSQL URL, and a free loopback port, and mints tokens; the pytest plugin this package
installs gives each test one as the `cv_server` fixture (docs/client.md, "Testing your app"):

```python
async with LocalServer() as server:              # `with` works too
    token = server.token("ws1")                  # `cv-server token --workspace ws1`
    async with WorkspaceClient(server.url, token=token) as client: ...
```

`FaultProxy` is a loopback TCP proxy you put between `WorkspaceClient` and the server. It knows
nothing of HTTP or websockets: it forwards bytes, counts *chunks* (one read from a socket, up to
64 KiB) coming back from the server, and breaks connections when told to:

```python
from cv_workspace_client import WorkspaceClient
from cv_workspace_client.testing import FaultProxy, LocalServer, restart_client

async with LocalServer() as server, FaultProxy(server.url) as proxy:
    # The worst moment for a retry: the server committed, the client never hears the answer.
    proxy.cut_next(1)
    token = server.token("ws1")
    async with WorkspaceClient(proxy.url, token=token, outbox=tmp_path / "outbox") as client:
        commit = await client.apply_op("ws1", "tree", op)     # retried under the same op_id
        assert commit.duplicate                                 # applied once, answered twice
        assert proxy.stats.cuts == 1

        client = await restart_client(client)                   # crash + new client, same outbox
        await client.wait_synced(timeout=10)                    # what was pending is resent
        await client.close()
```

Faults:

- `cut_next(n, skip_chunks=0, forward_bytes=0)`: each of the next `n` new connections forwards
  `skip_chunks` server chunks untouched, then **drops the next chunk** and aborts both sides — for
  HTTP with `skip_chunks=0` that is the first response: the request went out, the server
  committed, the answer never arrives. For a websocket use `skip_chunks=1` (the first chunk is the
  handshake's `101`) to cut at the next ack or op frame.
  `forward_bytes > 0` forwards that many bytes of the fatal chunk first: a cut mid-frame.
- `cut_fraction(p, ...)`: each new connection is armed like `cut_next` with probability `p`
  (seeded: `FaultProxy(..., seed=...)` makes a run repeatable).
- `cut_chunks(p, skip_chunks=0)`: every server chunk (after each connection's first
  `skip_chunks`) is dropped, cutting its connection, with probability `p`. Unlike `cut_fraction`,
  a keep-alive connection that survived its first answer is still at risk on the next one: the
  way to cut a steady share of requests.
- `cut_open(...)`: arm every connection open right now (long-lived websockets): each is cut at its
  next server chunk.
- `drop_all()`: abort every open connection now (both sides see a reset).
- `silence_open()`: every open connection goes silent both ways, and stays open: bytes are read
  and thrown away, nothing is closed or reset. What a NAT that forgot the flow, or a peer that
  lost power, looks like: only a heartbeat (or the OS, hours later) notices.
- `delay`: seconds to hold each server chunk before forwarding it.
- `refuse`: while True, new connections are accepted and aborted at once (connection refused /
  reset as the client sees it).

Otherwise bytes pass untouched both ways, and an EOF (a half-close) is passed on: each direction
ends when its sender closes it.

Counters are in `proxy.stats` (`accepted`, `refused`, `cuts`, `mid_frame_cuts`, `open`); wait for
a count with `await asyncio.wait_for(proxy.wait_until(lambda s: s.cuts >= 3), 10)` instead of
sleeping.

Import them from here. `FaultProxy` and `CountingFakeProvider` are defined in the SDK's private
`_fakes`, because `cv-worker --provider fake` and the demo use them too, and no module the
product runs imports this one.
"""

from __future__ import annotations

from typing import Any

from cv_workspace_client._fakes.provider import CountingFakeProvider
from cv_workspace_client._fakes.proxy import CutRule, FaultProxy, ProxyStats
from cv_workspace_client.client import WorkspaceClient
from cv_workspace_client.testing.local_server import LocalServer, LocalServerError

__all__ = [
    "CountingFakeProvider",
    "CutRule",
    "FaultProxy",
    "LocalServer",
    "LocalServerError",
    "ProxyStats",
    "restart_client",
]


async def restart_client(client: WorkspaceClient, **overrides: Any) -> WorkspaceClient:
    """Crash `client` (no goodbyes; outbox writes not yet committed are lost, as in a real crash)
    and start a new client on the same URL, token (and provider), outbox, config, clock and op_id
    minter (`overrides` replace constructor arguments). Returns the new client, started: close
    it, or `async with` it.

    The new client resends what the old one left in the outbox before anything else.
    """
    if client.outbox_path is None and "outbox" not in overrides:
        raise ValueError(
            "restart_client needs a file outbox: an in-memory one dies with its client"
        )
    await client.abort()
    options: dict[str, Any] = {
        "token": client.token,
        "outbox": client.outbox_path,
        "config": client.config,
        # The app's injected clock and op_id minter too: a restarted app is the same app, and
        # a test that pins them must not see the new client fall back to the defaults.
        "now": client._now,
        "new_op_id": client._mint,
        "token_provider": client.token_refresher.provider,
    }
    options.update(overrides)
    fresh = WorkspaceClient(client.url, **options)
    await fresh.start()
    return fresh
