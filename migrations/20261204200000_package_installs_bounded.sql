-- Issue 24 (hole 5): the install audit is bounded. One row per (sandbox, wheel) however often pip
-- fetches it (earlier duplicates are folded into the first), and rows are purged with the audit
-- trail (`retention.audit_seconds`): a BRIN index on `at` finds the old ones.
DELETE FROM package_installs a
    USING package_installs b
    WHERE a.sandbox_id = b.sandbox_id AND a.sha256 = b.sha256 AND a.id > b.id;
CREATE UNIQUE INDEX package_installs_sandbox_sha256 ON package_installs (sandbox_id, sha256);
CREATE INDEX package_installs_at ON package_installs USING brin (at);
