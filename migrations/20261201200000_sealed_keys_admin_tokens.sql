-- Signing-key seeds sealed at rest, and the tokens `sandgate admin token issue` hands out.

-- A seed is stored sealed (XChaCha20-Poly1305 under a key derived from `keys.secret`): the
-- clear `seed` column is emptied by the gateway at start-up, sealing each clear seed it finds.
ALTER TABLE signing_keys ADD COLUMN sealed_seed bytea;
ALTER TABLE signing_keys ALTER COLUMN seed DROP NOT NULL;
ALTER TABLE signing_keys DROP CONSTRAINT IF EXISTS signing_keys_seed_check;
ALTER TABLE signing_keys ADD CONSTRAINT signing_keys_seed_stored
    CHECK ((seed IS NULL) <> (sealed_seed IS NULL) AND (seed IS NULL OR length(seed) = 32));

-- One row per admin-issued token: listed by `sandgate admin token list`, revoked by
-- `sandgate admin token revoke` (which also adds its jti to revoked_access_tokens, the list
-- every request is checked against).
CREATE TABLE admin_tokens (
    jti         text PRIMARY KEY,
    tenant_id   uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    scopes      text NOT NULL,
    kid         text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz
);
CREATE INDEX admin_tokens_tenant ON admin_tokens (tenant_id, created_at DESC);

-- One row per opening of a download link whose claims could be read (a forged or altered link
-- names no tenant and is only counted in /metrics). Kept apart from audit_events, which counts
-- a tenant's tool calls per minute: opening a link is not a tool call.
CREATE TABLE download_events (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    tenant_id       uuid NOT NULL,
    link_id         text NOT NULL,
    grant_id        uuid,
    token_id        text,
    kind            text NOT NULL,   -- file | notebook | html
    sandbox_id      text,
    conversation_id text,
    path            text,
    outcome         text NOT NULL,   -- ok | refused | failed | cancelled
    reason          text,            -- why it was refused or failed
    bytes           bigint
);
CREATE INDEX download_events_tenant_at ON download_events (tenant_id, at DESC);
