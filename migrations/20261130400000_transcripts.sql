-- Transcripts (issue 13): what ran in each sandbox, kept after it ends so a person can take over
-- the conversation. One summary row per sandbox (counts, for the bound) and its entries in order.
-- Entries hold content (code, output, charts as base64, file names and hashes — never the files);
-- the purge job deletes them after the retention period (config `retention`, per tenant below).

CREATE TABLE transcripts (
    sandbox_id      text PRIMARY KEY REFERENCES sandboxes (id) ON DELETE CASCADE,
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    conversation_id text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    entries         integer NOT NULL DEFAULT 0,   -- kept
    bytes           bigint  NOT NULL DEFAULT 0,   -- of kept entries' JSON
    dropped         integer NOT NULL DEFAULT 0    -- not kept: the sandbox's transcript was full
);

CREATE INDEX transcripts_conversation ON transcripts (tenant_id, conversation_id);

CREATE TABLE transcript_entries (
    sandbox_id  text NOT NULL REFERENCES transcripts (sandbox_id) ON DELETE CASCADE,
    seq         integer NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    kind        text NOT NULL CHECK (kind IN ('cell', 'command', 'upload', 'fetch')),
    body        jsonb NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
);

-- A tenant's own transcript retention, seconds; NULL: the gateway's configured default.
ALTER TABLE tenants
    ADD COLUMN transcript_retention_seconds integer CHECK (transcript_retention_seconds >= 0);
