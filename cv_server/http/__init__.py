"""The server's HTTP edge: routes, and what they need to speak HTTP (docs/protocol.md).

Routes: `docs` (state, log, ops), `socket` (the websocket), `queue`, `queue_operators`,
`results`, `locks`, `listings`, `dashboard`. Around them: `bodies` (body decoding and limits),
`inputs` (path and query parsing), `security` (bearer tokens), `ratelimit` (the middleware),
`problems` (problem+json), `models` (the API's pydantic models), `openapi` (the document) and
`socket_close` (close codes). Nothing below the edge (the stores, the op-log, the queue's rules)
imports it: an import contract in `pyproject.toml` says so.
"""
