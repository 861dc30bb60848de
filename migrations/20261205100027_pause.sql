-- Pause and resume (issue 27): an idle leased sandbox is checkpointed, its container removed and
-- its row kept `paused` with the snapshot that holds it; the next call restores it under the same
-- id. States leased -> pausing -> paused -> resuming -> leased, one transaction per transition.
-- Expand only: the states widen and columns are added (the indexes, built concurrently, are the
-- next migration); a binary of before never sees a
-- paused row unless a binary of after paused it.

-- The check is added NOT VALID and validated after: validation scans the table without blocking
-- its writes (a plain ADD CONSTRAINT would hold an exclusive lock for the whole scan).
ALTER TABLE sandboxes DROP CONSTRAINT sandboxes_state_check;
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_state_check
    CHECK (state IN ('warm', 'leased', 'pausing', 'paused', 'resuming', 'closed', 'lost')) NOT VALID;
ALTER TABLE sandboxes VALIDATE CONSTRAINT sandboxes_state_check;

-- The snapshot a paused (or resuming) sandbox rests in: no foreign key, since the snapshot row
-- references the sandbox and is deleted with it (and a resume deletes it once the sandbox runs).
ALTER TABLE sandboxes ADD COLUMN snapshot_id text;
-- When it was last paused (its pause lasts until the next resume: `resumed after …`).
ALTER TABLE sandboxes ADD COLUMN paused_at timestamptz;
-- When its state last changed into pausing or resuming: a transition older than its deadline was
-- cut short by a crash and is undone (pausing -> leased, resuming -> paused).
ALTER TABLE sandboxes ADD COLUMN transition_at timestamptz;
-- How the last pause kept it: 'memory' (a checkpoint) or 'files' (/home/user and the package
-- list only, where the runtime cannot checkpoint).
ALTER TABLE sandboxes ADD COLUMN paused_kind text CHECK (paused_kind IN ('memory', 'files'));
