-- Server-wide settings every instance shares: the bearer-token secret above all (docs/operating.md).
-- The first instance to start creates it (INSERT ... ON CONFLICT DO NOTHING); every instance,
-- and `cv-server token`, then reads the same value.
CREATE TABLE server_meta (
    key   text  PRIMARY KEY,
    value bytea NOT NULL
);
