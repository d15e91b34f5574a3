-- The durable work queue, layer 1 (docs/queue.md): one row per request, statuses
-- pending -> in_progress -> done | poison. Columns mirror `cv_server.queue.model.ProcessRequest`;
-- times are epoch seconds passed in by the caller. `seq` orders requests enqueued at the same
-- instant (enqueue order), as SQLite's rowid does.
CREATE TABLE workspace_process_requests (
    request_id       text             PRIMARY KEY,
    workspace_id     text             NOT NULL,
    stage            text             NOT NULL,
    job_id           text,
    branch_path      text,
    input            json,
    worker_class     text             NOT NULL,
    status           text             NOT NULL,
    run              integer          NOT NULL,
    claim_token      text,
    claimed_by       text,
    lease_expires_at double precision,
    available_at     double precision NOT NULL,
    dequeue_count    integer          NOT NULL,
    max_dequeues     integer          NOT NULL,
    result           json,
    error            json,
    blob_ref         text,
    cache            text,
    created_at       double precision NOT NULL,
    claimed_at       double precision,
    finished_at      double precision,
    telemetry        json,
    seq              bigint           GENERATED ALWAYS AS IDENTITY,
    CHECK (status IN ('pending', 'in_progress', 'done', 'poison')),
    CHECK (cache IN ('hit', 'miss'))
);

-- The claim probes each partial index on its own (pending rows by when they become available,
-- leased rows by when their lease lapses) instead of one query that ORs both states under one
-- ORDER BY: such a query cannot walk an ordered index and sorts the whole backlog on every claim
-- (issue 5 and a peer's measurement). Partial, so each stays the size of the live backlog, not
-- of the history of finished rows.
CREATE INDEX workspace_process_requests_pending ON workspace_process_requests
    (worker_class, available_at, created_at, seq) WHERE status = 'pending';
-- A worker whose token covers only some workspaces probes each of them (tenant isolation, §11).
CREATE INDEX workspace_process_requests_pending_workspace ON workspace_process_requests
    (worker_class, workspace_id, available_at, created_at, seq) WHERE status = 'pending';
CREATE INDEX workspace_process_requests_leased ON workspace_process_requests
    (worker_class, lease_expires_at, created_at, seq) WHERE status = 'in_progress';

-- Operators list by status (poison above all) and by workspace, oldest first.
CREATE INDEX workspace_process_requests_status ON workspace_process_requests
    (status, created_at, seq);
CREATE INDEX workspace_process_requests_workspace ON workspace_process_requests
    (workspace_id, status, created_at, seq);

-- A table never analyzed is planned from guesses until autovacuum gets to it; on a peer, claims
-- on a fresh queue table stayed slow until it was analyzed. Statistics of the empty table make
-- the planner size it from its actual pages from the first claim on.
ANALYZE workspace_process_requests;
