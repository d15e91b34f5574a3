"""The SDK's sans-I/O core: the rules, with no socket, clock, thread or database.

- `machine` (with `effects` and `wire`): the outbox/retry/resend state machine of one client's
  ops; the asyncio pump drives it (`cv_workspace_client._io.pump`).
- `subscription`: gap-free, duplicate-free resume of a subscription.
- `optimistic`: the confirmed state with this client's pending ops on top (`LiveDoc`).
- `liveness`: when to probe a quiet websocket and when to give up on it.
- `reconnect`: the reconnect delays and the one "is this retryable?" rule.
- `answers`: what an HTTP answer means (status and problem code to a typed error).
- `url`: the server URL a client is given, checked once.

Every module here is listed, as this folder, in the "pure cores" import contract
(`pyproject.toml`), which the purity test (`tests/test_architecture.py`) reads too.
"""
