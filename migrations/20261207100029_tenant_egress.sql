-- Egress a tenant chooses (issue 29), slice 1: the policy and the secrets, stored. Nothing reads
-- them for a connection yet; a tenant without a row in tenant_egress_rules has no route out.
--
-- One row per allowed host rule (`sandgate admin tenant egress <id>`): `host` is a name
-- (`api.example.com`) or a wildcard of one label or more (`*.example.com`), lower-case, without
-- a port; `port` is the one port it allows. Budgets are per host rule and optional (NULL: none).
CREATE TABLE tenant_egress_rules (
    tenant_id            uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    host                 text NOT NULL,
    port                 integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
    connections_per_minute integer CHECK (connections_per_minute > 0),
    bytes_per_day        bigint CHECK (bytes_per_day > 0),
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, host, port)
);

-- A tenant's secrets (`sandgate admin tenant secret set <id> NAME`): the value only sealed
-- (XChaCha20-Poly1305 under the egress secrets key, a key of its own: not keys.secret, not a
-- signing key; tenant, name and version bound as associated data), the hosts it may be sent to
-- and the request headers it may go into. `version` grows by one at every rotation, so a sealed
-- value copied from an older row does not open as the current one.
CREATE TABLE tenant_secrets (
    tenant_id  uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name       text NOT NULL,
    version    integer NOT NULL DEFAULT 1 CHECK (version > 0),
    sealed     bytea NOT NULL,
    hosts      text[] NOT NULL DEFAULT '{}',
    headers    text[] NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    rotated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name)
);
