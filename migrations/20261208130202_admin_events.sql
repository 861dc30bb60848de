-- The operator's own trail: one row per `sandgate admin … delete` (tenant, user, client). It
-- outlives what it names on purpose (the record that an erasure happened, and when), so it
-- keeps only ids and counts, never a name, an email or content, and it has no `tenant_id`
-- column: a deleted tenant leaves no row under its id in the tables that carry one.
CREATE TABLE admin_events (
    id      bigserial PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    -- What was done, e.g. `tenant delete`.
    command text NOT NULL,
    -- The id of what it was done to (a tenant's or user's uuid, a client id).
    target  text NOT NULL,
    -- What went with it: rows per table, containers removed (counts only).
    detail  jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX admin_events_at ON admin_events (at DESC);
