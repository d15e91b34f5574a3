-- Lane marks (docs/ops.md#exactly-once): per (workspace_id, sub_doc, client_id), the highest seq
-- decided, written in the transaction of the append that decides it. An op at or below it is a
-- duplicate even once its op_id's outcome row is gone.
CREATE TABLE workspace_sub_doc_client_marks (
    workspace_id text        NOT NULL,
    sub_doc      text        NOT NULL,
    client_id    text        NOT NULL,
    seq          bigint      NOT NULL,
    decided_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, sub_doc, client_id)
);
