-- The clock of the op-log commit that enqueued a request (an apply's `enqueue`, docs/queue.md,
-- "Start work with the change that needs it"): the sub-doc is at least at this clock when the
-- stage runs. NULL: enqueued on its own, which every row made before this migration was.
ALTER TABLE workspace_process_requests
    ADD COLUMN caused_by_clock bigint;
