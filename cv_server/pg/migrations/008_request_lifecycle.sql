-- Finished requests have a lifecycle (docs/queue.md): the background pass deletes `done` and
-- `cancelled` rows `request_retention_seconds` after they finished, oldest first, in small
-- batches. This index holds only the rows it may delete, so each batch is a seek that stops
-- after the rows it takes, however long the queue's history.
CREATE INDEX IF NOT EXISTS workspace_process_requests_finished ON workspace_process_requests
    (finished_at) WHERE status IN ('done', 'cancelled');
