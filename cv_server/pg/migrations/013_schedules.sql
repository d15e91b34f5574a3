-- Schedules (docs/queue.md, "Schedules"): each fires by enqueueing a request, under the
-- scheduler lease one instance holds. `next_fire_at` is NULL while paused.
CREATE TABLE schedules (
    schedule_id      text             PRIMARY KEY,
    workspace_id     text             NOT NULL,
    name             text             NOT NULL,
    cron             text,
    interval_seconds integer,
    enqueue          json             NOT NULL,
    missed           text             NOT NULL,
    overlap          text             NOT NULL,
    paused           boolean          NOT NULL,
    enqueue_grant    json,
    created_at       double precision NOT NULL,
    anchor           double precision NOT NULL,
    next_fire_at     double precision,
    last_fired_at    double precision,
    last_request_id  text,
    skipped          bigint           NOT NULL DEFAULT 0,
    UNIQUE (workspace_id, name)
);

-- The scheduler's `due` / `next_due_at`: running schedules by due time.
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE next_fire_at IS NOT NULL;

-- The lease that makes one instance the scheduler: an owner and an expiry, renewed by a
-- heartbeat at most a third of the lease (docs/queue.md, "Schedules").
CREATE TABLE scheduler_leases (
    name       text             PRIMARY KEY,
    owner      text             NOT NULL,
    expires_at double precision NOT NULL,
    held_since double precision NOT NULL
);
