-- The op-log (docs/concepts.md): one row per committed op, the outcome of every op_id (the dedupe
-- table), a head row per sub-doc (its clock, and the row every writer locks), and the latest
-- state snapshot.

-- The head row is what writers lock (SELECT ... FOR UPDATE): clocks are allocated under it, so
-- concurrent instances queue instead of racing and retrying.
CREATE TABLE workspace_sub_doc_heads (
    workspace_id text   NOT NULL,
    sub_doc      text   NOT NULL,
    clock        bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (workspace_id, sub_doc)
);

-- `op` is `json`, not `jsonb`: it is the op as received, sent to subscribers verbatim.
-- `op_id` is unique per sub-doc through the dedupe table below, which every writer fills.
CREATE TABLE workspace_sub_doc_ops (
    workspace_id text        NOT NULL,
    sub_doc      text        NOT NULL,
    clock        bigint      NOT NULL,
    op_id        text,
    op           json        NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, sub_doc, clock)
);

-- The dedupe table: the outcome the log holds for each op_id, a commit (`clock`) or a recorded
-- rejection (`code`, `message`), so a retry gets the same answer (docs/ops.md). Ops without op_id
-- are applied once per send and have no row. The key leads with op_id on purpose: the lookup
-- `op_id = ANY(...)` can then only be answered by exact probes of this index. With a
-- (workspace_id, sub_doc) prefix, a stale row estimate for a fast-growing sub-doc makes the
-- planner scan the whole sub-doc and filter, on every append.
CREATE TABLE workspace_sub_doc_op_outcomes (
    op_id        text        NOT NULL,
    workspace_id text        NOT NULL,
    sub_doc      text        NOT NULL,
    fingerprint  text        NOT NULL,
    clock        bigint,
    code         text,
    message      text,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (op_id, workspace_id, sub_doc),
    CHECK ((clock IS NULL) <> (code IS NULL)),
    CHECK ((code IS NULL) = (message IS NULL))
);

-- A cache of the log: the state at `clock`, so a cold instance replays only the log's tail.
CREATE TABLE workspace_sub_doc_snapshots (
    workspace_id text   NOT NULL,
    sub_doc      text   NOT NULL,
    clock        bigint NOT NULL,
    state        json   NOT NULL,
    PRIMARY KEY (workspace_id, sub_doc)
);
