-- The initial schema: tenants and the sandboxes they own.
-- Later migrations add OAuth (clients, grants, tokens, keys) and the audit trail.

CREATE TABLE tenants (
    id                      uuid PRIMARY KEY,
    name                    text NOT NULL UNIQUE,
    created_at              timestamptz NOT NULL DEFAULT now(),
    -- Limits; NULL means "use the gateway's configured default".
    max_sandboxes           integer CHECK (max_sandboxes > 0),
    max_idle_seconds        integer CHECK (max_idle_seconds > 0),
    max_lifetime_seconds    integer CHECK (max_lifetime_seconds > 0),
    memory_mb               integer CHECK (memory_mb > 0),
    cpus                    real    CHECK (cpus > 0),
    max_calls_per_minute    integer CHECK (max_calls_per_minute > 0)
);

-- One row per container sandgate created. Warm rows have no tenant; a lease flips one row to
-- 'leased' inside a transaction (FOR UPDATE SKIP LOCKED), so two gateways never share a container.
CREATE TABLE sandboxes (
    id                      text PRIMARY KEY,              -- sbx_<base32>
    profile                 text NOT NULL,
    container_id            text NOT NULL UNIQUE,
    node                    text NOT NULL,                 -- the Docker host it lives on
    state                   text NOT NULL CHECK (state IN ('warm', 'leased', 'closed', 'lost')),
    tenant_id               uuid REFERENCES tenants (id) ON DELETE CASCADE,
    conversation_id         text,
    created_at              timestamptz NOT NULL DEFAULT now(),
    leased_at               timestamptz,
    last_used_at            timestamptz,
    idle_timeout_seconds    integer,
    expires_at              timestamptz,                   -- hard end of life
    closed_at               timestamptz,
    close_reason            text,
    CHECK (state = 'warm' OR state = 'lost' OR tenant_id IS NOT NULL)
);

CREATE INDEX sandboxes_warm ON sandboxes (profile, created_at) WHERE state = 'warm';
CREATE INDEX sandboxes_tenant_live ON sandboxes (tenant_id) WHERE state = 'leased';
-- A conversation is bound to at most one live sandbox of its tenant.
CREATE UNIQUE INDEX sandboxes_conversation
    ON sandboxes (tenant_id, conversation_id)
    WHERE state = 'leased' AND conversation_id IS NOT NULL;
