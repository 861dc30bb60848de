-- no-transaction
-- Pause and resume's indexes are built concurrently, one statement per migration (Postgres runs
-- a multi-statement migration as one transaction block, where CONCURRENTLY is refused):
-- sandboxes is a table that grows for ever (the expand/contract rule in docs/scale-out.md).
-- A conversation is bound to at most one sandbox of its tenant that is live or paused (a new
-- lease for it while its sandbox is paused would leave the paused one unreachable).
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS sandboxes_conversation_held
    ON sandboxes (tenant_id, conversation_id)
    WHERE state IN ('leased', 'pausing', 'paused', 'resuming') AND conversation_id IS NOT NULL;
