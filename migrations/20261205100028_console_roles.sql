-- Issue 28: a console where a tenant's users take over a live sandbox. Expand-only: new
-- columns with defaults, nothing dropped or renamed.

-- A user's role: 'viewer' (reads conversations, as every user could so far) or 'takeover'
-- (may also run code and move files in the tenant's sandboxes). Set with
-- `sandgate admin user role`.
ALTER TABLE users ADD COLUMN role text NOT NULL DEFAULT 'viewer'
    CHECK (role IN ('viewer', 'takeover'));

-- When the session's user last proved their password (sign-in, or the console's confirmation):
-- running code needs a recent one, so a stolen cookie alone goes stale.
ALTER TABLE user_sessions ADD COLUMN authenticated_at timestamptz NOT NULL DEFAULT now();

-- When a person last acted in a sandbox from the console (and who), and when the bot was last
-- told: the bot's next tool result carries a note while people_acted_at is newer.
ALTER TABLE sandboxes ADD COLUMN people_acted_at timestamptz;
ALTER TABLE sandboxes ADD COLUMN people_acted_by text;
ALTER TABLE sandboxes ADD COLUMN people_told_at timestamptz;
