-- Sandbox nodes (issue 15): one row per Docker engine, keyed by the engine's id from `docker info`.
-- A node registers at start and heartbeats; a second node on the same engine is refused while the
-- first one's heartbeat is live. `process` is the registering process's random id, so a node that
-- lost its row to a successor stops heartbeating it.
CREATE TABLE nodes (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    advertise_url  TEXT NOT NULL,
    slots          INTEGER NOT NULL CHECK (slots >= 0),
    memory_bytes   BIGINT NOT NULL CHECK (memory_bytes >= 0),
    live_sandboxes INTEGER NOT NULL DEFAULT 0,
    ready_sandboxes INTEGER NOT NULL DEFAULT 0,
    draining       BOOLEAN NOT NULL DEFAULT FALSE,
    process        UUID NOT NULL,
    heartbeat_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    started_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
