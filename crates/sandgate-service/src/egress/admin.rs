//! The operator's commands of a tenant's egress (`sandgate admin tenant egress` and
//! `sandgate admin tenant secret …`): each change checked before anything is stored, made in one
//! transaction with the tenant locked, and audited (`sandgate admin audit`) without a value.

use sandgate_store::egress::{self, EgressRule, SealedSecret, SecretInfo};
use sandgate_store::egress_approvals as approvals;
use sandgate_store::{audit, tenants};
use uuid::Uuid;

use super::rules::parse_rule;
use super::secrets::{SecretBinding, check_secret_name, check_secret_value};
use crate::Config;
use crate::admin::AdminError;

/// Who the audit trail names for a change made with the CLI.
const SUBJECT: &str = "admin:cli";

/// A change to a tenant's egress policy.
#[derive(Debug, Clone, Default)]
pub struct EgressChange {
    /// Take out every rule first (no route out), then apply the others.
    pub deny_all: bool,
    /// Rules to add, `host[:port]` (a rule already there gets the budgets given here).
    pub allow: Vec<String>,
    /// Rules to take out, `host[:port]`.
    pub remove: Vec<String>,
    /// The budget of the rules added: most new connections per minute.
    pub connections_per_minute: Option<i32>,
    /// The budget of the rules added: most bytes (both ways) per day.
    pub bytes_per_day: Option<i64>,
    /// Turn the approval of hosts outside the policy on or off (`None`: leave it).
    pub approvals: Option<bool>,
}

/// A tenant's egress policy as in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    /// The allowed hosts (empty: no route out).
    pub rules: Vec<EgressRule>,
    /// Whether a host outside them may be approved for a sandbox by a person
    /// (`sandgate_store::egress_approvals`).
    pub approvals: bool,
}

impl EgressChange {
    /// Whether it changes nothing (the policy is only shown).
    pub fn is_empty(&self) -> bool {
        !self.deny_all
            && self.allow.is_empty()
            && self.remove.is_empty()
            && self.approvals.is_none()
    }
}

/// Applies `change` to `tenant`'s egress policy and returns the policy in force. Every rule is
/// checked before anything is stored; a change is audited with what it did.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn set_egress(
    config: &Config,
    tenant: Uuid,
    change: &EgressChange,
) -> Result<EgressPolicy, AdminError> {
    let budget = |name: &str, ok: bool| {
        (!ok).then(|| AdminError::InvalidLimit(format!("--{name} must be at least 1")))
    };
    if let Some(err) = budget(
        "connections-per-minute",
        change.connections_per_minute.is_none_or(|n| n >= 1),
    )
    .or_else(|| budget("bytes-per-day", change.bytes_per_day.is_none_or(|n| n >= 1)))
    {
        return Err(err);
    }
    if (change.connections_per_minute.is_some() || change.bytes_per_day.is_some())
        && change.allow.is_empty()
    {
        return Err(AdminError::InvalidLimit(
            "a budget applies to the rules of --allow: name the host[:port] it is for".into(),
        ));
    }
    let allow = change
        .allow
        .iter()
        .map(|r| parse_rule(r, change.connections_per_minute, change.bytes_per_day))
        .collect::<Result<Vec<_>, _>>()?;
    let remove = change
        .remove
        .iter()
        .map(|r| parse_rule(r, None, None))
        .collect::<Result<Vec<_>, _>>()?;

    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    lock_tenant(&mut tx, tenant).await?;
    let mut done = Vec::new();
    if change.deny_all {
        let removed = egress::clear_rules(&mut tx, tenant).await?;
        let ended = approvals::withdraw_all(&mut tx, tenant).await?;
        done.push(format!(
            "deny all ({removed} rule(s) taken out, {ended} request(s) and approval(s) ended)"
        ));
    }
    for rule in &remove {
        if egress::remove_rule(&mut tx, tenant, &rule.host, rule.port).await? {
            done.push(format!("remove {}:{}", rule.host, rule.port));
        }
        // The approvals of the hosts the rule admitted go with it.
        let pattern = super::rules::HostPattern::parse(&rule.host)?;
        let now = chrono::Utc::now();
        let ids: Vec<uuid::Uuid> = approvals::list(&mut tx, tenant, i64::MAX)
            .await?
            .into_iter()
            .filter(|a| {
                a.current(now)
                    && a.state != approvals::ApprovalState::Denied
                    && a.port == rule.port
                    && pattern.matches(&a.host)
            })
            .map(|a| a.id)
            .collect();
        let ended = approvals::withdraw(&mut tx, tenant, &ids).await?;
        if ended > 0 {
            done.push(format!(
                "{ended} request(s) and approval(s) of {}:{} ended",
                rule.host, rule.port
            ));
        }
    }
    for rule in &allow {
        egress::put_rule(&mut tx, tenant, rule).await?;
        done.push(format!("allow {}", render_rule(rule)));
    }
    if let Some(on) = change.approvals {
        if on != approvals::approvals_on(&mut tx, tenant).await? {
            approvals::set_approvals(&mut tx, tenant, on).await?;
            done.push(format!("approvals {}", if on { "on" } else { "off" }));
        }
        if !on {
            let ended = approvals::withdraw_all(&mut tx, tenant).await?;
            if ended > 0 {
                done.push(format!(
                    "{ended} pending request(s) and standing approval(s) ended"
                ));
            }
        }
    }
    if !done.is_empty() {
        audit::record_change(
            &mut tx,
            tenant,
            SUBJECT,
            "admin_tenant_egress",
            &done.join("; "),
        )
        .await?;
    }
    let rules = egress::rules(&mut tx, tenant).await?;
    let approvals = approvals::approvals_on(&mut tx, tenant).await?;
    tx.commit().await?;
    Ok(EgressPolicy { rules, approvals })
}

/// Locks the tenant's row for the transaction; refuses a tenant that does not exist.
async fn lock_tenant(tx: &mut sqlx::PgConnection, tenant: Uuid) -> Result<(), AdminError> {
    tenants::lock(tx, tenant).await?;
    if tenants::get(tx, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    Ok(())
}

fn render_rule(rule: &EgressRule) -> String {
    let mut text = format!("{}:{}", rule.host, rule.port);
    if let Some(n) = rule.connections_per_minute {
        text.push_str(&format!(" ({n} connections/min)"));
    }
    if let Some(n) = rule.bytes_per_day {
        text.push_str(&format!(" ({n} bytes/day)"));
    }
    text
}

/// Renders a tenant's egress policy for the operator.
pub fn render_egress(policy: &EgressPolicy) -> String {
    let rules = &policy.rules;
    if rules.is_empty() {
        let mut out = "no egress: the tenant's sandboxes have no route out".to_owned();
        if policy.approvals {
            out.push_str(
                "\napprovals: on, but without a rule no sandbox has the proxy to ask through",
            );
        }
        return out;
    }
    let mut out = format!(
        "{:<40} {:>5} {:>16} {:>16}",
        "HOST", "PORT", "CONNECTIONS/MIN", "BYTES/DAY"
    );
    let or_none = |n: Option<String>| n.unwrap_or_else(|| "-".into());
    for rule in rules {
        out.push_str(&format!(
            "\n{:<40} {:>5} {:>16} {:>16}",
            rule.host,
            rule.port,
            or_none(rule.connections_per_minute.map(|n| n.to_string())),
            or_none(rule.bytes_per_day.map(|n| n.to_string())),
        ));
    }
    out.push_str(if policy.approvals {
        "\napprovals: on (a host outside these rules that a sandbox asks for can be approved for \
         that sandbox by a user with the approver role, on the console's egress page)"
    } else {
        "\napprovals: off"
    });
    out
}

/// Whether `set_secret` made a secret or replaced one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretWrite {
    /// A new secret.
    Created,
    /// An existing secret's value and bindings replaced (its version raised).
    Replaced,
}

/// Sets secret `name` of `tenant` to `value` (as read from standard input: one line, its final
/// newline dropped), bound to `hosts` and `headers`: creates it, or replaces the value and the
/// bindings of the one of that name. The value is sealed before it leaves this function.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant, name = %name))]
pub async fn set_secret(
    config: &Config,
    tenant: Uuid,
    name: &str,
    hosts: &[String],
    headers: &[String],
    value: &str,
) -> Result<(SecretInfo, SecretWrite), AdminError> {
    check_secret_name(name)?;
    let binding = SecretBinding::parse(hosts, headers)?;
    let value = check_secret_value(value)?;
    let sealer = config.egress_sealer().ok_or(AdminError::NoSecretsKey)?;
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    lock_tenant(&mut tx, tenant).await?;
    let version = egress::next_version(&mut tx, tenant, name).await?;
    let sealed = SealedSecret {
        version,
        sealed: sealer.seal(tenant, name, version, value.as_bytes()),
    };
    let info = egress::put_secret(
        &mut tx,
        tenant,
        name,
        &sealed,
        &binding.hosts,
        &binding.headers,
    )
    .await?;
    let write = if version == 1 {
        SecretWrite::Created
    } else {
        SecretWrite::Replaced
    };
    let action = if version == 1 { "set" } else { "replace" };
    audit_secret(&mut tx, tenant, action, &info).await?;
    tx.commit().await?;
    Ok((info, write))
}

/// Gives secret `name` of `tenant` a new `value` (its bindings kept, its version raised: the
/// old sealed value no longer opens as the current one).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant, name = %name))]
pub async fn rotate_secret(
    config: &Config,
    tenant: Uuid,
    name: &str,
    value: &str,
) -> Result<SecretInfo, AdminError> {
    check_secret_name(name)?;
    let value = check_secret_value(value)?;
    let sealer = config.egress_sealer().ok_or(AdminError::NoSecretsKey)?;
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    lock_tenant(&mut tx, tenant).await?;
    let current = egress::list_secrets(&mut tx, tenant)
        .await?
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| no_such_secret(tenant, name))?;
    let version = current.version + 1;
    let sealed = SealedSecret {
        version,
        sealed: sealer.seal(tenant, name, version, value.as_bytes()),
    };
    let info = egress::put_secret(
        &mut tx,
        tenant,
        name,
        &sealed,
        &current.hosts,
        &current.headers,
    )
    .await?;
    audit_secret(&mut tx, tenant, "rotate", &info).await?;
    tx.commit().await?;
    Ok(info)
}

/// A tenant's secrets: names, bindings, versions and dates, never values.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn list_secrets(config: &Config, tenant: Uuid) -> Result<Vec<SecretInfo>, AdminError> {
    let db = config.migrated_pool().await?;
    let mut conn = db.acquire().await?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    Ok(egress::list_secrets(&mut conn, tenant).await?)
}

/// Deletes secret `name` of `tenant`.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant, name = %name))]
pub async fn delete_secret(config: &Config, tenant: Uuid, name: &str) -> Result<(), AdminError> {
    check_secret_name(name)?;
    let db = config.migrated_pool().await?;
    let mut tx = db.begin().await?;
    lock_tenant(&mut tx, tenant).await?;
    if !egress::delete_secret(&mut tx, tenant, name).await? {
        return Err(no_such_secret(tenant, name));
    }
    audit::record_change(&mut tx, tenant, SUBJECT, "admin_tenant_secret_delete", name).await?;
    tx.commit().await?;
    Ok(())
}

fn no_such_secret(tenant: Uuid, name: &str) -> AdminError {
    AdminError::NoSuchSecret {
        tenant,
        name: name.to_owned(),
    }
}

/// Audits a secret's new value: its name, version and bindings (never the value).
async fn audit_secret(
    tx: &mut sqlx::PgConnection,
    tenant: Uuid,
    action: &str,
    info: &SecretInfo,
) -> Result<(), AdminError> {
    let detail = format!(
        "{} v{} hosts {} headers {}",
        info.name,
        info.version,
        info.hosts.join(","),
        info.headers.join(",")
    );
    audit::record_change(
        tx,
        tenant,
        SUBJECT,
        &format!("admin_tenant_secret_{action}"),
        &detail,
    )
    .await?;
    Ok(())
}

/// Renders secrets as a table: name, version, hosts, headers, dates (never a value).
pub fn render_secrets(secrets: &[SecretInfo]) -> String {
    let mut out = format!(
        "{:<24} {:>7}  {:<40} {:<24} {:<20} {}",
        "NAME", "VERSION", "HOSTS", "HEADERS", "CREATED", "ROTATED"
    );
    for s in secrets {
        out.push_str(&format!(
            "\n{:<24} {:>7}  {:<40} {:<24} {:<20} {}",
            s.name,
            s.version,
            s.hosts.join(","),
            s.headers.join(","),
            s.created_at.format("%Y-%m-%dT%H:%M:%SZ"),
            s.rotated_at.format("%Y-%m-%dT%H:%M:%SZ"),
        ));
    }
    out
}
