-- A tenant's own retention of paused sandboxes (`retention.paused_seconds` per tenant, issue 27;
-- `sandgate admin tenant retention --paused`): NULL means the configured default. Expand-only.
ALTER TABLE tenants
    ADD COLUMN paused_retention_seconds integer CHECK (paused_retention_seconds >= 0);
