-- compute_lock, layer 2 (docs/stages.md): one row per held lock on
-- (workspace_id, job_id, task). Times are epoch seconds passed in by the caller (`now`), never
-- read from the database clock, so every instance and the tests agree on what "expired" means.
CREATE TABLE compute_locks (
    workspace_id text             NOT NULL,
    job_id       text             NOT NULL,
    task         text             NOT NULL,
    holder       text             NOT NULL,
    token        text             NOT NULL,
    acquired_at  double precision NOT NULL,
    expires_at   double precision NOT NULL,
    PRIMARY KEY (workspace_id, job_id, task)
);

-- The bounded sweep of dead locks finds them by expiry, across keys.
CREATE INDEX compute_locks_expires_at ON compute_locks (expires_at);
