-- Cancelling a request: a new final status, `cancelled`, and the flag a request in progress
-- carries once someone asked to cancel it (its holder hears of it at its next heartbeat and
-- reports back; a claim that finds its lease lapsed parks it as cancelled). Rows made before
-- this migration are uncancelled.
ALTER TABLE workspace_process_requests
    ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false;
ALTER TABLE workspace_process_requests
    DROP CONSTRAINT workspace_process_requests_status_check;
ALTER TABLE workspace_process_requests
    ADD CONSTRAINT workspace_process_requests_status_check
    CHECK (status IN ('pending', 'in_progress', 'done', 'poison', 'cancelled'));
