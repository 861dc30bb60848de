-- A tenant's byte budget for its stored transcripts (`retention.transcript_tenant_max_bytes`,
-- issue 24): entries that would take a tenant's transcripts past it are counted, not kept. Of a
-- transcript's `dropped`, how many were dropped for the tenant's budget (the rest: the sandbox's
-- own bound), so the export says which bound dropped them.
ALTER TABLE transcripts ADD COLUMN over_budget integer NOT NULL DEFAULT 0;
