-- Result blobs (`surface_result_blobs`, bytea, 24 h expiry): large stage results are
-- stored here and the request row keeps a reference (claim check). Scoped to the workspace.
CREATE TABLE request_blobs (
    workspace_id text             NOT NULL,
    blob_ref     text             NOT NULL,
    data         bytea            NOT NULL,
    size         integer          NOT NULL,
    created_at   double precision NOT NULL,
    expires_at   double precision NOT NULL,
    PRIMARY KEY (workspace_id, blob_ref)
);

-- Reaped hourly (docs/queue.md); the sweep finds expired blobs by expiry.
CREATE INDEX request_blobs_expires_at ON request_blobs (expires_at);
