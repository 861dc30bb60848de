-- Issue 15 (replica-safe gateway): what a replica knows that the others need lives here.

-- Calls in flight that outlive a second, one row per call, so the reaper of every replica (not
-- only the one serving the call) leaves their sandbox alone. A live call renews its mark every
-- third of `limits.call_slot_ttl_seconds` and deletes it when it ends; the mark of a replica that
-- died expires by itself. Short calls never write here.
CREATE TABLE sandbox_call_marks (
    mark_id    uuid PRIMARY KEY,
    sandbox_id text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    until      timestamptz NOT NULL
);
CREATE INDEX sandbox_call_marks_sandbox ON sandbox_call_marks (sandbox_id, until);
CREATE INDEX sandbox_call_marks_until ON sandbox_call_marks (until);

-- What a replica needs to take over a 2025-11-25 MCP session another replica opened: the
-- client's `initialize` parameters (rmcp replays the handshake from them). Keyed like
-- `mcp_sessions` by the keyed hash of the session id (the id itself never reaches Postgres);
-- usable only while the session's binding in `mcp_sessions` is open, and purged with it.
CREATE TABLE mcp_session_states (
    id_hash           bytea PRIMARY KEY,
    initialize_params jsonb NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX mcp_session_states_created ON mcp_session_states (created_at);
