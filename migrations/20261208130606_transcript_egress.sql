-- Egress notes (issue 29): after a call that opened or was refused egress connections, its
-- sandbox's transcript notes them (entry kind 'egress'). The kind check is relaxed to allow it (an
-- expand step: older binaries never write it, and skip entries they cannot read).
--
-- Added NOT VALID and validated after, as in 20261208130404: the validation scans the table
-- without blocking its writes.
ALTER TABLE transcript_entries DROP CONSTRAINT transcript_entries_kind_check;
ALTER TABLE transcript_entries ADD CONSTRAINT transcript_entries_kind_check
    CHECK (kind IN ('cell', 'command', 'upload', 'fetch',
                    'pause', 'resume', 'forked_into', 'forked_from', 'egress')) NOT VALID;
ALTER TABLE transcript_entries VALIDATE CONSTRAINT transcript_entries_kind_check;
