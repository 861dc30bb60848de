-- Signing keys for access tokens (JWKS) and the audit trail of tool calls.

-- Ed25519 keys. The newest unretired key signs; every key retired less than a token lifetime ago
-- still verifies. The private seed is stored as is: protect the database like the key it holds.
CREATE TABLE signing_keys (
    kid         text PRIMARY KEY,
    seed        bytea NOT NULL CHECK (length(seed) = 32),
    public_key  bytea NOT NULL CHECK (length(public_key) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    retired_at  timestamptz
);

-- One row per tool call. Never the code, its output, file contents or tokens.
CREATE TABLE audit_events (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    tenant_id       uuid NOT NULL,
    token_id        text,
    subject         text,
    conversation_id text,
    sandbox_id      text,
    tool            text NOT NULL,
    outcome         text NOT NULL,   -- ok | user_error | refused | failed
    error_kind      text,
    duration_ms     integer NOT NULL
);

CREATE INDEX audit_events_tenant_at ON audit_events (tenant_id, at DESC);
