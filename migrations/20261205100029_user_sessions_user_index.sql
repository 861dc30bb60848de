-- no-transaction
-- Revoking a user's sessions (`sandgate admin user revoke-sessions`) finds them by user: an index
-- built concurrently, so a big user_sessions table is not locked while it is built (the
-- expand/contract rule in docs/scale-out.md).
CREATE INDEX CONCURRENTLY IF NOT EXISTS user_sessions_user ON user_sessions (user_id);
