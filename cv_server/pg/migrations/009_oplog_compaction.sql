-- Op-log compaction (docs/operating.md, "Storage over time"): recorded rejections expire by age,
-- oldest first, so they are found by this index instead of a scan of every op_id's outcome.
CREATE INDEX workspace_sub_doc_op_outcomes_rejected_at ON workspace_sub_doc_op_outcomes
    (recorded_at) WHERE clock IS NULL;
