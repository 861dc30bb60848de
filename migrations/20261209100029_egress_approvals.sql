-- Egress a tenant chooses (issue 29), its optional part: a host outside the tenant's policy
-- approved during a conversation by a person the tenant designates. Expand-only: a new role
-- value, two new tables; nothing dropped or renamed.

-- A third role, 'approver': everything 'takeover' may do, and approve or deny the hosts a
-- conversation's sandbox asked for outside the egress policy. (A gateway older than this
-- migration cannot read the value: a user given it signs in on new gateways only.)
ALTER TABLE users DROP CONSTRAINT users_role_check;
ALTER TABLE users ADD CONSTRAINT users_role_check
    CHECK (role IN ('viewer', 'takeover', 'approver')) NOT VALID;
ALTER TABLE users VALIDATE CONSTRAINT users_role_check;

-- Per tenant: whether a refused host becomes a request a person may approve (off by default;
-- `sandgate admin tenant egress <id> --approvals on`).
CREATE TABLE tenant_egress_settings (
    tenant_id  uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    approvals  boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- One row per sandbox, host and port asked for outside the policy: 'pending' until a person
-- decides (or `expires_at` passes), then 'approved' (the sandbox may connect until `expires_at`)
-- or 'denied'. Names only, never addresses; a name is resolved only once approved. The rows go
-- with their sandbox's row (retention, tenant deletion).
CREATE TABLE egress_approvals (
    id              uuid PRIMARY KEY,
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    sandbox_id      text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    conversation_id text,
    host            text NOT NULL,
    port            integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
    state           text NOT NULL CHECK (state IN ('pending', 'approved', 'denied')),
    requested_at    timestamptz NOT NULL DEFAULT now(),
    decided_at      timestamptz,
    decided_by      text,
    expires_at      timestamptz NOT NULL,
    UNIQUE (tenant_id, sandbox_id, host, port)
);
CREATE INDEX egress_approvals_tenant_requested ON egress_approvals (tenant_id, requested_at DESC);
-- The retention job deletes by expiry.
CREATE INDEX egress_approvals_expires ON egress_approvals (expires_at);
