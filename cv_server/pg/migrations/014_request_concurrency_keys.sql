-- Concurrency keys (docs/queue.md, "Concurrency keys"): requests of one workspace that share a
-- key share its running slots; a request starts only while fewer than its own
-- `max_running_per_key` requests of its key run. NULL: no key, no limit (every row made before
-- this migration).
ALTER TABLE workspace_process_requests
    ADD COLUMN concurrency_key text,
    ADD COLUMN max_running_per_key integer CHECK (max_running_per_key >= 1);

-- The running requests of each key, counted by every claim of a keyed row: only keyed rows in
-- progress, so it stays the size of the work running, and unkeyed work never touches it.
CREATE INDEX IF NOT EXISTS workspace_process_requests_running_key ON workspace_process_requests
    (workspace_id, concurrency_key, lease_expires_at)
    WHERE status = 'in_progress' AND concurrency_key IS NOT NULL;

-- How many requests of the key run at `now` (in progress under a live lease: a lapsed lease has
-- freed its slot), or NULL when another transaction is claiming for the same key right now.
--
-- SKIP LOCKED alone cannot enforce a count: two claimers would each count one running and each
-- take another row. So a claimer first takes the key's transaction-scoped advisory lock — tried,
-- never waited for: a key another claimer holds is skipped, as SKIP LOCKED skips a row — and
-- only then counts. VOLATILE, so the count runs on a fresh snapshot (READ COMMITTED), taken
-- after the lock: it sees every claim of the key that committed before the lock was ours, and
-- no claim of the key can commit until our transaction ends.
CREATE OR REPLACE FUNCTION cv_key_running(ws text, key text, at double precision)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- 1668705145 is "cvky" in ASCII: the two-key advisory space of concurrency keys.
    IF NOT pg_try_advisory_xact_lock(1668705145, hashtext(ws || chr(31) || key)) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT count(*) FROM workspace_process_requests
            WHERE status = 'in_progress' AND concurrency_key IS NOT NULL
              AND workspace_id = ws AND concurrency_key = key AND lease_expires_at >= at);
END
$$;
