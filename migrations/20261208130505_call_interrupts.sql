-- A person's interrupt from the console, for every gateway replica: the replica that serves the
-- console inserts a row and notifies `sandgate_interrupt` with its id; each replica reads the
-- row and interrupts the calls it runs in that sandbox. A row, not the notification's payload,
-- carries what to interrupt, so that a role that may notify but not insert here (the node's)
-- cannot interrupt anything. Rows are kept an hour (deleted by the next interrupt's insert).
CREATE TABLE call_interrupts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    sandbox_id text NOT NULL,
    by_email text NOT NULL,
    -- The process that asked (and interrupted its own calls at once).
    origin uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX call_interrupts_created_at ON call_interrupts (created_at);
