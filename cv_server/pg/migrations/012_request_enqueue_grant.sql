-- The grant of the token that enqueued a request (docs/queue.md, "Whose grant a stage runs
-- under"): its scopes and sub-doc grants, from the verified token. A stage's writes for the
-- request are held to it. NULL: the full grant, which every row made before this migration had.
ALTER TABLE workspace_process_requests
    ADD COLUMN enqueue_grant json;
