"""Where a client writes its ops down before their first send (docs/client.md).

- `base`: the `Outbox` seam and `MemoryOutbox`.
- `sqlite`: the durable outbox, one SQLite file (with `file`: the file's lock and hazards).
- `discard`: `discard_pending`'s durable last step.
"""
