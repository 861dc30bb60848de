-- The database roles of a sandgate deployment, one per process kind, none a superuser. Run by
-- the database's owner (or a superuser) in the sandgate database, before the first
-- `sandgate migrate`, and again whenever a password changes (it is idempotent):
--
--   psql "postgres://ADMIN@HOST:5432/sandgate?sslmode=verify-full&sslrootcert=ca.crt" \
--     -v ON_ERROR_STOP=1 -v migrator_password=… -v gateway_password=… -v node_password=… \
--     -f deploy/postgres/roles.sql
--
--   sandgate_migrator  `sandgate migrate` (the compose `migrate` service, the Kubernetes Job):
--                      creates and owns the tables; after every migration it grants the two
--                      roles below their tables (sandgate_store::schema::grant_roles).
--   sandgate_gateway   `sandgate serve` (and the `sandgate admin` commands): reads and writes
--                      every table, creates none, may not write the migrations' record.
--   sandgate_node      `sandgate node`: only the node's tables (nodes, sandboxes,
--                      sandbox_call_marks; _sqlx_migrations read-only): never signing_keys,
--                      grants, tokens, tenants, audit or transcripts; creates nothing.
--
-- The tables of a database migrated before the roles existed belong to whoever migrated it:
-- give them to the migrator once (`REASSIGN OWNED BY old_owner TO sandgate_migrator;` as a
-- superuser), then run `sandgate migrate` as sandgate_migrator to apply the grants.

\set ON_ERROR_STOP 1

SELECT format('CREATE ROLE %I', r)
  FROM unnest(ARRAY['sandgate_migrator', 'sandgate_gateway', 'sandgate_node']) AS r
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r)
\gexec

ALTER ROLE sandgate_migrator WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
  NOBYPASSRLS PASSWORD :'migrator_password';
ALTER ROLE sandgate_gateway WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
  NOBYPASSRLS PASSWORD :'gateway_password';
ALTER ROLE sandgate_node WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
  NOBYPASSRLS PASSWORD :'node_password';

-- Who may connect at all: the three roles (and the owner), not every role of the cluster.
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', current_database())
\gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO sandgate_migrator, sandgate_gateway, sandgate_node',
              current_database())
\gexec
-- No temporary tables for the node (the gateway and migrator do not make any either).
SELECT format('REVOKE TEMPORARY ON DATABASE %I FROM sandgate_node', current_database())
\gexec

-- Only the migrator creates objects; the others may use the schema's objects they are granted.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO sandgate_migrator;
GRANT USAGE ON SCHEMA public TO sandgate_gateway, sandgate_node;
