-- Issue 11 (part B1): MCP sessions bound to their principal, and tenant quotas that hold under
-- bursts and across replicas.

-- A 2025-11-25 MCP session's owner, recorded at `initialize`. The session id itself never
-- reaches Postgres: rows are keyed by HMAC-SHA256 of it under a key from configuration
-- (`oauth.cookie_secret`, domain-separated). A row is an open session (it counts against the
-- tenant's `max_sessions`) until it is deleted (DELETE /mcp) or `expires_at` passes (the
-- session's idle timeout, renewed while it is used).
CREATE TABLE mcp_sessions (
    id_hash    bytea PRIMARY KEY,
    tenant_id  uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    subject    text NOT NULL,
    client_id  text,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX mcp_sessions_tenant ON mcp_sessions (tenant_id, expires_at);
CREATE INDEX mcp_sessions_expires ON mcp_sessions (expires_at);

-- A tenant's call quota state, one row per tenant, changed by one statement at a call's start
-- and one at its end (the row lock serialises a tenant's call starts across replicas):
-- - rate_tat: the calls-per-minute limit as GCRA (the algorithm `governor` uses): the
--   "theoretical arrival time"; a call is admitted while rate_tat - now() <= 60 s - 60 s/limit,
--   and moves it on by 60 s/limit. Counted when a call starts; refused calls do not move it.
-- - in_flight: the calls running now, slot id -> expiry (unix seconds). A live call renews its
--   slot; a slot whose replica died expires by itself (`limits.call_slot_ttl_seconds`).
CREATE TABLE call_quotas (
    tenant_id uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    rate_tat  timestamptz NOT NULL DEFAULT now(),
    in_flight jsonb NOT NULL DEFAULT '{}'
);

ALTER TABLE tenants
    ADD COLUMN max_sessions        integer,
    ADD COLUMN max_calls_in_flight integer;

-- Session ids were written in clear as conversation keys ("mcp-session:<id>"); the new keys are
-- "mcp-session:" + the keyed hash. The old values cannot be rewritten without the key, and the
-- sessions they named died with the process that served them: forget them. Their sandboxes stay
-- reachable by sandbox id.
UPDATE sandboxes SET conversation_id = NULL WHERE conversation_id LIKE 'mcp-session:%';
UPDATE audit_events SET conversation_id = NULL WHERE conversation_id LIKE 'mcp-session:%';
UPDATE transcripts SET conversation_id = NULL WHERE conversation_id LIKE 'mcp-session:%';
