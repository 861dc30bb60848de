//! The schema a binary runs against: applying the migrations embedded in it (`sandgate migrate`)
//! and checking, without changing anything, that a database has every one of them
//! (`sandgate serve` and `sandgate node` in a deployment).
//!
//! Migrations only add (expand, then contract: docs/scale-out.md, "Upgrades"), so a database
//! with migrations this binary does not know was migrated by a newer binary and still holds
//! everything this one uses: both the check and [`migrate`] accept it (sqlx's `Migrator`
//! refuses it by default, which would stop an older replica from restarting mid-rollout or
//! after a rollback).

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::StoreError;

/// The migrations embedded in this binary (the repository's `migrations/` folder), accepting
/// applied migrations it does not know.
fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("../../migrations");
    migrator.set_ignore_missing(true);
    migrator
}

/// Why the database's schema is not one this binary can run against.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// The database could not be asked.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No migration was ever applied.
    #[error(
        "the database has no sandgate schema yet: run `sandgate migrate` (as the migrator role) first"
    )]
    Empty,
    /// Migrations of this binary are not applied yet.
    #[error(
        "the database schema is older than this binary ({missing} migration(s) missing, the first \
         {first}): run `sandgate migrate` of this version first"
    )]
    Behind {
        /// How many are missing.
        missing: usize,
        /// The first missing version.
        first: i64,
    },
    /// A migration failed half-way (sqlx records it as not successful).
    #[error(
        "migration {0} is recorded as failed in _sqlx_migrations: repair it, then run `sandgate migrate`"
    )]
    Dirty(i64),
    /// An applied migration differs from the one of the same version in this binary.
    #[error(
        "migration {0} applied to the database differs from this binary's: a migration was edited \
         after it was applied (never do that: add a new one)"
    )]
    Changed(i64),
}

/// The migrations embedded in this binary, oldest first: (version, description).
pub fn known() -> impl Iterator<Item = (i64, String)> {
    migrator()
        .iter()
        .map(|m| (m.version, m.description.to_string()))
        .collect::<Vec<_>>()
        .into_iter()
}

/// The database role of gateways (`sandgate serve`) in a deployment (`deploy/postgres/roles.sql`).
pub const GATEWAY_ROLE: &str = "sandgate_gateway";
/// The database role of nodes (`sandgate node`) in a deployment.
pub const NODE_ROLE: &str = "sandgate_node";

/// Every table a node reads or writes, with what it may do there; nothing else is granted to
/// [`NODE_ROLE`] (no `signing_keys`, grants, tokens, tenants, audit, transcripts).
/// `nodes`: its registration and heartbeat; `sandboxes`: its warm rows, the reaper and
/// reconciliation of its rows; `sandbox_call_marks`: expired marks purged by its lifecycle;
/// `_sqlx_migrations`: the schema check.
pub const NODE_TABLES: &[(&str, &str)] = &[
    ("_sqlx_migrations", "SELECT"),
    ("nodes", "SELECT, INSERT, UPDATE"),
    ("sandboxes", "SELECT, INSERT, UPDATE, DELETE"),
    ("sandbox_call_marks", "SELECT, DELETE"),
];

/// Applies the pending migrations embedded in this binary. Migrations recorded in the database
/// that this binary does not know (a newer binary applied them) are left as they are. Then the
/// process roles' grants, when the deployment made the roles ([`grant_roles`]).
#[tracing::instrument(skip_all)]
pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    migrator()
        .run(pool)
        .await
        .map_err(StoreError::from_migrate)?;
    grant_roles(pool).await
}

/// Grants [`GATEWAY_ROLE`] reading and writing every table (the migrations' record read-only)
/// and [`NODE_ROLE`] exactly [`NODE_TABLES`] (all else revoked), for each of the two roles that
/// exists; run by the migrator (the tables' owner) after every migration, so that a new table
/// is the gateway's and never the node's unless listed. Without the roles (one machine, one
/// superuser) it does nothing.
#[tracing::instrument(skip_all)]
pub async fn grant_roles(pool: &PgPool) -> Result<(), StoreError> {
    let mut tx = crate::begin(pool).await?;
    let existing: Vec<String> =
        sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE rolname::text = ANY($1)")
            .bind([GATEWAY_ROLE, NODE_ROLE])
            .fetch_all(&mut *tx)
            .await?;
    let mut statements = Vec::new();
    if existing.iter().any(|r| r == GATEWAY_ROLE) {
        statements.extend([
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {GATEWAY_ROLE}"
            ),
            format!("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {GATEWAY_ROLE}"),
            format!("REVOKE INSERT, UPDATE, DELETE ON _sqlx_migrations FROM {GATEWAY_ROLE}"),
        ]);
    }
    if existing.iter().any(|r| r == NODE_ROLE) {
        statements.push(format!(
            "REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {NODE_ROLE}"
        ));
        statements.push(format!(
            "REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {NODE_ROLE}"
        ));
        for (table, privileges) in NODE_TABLES {
            statements.push(format!("GRANT {privileges} ON {table} TO {NODE_ROLE}"));
        }
    }
    for statement in statements {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await?;
    }
    crate::commit(tx).await
}

/// Checks, changing nothing, that every migration of this binary is applied, successfully and
/// unchanged. Later ones it does not know are fine (they only added).
#[tracing::instrument(skip_all)]
pub async fn check(pool: &PgPool) -> Result<(), SchemaError> {
    let mut conn = crate::acquire(pool).await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .map_err(StoreError::from)?;
    if !exists {
        return Err(SchemaError::Empty);
    }
    let applied: Vec<(i64, Vec<u8>, bool)> =
        sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations")
            .fetch_all(&mut *conn)
            .await
            .map_err(StoreError::from)?;
    if applied.is_empty() {
        return Err(SchemaError::Empty);
    }
    if let Some((version, _, _)) = applied.iter().find(|(_, _, ok)| !ok) {
        return Err(SchemaError::Dirty(*version));
    }
    let mut missing = Vec::new();
    for migration in migrator().iter() {
        match applied.iter().find(|(v, _, _)| *v == migration.version) {
            None => missing.push(migration.version),
            Some((_, checksum, _)) if checksum.as_slice() != migration.checksum.as_ref() => {
                return Err(SchemaError::Changed(migration.version));
            }
            Some(_) => {}
        }
    }
    match missing.first() {
        None => Ok(()),
        Some(first) => Err(SchemaError::Behind {
            missing: missing.len(),
            first: *first,
        }),
    }
}

/// The expand/contract rule (docs/scale-out.md, "Upgrades"), checked for every migration after
/// [`rule::FIRST_CHECKED`]: a migration only adds, so that the binary before it keeps running
/// on the schema after it (a rollout runs both; a rollback runs the older one).
#[cfg(test)]
mod rule {
    use std::path::Path;

    /// Migrations up to this version predate the rule (they ran before any deployment was
    /// rolled while serving) and are left as they are.
    const FIRST_CHECKED: i64 = 20261204200001;

    /// Contract steps: migrations allowed to remove or change what an older binary uses, each
    /// only once no binary that uses it runs any more (a release after the one that stopped
    /// using it). Empty so far.
    const CONTRACT_STEPS: &[i64] = &[];

    /// What an older binary would trip over: a table, column or type gone or renamed, a
    /// column's type changed, a column it never fills made mandatory.
    const NOT_ADDITIVE: &[&str] = &[
        "DROP TABLE",
        "DROP COLUMN",
        "DROP TYPE",
        "DROP FUNCTION",
        "DROP VIEW",
        "RENAME",
        " TYPE ",
        "SET NOT NULL",
        "TRUNCATE",
    ];

    /// The SQL of `path` without comments, upper-cased, whitespace collapsed.
    fn statements(sql: &str) -> String {
        let text: String = sql
            .lines()
            .map(|l| l.split("--").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(" ");
        text.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_uppercase()
    }

    /// Why `sql` (migration `version`) breaks the rule, if it does.
    fn problems(sql: &str) -> Vec<String> {
        let text = statements(sql);
        let mut found = Vec::new();
        for pattern in NOT_ADDITIVE {
            // `ALTER TYPE … ADD VALUE` adds; `ALTER COLUMN … TYPE` changes.
            if *pattern == " TYPE " {
                if text.contains("ALTER COLUMN") && text.contains(" TYPE ") {
                    found.push("ALTER COLUMN … TYPE".to_owned());
                }
                continue;
            }
            if text.contains(pattern) {
                found.push((*pattern).to_owned());
            }
        }
        // A NOT NULL column without a default: an older binary's INSERT fails.
        for part in text.split("ADD COLUMN").skip(1) {
            let column = part.split(',').next().unwrap_or_default();
            let column = column.split(';').next().unwrap_or_default();
            if column.contains("NOT NULL") && !column.contains("DEFAULT") {
                found.push(format!("ADD COLUMN{column} (NOT NULL without DEFAULT)"));
            }
        }
        // An index on a table that already has rows is built CONCURRENTLY, which Postgres
        // allows only outside a transaction (sqlx: `-- no-transaction` as the first line).
        let created: Vec<&str> = text
            .match_indices("CREATE TABLE ")
            .filter_map(|(i, _)| {
                text[i + "CREATE TABLE ".len()..]
                    .trim_start_matches("IF NOT EXISTS ")
                    .split([' ', '('])
                    .next()
            })
            .collect();
        for (i, _) in text.match_indices(" INDEX ") {
            let before = &text[..i];
            if !before.ends_with("CREATE") && !before.ends_with("CREATE UNIQUE") {
                continue;
            }
            let rest = &text[i..];
            let table = rest
                .split(" ON ")
                .nth(1)
                .and_then(|t| t.trim_start_matches("ONLY ").split([' ', '(']).next())
                .unwrap_or_default();
            if created.contains(&table) {
                continue;
            }
            let concurrent = rest.starts_with(" INDEX CONCURRENTLY");
            let no_tx = sql.trim_start().starts_with("-- no-transaction");
            if !concurrent || !no_tx {
                found.push(format!(
                    "an index on the existing table {table} not built CONCURRENTLY in a \
                     `-- no-transaction` migration"
                ));
            }
        }
        // sqlx sends a no-transaction migration as one simple query, and Postgres runs the
        // statements of one simple query in an implicit transaction: a second statement beside
        // `CREATE INDEX CONCURRENTLY` makes it fail ("cannot run inside a transaction block").
        let no_tx = sql.trim_start().starts_with("-- no-transaction");
        let count = text.split(';').filter(|s| !s.trim().is_empty()).count();
        if no_tx && count > 1 {
            found.push(format!(
                "a `-- no-transaction` migration with {count} statements (one per file)"
            ));
        }
        found
    }

    #[test]
    fn every_new_migration_only_adds_and_builds_indexes_concurrently() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).expect("the migrations folder") {
            let path = entry.expect("an entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let Some(version) = name.split('_').next().and_then(|v| v.parse::<i64>().ok()) else {
                continue;
            };
            if version < FIRST_CHECKED || CONTRACT_STEPS.contains(&version) {
                continue;
            }
            checked += 1;
            let sql = std::fs::read_to_string(&path).expect("a migration");
            let found = problems(&sql);
            assert!(
                found.is_empty(),
                "migration {name} is not additive ({found:?}): split it into an expand step \
                 now and a contract step (listed in CONTRACT_STEPS) a release later; see \
                 docs/scale-out.md, Upgrades"
            );
        }
        let _ = checked;
    }

    #[test]
    fn the_rule_catches_what_an_older_binary_would_trip_over() {
        for bad in [
            "ALTER TABLE sandboxes DROP COLUMN node;",
            "ALTER TABLE nodes RENAME COLUMN slots TO capacity;",
            "ALTER TABLE nodes ALTER COLUMN slots TYPE bigint;",
            "ALTER TABLE nodes ADD COLUMN zone text NOT NULL;",
            "ALTER TABLE nodes ALTER COLUMN name SET NOT NULL;",
            "DROP TABLE snapshots;",
            "CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant_id);",
            "CREATE INDEX CONCURRENTLY sandboxes_by_tenant ON sandboxes (tenant_id);",
            "-- no-transaction\nCREATE INDEX CONCURRENTLY a ON sandboxes (tenant_id);\n\
             CREATE INDEX CONCURRENTLY b ON sandboxes (node);",
        ] {
            assert!(!problems(bad).is_empty(), "caught: {bad}");
        }
        for good in [
            "ALTER TABLE nodes ADD COLUMN zone text;",
            "ALTER TABLE nodes ADD COLUMN zone text NOT NULL DEFAULT '';",
            "CREATE TABLE pauses (id text PRIMARY KEY); CREATE INDEX pauses_by_id ON pauses (id);",
            "-- no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS s_t ON sandboxes (tenant_id);",
            "ALTER TYPE sandbox_state ADD VALUE IF NOT EXISTS 'away';",
        ] {
            assert!(
                problems(good).is_empty(),
                "allowed: {good}: {:?}",
                problems(good)
            );
        }
    }
}
