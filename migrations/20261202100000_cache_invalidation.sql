-- Every gateway replica caches live grants, unrevoked access tokens and tenant limits briefly
-- (sandgate-service cache.rs). A change to any of them notifies channel `sandgate_cache` in the
-- same transaction (NOTIFY is delivered at commit), so every replica drops its copy at once,
-- whichever code path or tool made the change (the connected-apps page, token revocation, a
-- replayed code, `sandgate admin`, or plain SQL).

CREATE FUNCTION sandgate_cache_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'grants' THEN
        PERFORM pg_notify('sandgate_cache', 'grant:' || coalesce(NEW.id, OLD.id)::text);
    ELSIF TG_TABLE_NAME = 'revoked_access_tokens' THEN
        PERFORM pg_notify('sandgate_cache', 'token:' || coalesce(NEW.jti, OLD.jti));
    ELSIF TG_TABLE_NAME = 'tenants' THEN
        PERFORM pg_notify('sandgate_cache', 'tenant:' || coalesce(NEW.id, OLD.id)::text);
    END IF;
    RETURN NULL;
END
$$;

-- A grant's revocation (or removal); not its once-a-minute `last_used_at` touch.
CREATE TRIGGER grants_cache_revoked AFTER UPDATE ON grants FOR EACH ROW
    WHEN (OLD.revoked_at IS DISTINCT FROM NEW.revoked_at)
    EXECUTE FUNCTION sandgate_cache_notify();
CREATE TRIGGER grants_cache_deleted AFTER DELETE ON grants FOR EACH ROW
    EXECUTE FUNCTION sandgate_cache_notify();
-- A revoked access token (RFC 7009, admin tokens).
CREATE TRIGGER revoked_access_tokens_cache AFTER INSERT ON revoked_access_tokens FOR EACH ROW
    EXECUTE FUNCTION sandgate_cache_notify();
-- A tenant's limits (any change of its row).
CREATE TRIGGER tenants_cache AFTER UPDATE OR DELETE ON tenants FOR EACH ROW
    EXECUTE FUNCTION sandgate_cache_notify();
