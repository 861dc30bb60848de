-- no-transaction
-- Paused sandboxes, for the reaper's lifetime and retention passes and `admin sandboxes`.
CREATE INDEX CONCURRENTLY IF NOT EXISTS sandboxes_paused ON sandboxes (tenant_id, paused_at)
    WHERE state IN ('pausing', 'paused', 'resuming');
