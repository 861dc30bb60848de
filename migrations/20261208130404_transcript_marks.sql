-- Transcript marks (issue 27): a sandbox's transcript also records its pauses, resumes and forks.
-- The kind check is relaxed to allow them (an expand step: older binaries write only the old
-- kinds, and skip entries they cannot read).
--
-- The check is added NOT VALID and validated after: validation scans the table without blocking
-- its writes (a plain ADD CONSTRAINT would hold an exclusive lock for the whole scan).
ALTER TABLE transcript_entries DROP CONSTRAINT transcript_entries_kind_check;
ALTER TABLE transcript_entries ADD CONSTRAINT transcript_entries_kind_check
    CHECK (kind IN ('cell', 'command', 'upload', 'fetch',
                    'pause', 'resume', 'forked_into', 'forked_from')) NOT VALID;
ALTER TABLE transcript_entries VALIDATE CONSTRAINT transcript_entries_kind_check;
