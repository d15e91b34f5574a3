"""The SQLite backend (the embedded default): one database file, one writer thread.

Module for module beside `cv_server.pg`: `engine` (the writer thread and group commit), `oplog`,
`queue`, `locks`, `idempotency`, `blobs` and `meta` (the token secret).
"""
