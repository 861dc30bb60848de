-- no-transaction
-- It is stricter than the index it replaces (leased only), so a binary of before still meets
-- its unique violation where it expects one.
DROP INDEX CONCURRENTLY IF EXISTS sandboxes_conversation;
