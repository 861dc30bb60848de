-- Packages on demand: every wheel the package index handed to a sandbox (pip then installs it).
CREATE TABLE package_installs (
    id          bigserial PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    tenant_id   uuid NOT NULL,
    sandbox_id  text NOT NULL,
    project     text NOT NULL,
    version     text NOT NULL,
    filename    text NOT NULL,
    sha256      text NOT NULL
);

CREATE INDEX package_installs_tenant_at ON package_installs (tenant_id, at DESC);
