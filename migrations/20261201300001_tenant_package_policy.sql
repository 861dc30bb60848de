-- Packages on demand: a tenant's policy (`sandgate admin tenant packages`). Rules are requirement
-- strings (a project name, optionally with PEP 440 version specifiers, e.g. `numpy>=1.26`).
-- Empty allow: every project not denied. max_wheel_mb NULL: the configured packages.max_wheel_mb.
CREATE TABLE tenant_package_policy (
    tenant_id    uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
    allow        text[] NOT NULL DEFAULT '{}',
    deny         text[] NOT NULL DEFAULT '{}',
    max_wheel_mb integer,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
