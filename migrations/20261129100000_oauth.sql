-- OAuth 2.1 (DESIGN §6): users, clients, browser sessions, grants ("connections"),
-- authorization codes, refresh tokens and revoked access tokens. Secrets are stored as SHA-256
-- hashes; passwords as argon2id PHC strings.

CREATE TABLE users (
    id              uuid PRIMARY KEY,
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    email           text NOT NULL,
    password_hash   text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- One account per email address (login asks only for the email).
CREATE UNIQUE INDEX users_email ON users (lower(email));

-- Registered clients: dynamic registration ('dcr'), client-ID metadata documents ('cimd', id =
-- the document URL, refreshed when stale) and operator-created confidential clients
-- ('confidential', which may use client credentials for their tenant).
CREATE TABLE oauth_clients (
    id                  text PRIMARY KEY,
    kind                text NOT NULL CHECK (kind IN ('dcr', 'cimd', 'confidential')),
    name                text NOT NULL,
    redirect_uris       text[] NOT NULL DEFAULT '{}',
    auth_method         text NOT NULL CHECK (auth_method IN ('none', 'client_secret_basic', 'client_secret_post')),
    secret_hash         bytea,
    grant_types         text[] NOT NULL,
    scopes              text,           -- space-separated; NULL = any scope
    tenant_id           uuid REFERENCES tenants (id) ON DELETE CASCADE,   -- confidential clients only
    created_at          timestamptz NOT NULL DEFAULT now(),
    fetched_at          timestamptz,    -- CIMD: when the document was last fetched
    CHECK (auth_method = 'none' OR secret_hash IS NOT NULL),
    CHECK (kind <> 'confidential' OR tenant_id IS NOT NULL)
);

-- Browser sessions of logged-in users (the cookie holds the secret; this holds its hash).
CREATE TABLE user_sessions (
    id_hash         bytea PRIMARY KEY,
    user_id         uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    csrf_token      text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);

-- A grant is a connection: a tenant's user (or, for client credentials, the tenant itself)
-- allowed a client some scopes. Revoking it stops every token issued under it.
CREATE TABLE grants (
    id              uuid PRIMARY KEY,
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    user_id         uuid REFERENCES users (id) ON DELETE CASCADE,
    client_id       text NOT NULL REFERENCES oauth_clients (id) ON DELETE CASCADE,
    scopes          text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    last_used_at    timestamptz,
    revoked_at      timestamptz,
    revoke_reason   text
);
-- At most one live connection per (user, client); client-credentials grants have no user.
CREATE UNIQUE INDEX grants_live_user_client ON grants (tenant_id, COALESCE(user_id, '00000000-0000-0000-0000-000000000000'::uuid), client_id)
    WHERE revoked_at IS NULL;

CREATE TABLE auth_codes (
    code_hash       bytea PRIMARY KEY,
    grant_id        uuid NOT NULL REFERENCES grants (id) ON DELETE CASCADE,
    client_id       text NOT NULL,
    redirect_uri    text NOT NULL,
    code_challenge  text NOT NULL,
    resource        text NOT NULL,
    scopes          text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    used_at         timestamptz
);

-- Refresh tokens rotate: each use marks the row used and issues a new one in the same family.
-- Presenting a used token again revokes the whole family.
CREATE TABLE refresh_tokens (
    token_hash      bytea PRIMARY KEY,
    family_id       uuid NOT NULL,
    grant_id        uuid NOT NULL REFERENCES grants (id) ON DELETE CASCADE,
    client_id       text NOT NULL,
    scopes          text NOT NULL,
    resource        text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    used_at         timestamptz,
    revoked_at      timestamptz
);
CREATE INDEX refresh_tokens_family ON refresh_tokens (family_id);
CREATE INDEX refresh_tokens_grant ON refresh_tokens (grant_id);

-- Access tokens revoked before their expiry (RFC 7009), by jti; kept until they expire anyway.
CREATE TABLE revoked_access_tokens (
    jti             text PRIMARY KEY,
    expires_at      timestamptz NOT NULL
);

-- A sandbox remembers the grant that leased it, so disconnecting the app closes it.
ALTER TABLE sandboxes ADD COLUMN grant_id uuid REFERENCES grants (id) ON DELETE SET NULL;
CREATE INDEX sandboxes_grant_live ON sandboxes (grant_id) WHERE state = 'leased';
