-- Issue 11: an account's failed sign-ins, so that repeated failures lock it for a while (with a
-- backoff that doubles per further failure), shared by every replica. A success resets both.
ALTER TABLE users
    ADD COLUMN failed_logins integer NOT NULL DEFAULT 0,
    ADD COLUMN locked_until  timestamptz;

-- The purge of dynamic clients that never completed a flow looks them up by age.
CREATE INDEX oauth_clients_dynamic_age ON oauth_clients (created_at) WHERE kind IN ('dcr', 'cimd');
CREATE INDEX grants_client ON grants (client_id);
CREATE INDEX auth_codes_expires ON auth_codes (expires_at);
CREATE INDEX refresh_tokens_expires ON refresh_tokens (expires_at);
CREATE INDEX user_sessions_expires ON user_sessions (expires_at);
