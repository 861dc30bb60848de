//! Operator commands (`sandgate admin …`): tenants and their limits, users, confidential
//! clients, tokens for integrations and tests, keys, the audit trail, live sandboxes.

use std::time::Duration;

use chrono::Utc;
use sandgate_auth::Scope;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::audit::AuditLine;
use sandgate_store::sandboxes::SandboxRow;
use sandgate_store::tenants::TenantLimits;
use sandgate_store::{StoreError, clients, grants, tenants, users};
use uuid::Uuid;

use crate::Config;
use crate::keys::{self, KeyError, KeyRing, KeySettings};
use crate::sandboxes::Limits;
use sandgate_store::admin_tokens::{self, AdminToken};
/// A user's console role (`sandgate admin user role`).
pub use sandgate_store::users::Role as UserRole;

/// What went wrong in an admin command.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The database's schema is not one this binary can run against.
    #[error(transparent)]
    Schema(#[from] sandgate_store::schema::SchemaError),
    /// Postgres failed.
    #[error("database error (is Postgres running at database.url, and migrated?)")]
    Store(#[from] StoreError),
    /// Key handling failed.
    #[error(transparent)]
    Keys(#[from] KeyError),
    /// The tenant does not exist.
    #[error("no tenant with id {0}; `sandgate admin tenant create <name>` makes one")]
    NoSuchTenant(Uuid),
    /// The node RPC's certificates (`node.tls_*`) could not be read.
    #[error(transparent)]
    NodeTls(#[from] sandgate_node::TlsError),
    /// No node has that id.
    #[error("no sandbox node with id {0:?}; `sandgate admin nodes list` shows the ids")]
    NoSuchNode(String),
    /// A tenant with that name exists.
    #[error("a tenant named {0:?} exists already")]
    TenantExists(String),
    /// Token signing failed.
    #[error("issuing the token failed")]
    Token(#[from] sandgate_auth::TokenError),
    /// The password was refused or could not be hashed.
    #[error(transparent)]
    Password(#[from] sandgate_auth::password::PasswordError),
    /// A user with that email exists.
    #[error("a user with email {0:?} exists already")]
    UserExists(String),
    /// No user has that email.
    #[error("no user with email {0:?}; `sandgate admin user create` makes one")]
    NoSuchUser(String),
    /// The email is not plausible.
    #[error("{0:?} is not an email address")]
    BadEmail(String),
    /// A redirect URI was refused.
    #[error(transparent)]
    Client(#[from] sandgate_auth::client::ClientError),
    /// A limit value is out of range.
    #[error("{0}")]
    InvalidLimit(String),
    /// The token lifetime asked for is longer than the configured cap.
    #[error(
        "--ttl {asked}s is longer than the longest admin-token lifetime, {max}s \
         (keys.admin_token_max_ttl_seconds); issue a shorter-lived token, or raise the setting"
    )]
    TokenTtlTooLong {
        /// Asked for, seconds.
        asked: u64,
        /// The cap, seconds.
        max: u64,
    },
    /// An egress rule or host was refused.
    #[error(transparent)]
    EgressRule(#[from] crate::egress::RuleError),
    /// A secret's name, binding or value was refused.
    #[error(transparent)]
    Secret(#[from] crate::egress::SecretError),
    /// No egress secrets key in force (empty off loopback).
    #[error(
        "tenant secrets are off: egress.secrets_key is empty and this deployment is not \
         loopback-only. Set SANDGATE_EGRESS__SECRETS_KEY (or egress.secrets_key in the \
         configuration file) to at least 32 random characters of its own, e.g. the output of \
         `openssl rand -base64 48`, the same on every replica"
    )]
    NoSecretsKey,
    /// The tenant has no secret of that name.
    #[error(
        "tenant {tenant} has no secret named {name}; `sandgate admin tenant secret list {tenant}` \
         shows its secrets"
    )]
    NoSuchSecret {
        /// The tenant.
        tenant: Uuid,
        /// The name asked for.
        name: String,
    },
    /// No admin-issued token has that id.
    #[error("no admin-issued token with id {0:?}; `sandgate admin token list` shows them")]
    NoSuchToken(String),
}

impl From<sqlx::Error> for AdminError {
    /// A failed acquire, begin or commit: classified like any other database failure.
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

/// Changes to a tenant's limits: `Some(Some(v))` sets, `Some(None)` goes back to the default,
/// `None` leaves the limit as it is.
#[derive(Debug, Clone, Default)]
pub struct LimitChanges {
    /// Most live sandboxes at once.
    pub max_sandboxes: Option<Option<i32>>,
    /// Longest idle timeout, seconds.
    pub max_idle_seconds: Option<Option<i32>>,
    /// Longest lifetime, seconds.
    pub max_lifetime_seconds: Option<Option<i32>>,
    /// Memory per sandbox, MiB.
    pub memory_mb: Option<Option<i32>>,
    /// CPU per sandbox, cores.
    pub cpus: Option<Option<f32>>,
    /// Most calls per minute.
    pub max_calls_per_minute: Option<Option<i32>>,
    /// Most open MCP sessions.
    pub max_sessions: Option<Option<i32>>,
    /// Most calls running at once.
    pub max_calls_in_flight: Option<Option<i32>>,
}

/// Applies `changes` to a tenant's limits (all of them back to the defaults first when `reset`)
/// and returns the tenant's own limits and the ones in force.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn set_tenant_limits(
    config: &Config,
    tenant: Uuid,
    reset: bool,
    changes: &LimitChanges,
) -> Result<(TenantLimits, Limits), AdminError> {
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    tenants::lock(&mut tx, tenant).await?;
    let mut own = tenants::limits(&mut tx, tenant)
        .await?
        .ok_or(AdminError::NoSuchTenant(tenant))?;
    if reset {
        own = TenantLimits::default();
    }
    fn apply<T: Copy>(slot: &mut Option<T>, change: Option<Option<T>>) {
        if let Some(value) = change {
            *slot = value;
        }
    }
    apply(&mut own.max_sandboxes, changes.max_sandboxes);
    apply(&mut own.max_idle_seconds, changes.max_idle_seconds);
    apply(&mut own.max_lifetime_seconds, changes.max_lifetime_seconds);
    apply(&mut own.memory_mb, changes.memory_mb);
    apply(&mut own.cpus, changes.cpus);
    apply(&mut own.max_calls_per_minute, changes.max_calls_per_minute);
    apply(&mut own.max_sessions, changes.max_sessions);
    apply(&mut own.max_calls_in_flight, changes.max_calls_in_flight);
    for (name, value) in [
        ("max-sandboxes", own.max_sandboxes),
        ("max-idle-seconds", own.max_idle_seconds),
        ("max-lifetime-seconds", own.max_lifetime_seconds),
        ("max-calls-per-minute", own.max_calls_per_minute),
        ("max-sessions", own.max_sessions),
        ("max-calls-in-flight", own.max_calls_in_flight),
    ] {
        if value.is_some_and(|v| v < 1) {
            return Err(AdminError::InvalidLimit(format!(
                "--{name} must be at least 1"
            )));
        }
    }
    if own.memory_mb.is_some_and(|m| m < 64) {
        return Err(AdminError::InvalidLimit(
            "--memory-mb must be at least 64".into(),
        ));
    }
    if own.cpus.is_some_and(|c| !(c > 0.0 && c <= 64.0)) {
        return Err(AdminError::InvalidLimit(
            "--cpus must be more than 0 and at most 64".into(),
        ));
    }
    let own = tenants::set_limits(&mut tx, tenant, &own)
        .await?
        .ok_or(AdminError::NoSuchTenant(tenant))?;
    tx.commit().await?;
    let effective = Limits::effective(&own, &config.limits, &config.sandbox);
    Ok((own, effective))
}

/// Renders a tenant's limits: each in force, and whether it is the tenant's own or the default.
pub fn render_limits(own: &TenantLimits, effective: &Limits) -> String {
    let source = |set: bool| if set { "tenant" } else { "default" };
    [
        (
            "max_sandboxes",
            effective.max_sandboxes.to_string(),
            own.max_sandboxes.is_some(),
        ),
        (
            "max_idle_seconds",
            effective.max_idle_seconds.to_string(),
            own.max_idle_seconds.is_some(),
        ),
        (
            "max_lifetime_seconds",
            effective.max_lifetime_seconds.to_string(),
            own.max_lifetime_seconds.is_some(),
        ),
        (
            "memory_mb",
            effective.memory_mb.to_string(),
            own.memory_mb.is_some(),
        ),
        ("cpus", effective.cpus.to_string(), own.cpus.is_some()),
        (
            "max_calls_per_minute",
            effective.max_calls_per_minute.to_string(),
            own.max_calls_per_minute.is_some(),
        ),
        (
            "max_sessions",
            effective.max_sessions.to_string(),
            own.max_sessions.is_some(),
        ),
        (
            "max_calls_in_flight",
            effective.max_calls_in_flight.to_string(),
            own.max_calls_in_flight.is_some(),
        ),
    ]
    .into_iter()
    .map(|(name, value, set)| format!("{name:<22} {value:>8}  ({})", source(set)))
    .collect::<Vec<_>>()
    .join("\n")
}

/// A tenant's most recent audit events, newest first, with what each operator change was.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn audit(
    config: &Config,
    tenant: Uuid,
    limit: i64,
) -> Result<Vec<AuditLine>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    Ok(sandgate_store::audit::recent_lines(&mut conn, tenant, limit).await?)
}

/// A change to a tenant's package policy (`sandgate admin tenant packages`).
#[derive(Debug, Default)]
pub struct PackagePolicyChange {
    /// Start from the empty policy (no rules, the configured size limit).
    pub clear: bool,
    /// Rules to add to the allow list.
    pub allow: Vec<String>,
    /// Rules to add to the deny list.
    pub deny: Vec<String>,
    /// Rules to take out of either list (as written when added).
    pub remove: Vec<String>,
    /// The tenant's largest wheel, MiB: `Some(None)` goes back to the configured default.
    pub max_wheel_mb: Option<Option<i32>>,
}

/// Changes a tenant's package policy; every rule is checked (PEP 440 specifiers) before anything
/// is stored. Returns the policy in force.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn set_package_policy(
    config: &Config,
    tenant: Uuid,
    change: PackagePolicyChange,
) -> Result<sandgate_store::packages::PackagePolicy, AdminError> {
    for rule in change.allow.iter().chain(&change.deny) {
        crate::packages::Rule::parse(rule).map_err(AdminError::InvalidLimit)?;
    }
    if let Some(Some(mb)) = change.max_wheel_mb
        && mb <= 0
    {
        return Err(AdminError::InvalidLimit(format!(
            "--max-wheel-mb: {mb} must be more than 0"
        )));
    }
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    let mut policy = if change.clear {
        sandgate_store::packages::PackagePolicy::default()
    } else {
        sandgate_store::packages::policy(&mut conn, tenant).await?
    };
    let add = |list: &mut Vec<String>, rules: Vec<String>| {
        for rule in rules {
            let rule = rule.trim().to_owned();
            if !list.contains(&rule) {
                list.push(rule);
            }
        }
    };
    add(&mut policy.allow, change.allow);
    add(&mut policy.deny, change.deny);
    policy.allow.retain(|r| !change.remove.contains(r));
    policy.deny.retain(|r| !change.remove.contains(r));
    if let Some(max) = change.max_wheel_mb {
        policy.max_wheel_mb = max;
    }
    sandgate_store::packages::set_policy(&mut conn, tenant, &policy).await?;
    Ok(policy)
}

/// Renders a package policy for the operator.
pub fn render_package_policy(
    policy: &sandgate_store::packages::PackagePolicy,
    config: &Config,
) -> String {
    let list = |rules: &[String], empty: &str| {
        if rules.is_empty() {
            empty.to_owned()
        } else {
            rules.join(", ")
        }
    };
    format!(
        "allow: {}\ndeny: {}\nmax_wheel_mb: {}",
        list(&policy.allow, "(any package not denied)"),
        list(&policy.deny, "(none)"),
        policy.max_wheel_mb.map_or_else(
            || format!("{} (default)", config.packages.max_wheel_mb),
            |m| m.to_string()
        ),
    )
}

/// A tenant's package installs (packages on demand), newest first.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn package_installs(
    config: &Config,
    tenant: Uuid,
    limit: i64,
) -> Result<Vec<sandgate_store::packages::PackageInstall>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    Ok(sandgate_store::packages::recent_installs(&mut conn, tenant, limit).await?)
}

/// Renders package installs as a table, one line each.
pub fn render_package_installs(installs: &[sandgate_store::packages::PackageInstall]) -> String {
    let mut out = format!(
        "{:<24} {:<40} {:<24} {:<16} {}",
        "AT", "SANDBOX", "PACKAGE", "VERSION", "SHA256"
    );
    for i in installs {
        out.push_str(&format!(
            "\n{:<24} {:<40} {:<24} {:<16} {}",
            i.at.format("%Y-%m-%dT%H:%M:%S%.3fZ"),
            i.sandbox_id,
            i.project,
            i.version,
            i.sha256,
        ));
    }
    out
}

/// Renders audit events as a table, one line each; an operator's change ends with what it was.
pub fn render_audit(lines: &[AuditLine]) -> String {
    let mut out = format!(
        "{:<24} {:<26} {:<10} {:<16} {:>8}  {:<40} {:<24} {:<40} {}",
        "AT", "TOOL", "OUTCOME", "ERROR", "MS", "SANDBOX", "CONVERSATION", "TOKEN", "BY"
    );
    for AuditLine { event: e, detail } in lines {
        out.push_str(&format!(
            "\n{:<24} {:<26} {:<10} {:<16} {:>8}  {:<40} {:<24} {:<40} {}",
            e.at.format("%Y-%m-%dT%H:%M:%S%.3fZ"),
            e.tool,
            e.outcome.as_str(),
            e.error_kind.map_or("-", |k| k.as_str()),
            e.duration_ms,
            e.sandbox_id.as_deref().unwrap_or("-"),
            e.conversation_id.as_deref().unwrap_or("-"),
            e.token_id.as_deref().unwrap_or("-"),
            e.subject.as_deref().unwrap_or("-"),
        ));
        if let Some(detail) = detail {
            out.push_str(&format!("  {detail}"));
        }
    }
    out
}

/// Live (leased) sandboxes, of one tenant or all, newest first.
#[tracing::instrument(skip_all, fields(tenant_id = ?tenant))]
pub async fn sandboxes(
    config: &Config,
    tenant: Option<Uuid>,
) -> Result<Vec<(SandboxRow, Option<i64>)>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    Ok(sandgate_store::pauses::list_held(&mut conn, tenant).await?)
}

/// The registered sandbox nodes.
pub async fn nodes(config: &Config) -> Result<Vec<sandgate_store::nodes::NodeRow>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    Ok(sandgate_store::nodes::list(&mut conn).await?)
}

/// Drains a node (no new leases; its sandboxes run out), or takes it back (`draining` false).
pub async fn set_node_draining(
    config: &Config,
    id: &str,
    draining: bool,
) -> Result<sandgate_store::nodes::NodeRow, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    sandgate_store::nodes::set_draining(&mut conn, id, draining)
        .await?
        .ok_or_else(|| AdminError::NoSuchNode(id.to_owned()))
}

/// Renders nodes as a table: id, name, URL, slots, live and warm sandboxes, state (`up`,
/// `draining`, `away` once silent past `node.away_after_seconds`, `lost` past
/// `node.lost_after_seconds`), heartbeat age.
pub fn render_nodes(rows: &[sandgate_store::nodes::NodeRow], liveness: (u64, u64)) -> String {
    let (away_after, lost_after) = liveness;
    let past = |age: i64, secs: u64| age > i64::try_from(secs).unwrap_or(i64::MAX);
    let now = Utc::now();
    let mut out = format!(
        "{:<40} {:<20} {:<28} {:>5} {:>5} {:>5} {:<9} {:>9}",
        "NODE", "NAME", "URL", "SLOTS", "LIVE", "WARM", "STATE", "HEARTBEAT"
    );
    for row in rows {
        let age = (now - row.heartbeat_at).num_seconds().max(0);
        let state = if past(age, lost_after) {
            "lost"
        } else if past(age, away_after) {
            "away"
        } else if row.draining {
            "draining"
        } else {
            "up"
        };
        out.push_str(&format!(
            "\n{:<40} {:<20} {:<28} {:>5} {:>5} {:>5} {:<9} {:>8}s",
            row.id,
            row.name,
            row.advertise_url,
            row.slots,
            row.live_sandboxes,
            row.ready_sandboxes,
            state,
            age
        ));
    }
    out
}

/// Renders live sandboxes as a table: owner, conversation, age, and the time left before the idle
/// timeout and the hard lifetime end them.
pub fn render_sandboxes(rows: &[(SandboxRow, Option<i64>)]) -> String {
    let now = Utc::now();
    let secs = |d: chrono::TimeDelta| format!("{}s", d.num_seconds().max(0));
    let mut out = format!(
        "{:<36} {:<36} {:<24} {:<8} {:>8} {:>10} {:>12} {:>12}",
        "SANDBOX", "TENANT", "CONVERSATION", "STATE", "AGE", "IDLE LEFT", "LIFE LEFT", "SNAPSHOT"
    );
    for (row, snapshot_bytes) in rows {
        let state = match row.state {
            sandgate_store::sandboxes::SandboxState::Pausing => "pausing",
            sandgate_store::sandboxes::SandboxState::Paused => "paused",
            sandgate_store::sandboxes::SandboxState::Resuming => "resuming",
            _ => "running",
        };
        let age = row.leased_at.map_or("-".into(), |t| secs(now - t));
        // Time paused is not idle: a paused sandbox has no idle deadline.
        let idle_left = match state {
            "running" => row.idle_deadline().map_or("-".into(), |t| secs(t - now)),
            _ => "-".into(),
        };
        let life_left = row.expires_at.map_or("-".into(), |t| secs(t - now));
        let size = snapshot_bytes.map_or("-".into(), |b| format!("{b} B"));
        out.push_str(&format!(
            "\n{:<36} {:<36} {:<24} {:<8} {:>8} {:>10} {:>12} {:>12}",
            row.id,
            row.tenant_id.map_or("-".into(), |t| t.to_string()),
            row.conversation_id.as_deref().unwrap_or("-"),
            state,
            age,
            idle_left,
            life_left,
            size
        ));
    }
    out
}

/// Creates a tenant and returns it.
#[tracing::instrument(skip_all)]
pub async fn create_tenant(config: &Config, name: &str) -> Result<tenants::Tenant, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    match tenants::create(&mut conn, name).await {
        Err(StoreError::Query(sqlx_err))
            if sqlx_err
                .as_database_error()
                .is_some_and(|e| e.is_unique_violation()) =>
        {
            Err(AdminError::TenantExists(name.to_owned()))
        }
        other => Ok(other?),
    }
}

/// Issues an access token for `tenant` with `scopes`, valid for `ttl` (at most
/// `keys.admin_token_max_ttl_seconds`), whose audience is this gateway's MCP URL. For
/// server-to-server integrations and tests. The token is recorded (`admin token list`) and can
/// be revoked (`admin token revoke`); returns it and its record.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn issue_token(
    config: &Config,
    tenant: Uuid,
    scopes: &[Scope],
    ttl: Duration,
) -> Result<(String, AdminToken), AdminError> {
    let max = config.keys.admin_token_max_ttl_seconds;
    if ttl.as_secs() > max {
        return Err(AdminError::TokenTtlTooLong {
            asked: ttl.as_secs(),
            max,
        });
    }
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    drop(conn);
    let ring = KeyRing::load(
        db.clone(),
        KeySettings::of(config),
        config.public_url(),
        config.mcp_url(),
    )
    .await?;
    let issuer = ring.issuer();
    let (token, claims) = issuer.issue(
        &format!("admin:{tenant}"),
        tenant,
        scopes,
        &config.mcp_url(),
        ttl,
        None,
        None,
    )?;
    let at = |secs: i64| chrono::DateTime::from_timestamp(secs, 0).unwrap_or_else(Utc::now);
    let record = AdminToken {
        jti: claims.jti,
        tenant_id: tenant,
        scopes: claims.scope,
        kid: issuer.kid().to_owned(),
        created_at: at(claims.iat),
        expires_at: at(claims.exp),
        revoked_at: None,
    };
    let mut conn = db.acquire().await?;
    admin_tokens::record(&mut conn, &record).await?;
    Ok((token, record))
}

/// Admin-issued tokens, of one tenant or all, newest first (expired ones with `all`).
#[tracing::instrument(skip_all)]
pub async fn list_tokens(
    config: &Config,
    tenant: Option<Uuid>,
    all: bool,
) -> Result<Vec<AdminToken>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    Ok(admin_tokens::list(&mut conn, tenant, all).await?)
}

/// Renders admin-issued tokens as a table, one line each.
pub fn render_tokens(tokens: &[AdminToken]) -> String {
    let now = Utc::now();
    let mut out = format!(
        "{:<32} {:<36} {:<20} {:<20} {:<8} {}",
        "ID", "TENANT", "ISSUED", "EXPIRES", "STATE", "SCOPES"
    );
    for t in tokens {
        let state = if t.revoked_at.is_some() {
            "revoked"
        } else if t.expires_at <= now {
            "expired"
        } else {
            "active"
        };
        out.push_str(&format!(
            "\n{:<32} {:<36} {:<20} {:<20} {:<8} {}",
            t.jti,
            t.tenant_id,
            t.created_at.format("%Y-%m-%dT%H:%M:%SZ"),
            t.expires_at.format("%Y-%m-%dT%H:%M:%SZ"),
            state,
            t.scopes
        ));
    }
    out
}

/// Revokes an admin-issued token by id: every gateway refuses it from its next request on.
#[tracing::instrument(skip_all)]
pub async fn revoke_token(config: &Config, id: &str) -> Result<AdminToken, AdminError> {
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    let token = admin_tokens::revoke(&mut tx, id.trim())
        .await?
        .ok_or_else(|| AdminError::NoSuchToken(id.to_owned()))?;
    tx.commit().await?;
    Ok(token)
}

/// Rotates the signing key; returns the new key's id.
#[tracing::instrument(skip_all)]
pub async fn rotate_keys(config: &Config) -> Result<String, AdminError> {
    let db = config.migrated_pool().await?;
    let settings = KeySettings::of(config);
    // Rows from before seeds were sealed are sealed first, as a gateway start would.
    keys::seal_clear_seeds(&db, &settings.sealer).await?;
    Ok(keys::rotate(&db, &settings).await?)
}

/// Creates a user of `tenant` who can log in to approve apps; returns the user's id.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn create_user(
    config: &Config,
    tenant: Uuid,
    email: &str,
    password: &str,
) -> Result<Uuid, AdminError> {
    let email = email.trim();
    if !email.contains('@') || email.len() > 254 || email.chars().any(char::is_whitespace) {
        return Err(AdminError::BadEmail(email.to_owned()));
    }
    let hash = sandgate_auth::password::hash_password(password)?;
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    match users::create(&mut conn, tenant, email, &hash).await {
        Ok(user) => Ok(user.id),
        Err(StoreError::Conflict(_)) => Err(AdminError::UserExists(email.to_owned())),
        Err(err) => Err(err.into()),
    }
}

/// Sets the console role of the user with `email`; returns the user's id and tenant.
#[tracing::instrument(skip_all)]
pub async fn set_user_role(
    config: &Config,
    email: &str,
    role: users::Role,
) -> Result<(Uuid, Uuid), AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    match users::set_role(&mut conn, email.trim(), role).await? {
        Some(user) => Ok((user.id, user.tenant_id)),
        None => Err(AdminError::NoSuchUser(email.trim().to_owned())),
    }
}

/// Ends every browser session of the user with `email` (they must sign in again); returns how
/// many ended.
#[tracing::instrument(skip_all)]
pub async fn revoke_user_sessions(config: &Config, email: &str) -> Result<u64, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    users::revoke_sessions(&mut conn, email.trim())
        .await?
        .ok_or_else(|| AdminError::NoSuchUser(email.trim().to_owned()))
}

/// A confidential client made by `sandgate admin client create`.
#[derive(Debug)]
pub struct CreatedClient {
    /// `client_id`.
    pub client_id: String,
    /// The secret, shown once.
    pub client_secret: String,
}

/// Creates a confidential client acting for `tenant`: it may use client credentials with
/// `scopes` (its connection is recorded as a grant, so it shows up and can be revoked), and the
/// authorization code flow with `redirect_uris`.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn create_client(
    config: &Config,
    tenant: Uuid,
    name: &str,
    redirect_uris: &[String],
    scopes: &[Scope],
) -> Result<CreatedClient, AdminError> {
    for uri in redirect_uris {
        sandgate_auth::client::check_redirect_uri(uri)?;
    }
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    if tenants::get(&mut tx, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    let client_id = format!("sgcl_{}", Uuid::new_v4().simple());
    let client_secret = secret::generate(SecretKind::ClientSecret);
    let scope_string = scopes
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let grant_types: Vec<String> = ["authorization_code", "refresh_token", "client_credentials"]
        .map(str::to_owned)
        .to_vec();
    clients::upsert(
        &mut tx,
        &clients::NewClient {
            id: &client_id,
            kind: "confidential",
            name,
            redirect_uris,
            auth_method: "client_secret_basic",
            secret_hash: Some(&secret::hash(&client_secret)),
            grant_types: &grant_types,
            scopes: Some(&scope_string),
            tenant_id: Some(tenant),
        },
    )
    .await?;
    grants::approve(&mut tx, tenant, None, &client_id, &scope_string).await?;
    tx.commit().await?;
    Ok(CreatedClient {
        client_id,
        client_secret,
    })
}
