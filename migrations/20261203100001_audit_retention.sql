-- Retention of the audit trail (`retention.audit_seconds`): the purge job deletes events older
-- than the period, in batches. Both tables only grow at the end, so a BRIN index on `at` finds
-- the old ones at the cost of a few pages.
CREATE INDEX audit_events_at ON audit_events USING brin (at);
CREATE INDEX download_events_at ON download_events USING brin (at);
