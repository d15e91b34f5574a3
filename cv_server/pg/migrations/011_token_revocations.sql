-- Revoked bearer tokens (docs/operating.md, "Revoking a token"): each instance reads the
-- entries past the last `seq` it saw, when told (NOTIFY) and at a bounded interval. An entry
-- is swept once its token would have expired (`expires_at`, epoch seconds; NULL: never).
CREATE TABLE IF NOT EXISTS token_revocations (
    seq bigserial PRIMARY KEY,
    token_id text NOT NULL UNIQUE,
    expires_at bigint
);
CREATE INDEX IF NOT EXISTS token_revocations_expires_at ON token_revocations (expires_at);
