"""Schedules (docs/queue.md, "Schedules"): a scheduler that only enqueues.

The rules are pure (`cv_server.schedules.model`), the storage seam is
`cv_server.schedules.store` (SQLite: `cv_server.sqlite.schedules`, PostgreSQL:
`cv_server.pg.schedules`), and the loop that fires them under the scheduler lease is
`cv_server.schedules.firing`.
"""
