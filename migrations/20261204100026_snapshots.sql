-- Sealed snapshots of sandboxes (issue 26; pause, resume and fork build on them, issue 27).
-- The snapshot's bytes are sealed under a data key of its own; the row keeps that key wrapped
-- under the service's key-encryption key (derived from keys.secret), bound to the tenant,
-- sandbox and snapshot id, so a copy of the database alone opens no snapshot and a wrapped key
-- moved to another row does not unwrap. Additive: nothing reads it but the snapshot code.
CREATE TABLE snapshots (
    id              text PRIMARY KEY,                       -- snap_<hex>
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    sandbox_id      text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    node            text NOT NULL,                          -- the node that took it
    wrapped_key     bytea NOT NULL,
    image_bytes     bigint NOT NULL CHECK (image_bytes >= 0),   -- the plaintext image
    sealed_bytes    bigint NOT NULL CHECK (sealed_bytes >= 0),  -- the sealed stream at rest
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- A tenant's snapshots of one sandbox, newest first; a tenant's total for its storage quota.
CREATE INDEX snapshots_tenant_sandbox ON snapshots (tenant_id, sandbox_id, created_at);
