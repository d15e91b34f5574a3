-- Idempotency keys (docs/queue.md): scoped to the workspace (the primary key leads with it, so one
-- tenant's key can never answer another's request), kept for the retention from first use.
CREATE TABLE idempotency_keys (
    workspace_id  text             NOT NULL,
    key           text             NOT NULL,
    fingerprint   text             NOT NULL,
    state         text             NOT NULL,
    status_code   integer,
    -- The stored answer, replayed verbatim; `json` keeps it exactly as it was written.
    response_body json,
    created_at    double precision NOT NULL,
    expires_at    double precision NOT NULL,
    PRIMARY KEY (workspace_id, key),
    CHECK (state IN ('in_progress', 'completed')),
    CHECK ((state = 'completed') = (status_code IS NOT NULL))
);

-- Expired keys are deleted on a schedule; the sweep finds them by expiry.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
