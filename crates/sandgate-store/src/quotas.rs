//! A tenant's call quotas, shared by every replica: calls per minute (counted when a call
//! starts) and calls in flight (slots that expire unless renewed, so a replica that dies frees
//! its slots by itself). One row per tenant in `call_quotas`; a call costs one statement at its
//! start ([`admit`]) and one at its end ([`release`]), plus one per renewal while it runs longer
//! than a third of the slot's time to live ([`renew`]).
//!
//! These counters are not durable data: each statement turns `synchronous_commit` off for its
//! own transaction ([`NOT_DURABLE`]), so a call does not wait for the WAL flush at its start and
//! end. A Postgres crash can lose the last few milliseconds of quota state (a few calls counted
//! less, a slot freed twice); nothing else depends on it, and slots expire by themselves anyway.
//!
//! The calls-per-minute limit is GCRA (the generic cell rate algorithm, as `governor` uses):
//! with a limit of N, a burst of N calls is admitted at once, and then one per 60/N seconds; a
//! refused call does not count. Both limits are checked and taken in the same `INSERT … ON
//! CONFLICT DO UPDATE`: the row lock serialises a tenant's call starts, and Postgres evaluates
//! the update on the newest row version, so concurrent starts on any number of replicas never
//! admit more than the limits.

use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;

use crate::StoreError;
use crate::sandboxes::SandboxRow;

/// The limits one call start is checked against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallLimits {
    /// Calls admitted per minute (a burst of this many at once).
    pub per_minute: u32,
    /// Calls running at once.
    pub in_flight: u32,
    /// How long a slot lives without renewal, seconds.
    pub slot_ttl_seconds: u32,
}

/// What [`admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// The call may run; its slot is taken.
    Admitted,
    /// The tenant is over its calls per minute: the next call fits in this many seconds.
    OverRate {
        /// Seconds until the next call fits (at least 1).
        retry_after_seconds: u32,
    },
    /// The tenant has `in_flight` calls running already.
    OverInFlight,
}

/// `SET LOCAL synchronous_commit = off` as an expression: evaluated inside the statement, it
/// holds until the statement's own (implicit) transaction commits, which then does not wait for
/// the WAL to reach the disk. One statement, no extra round trip.
const NOT_DURABLE: &str = "set_config('synchronous_commit', 'off', true)";

/// Live slots of `q.in_flight` (expiry in the future), as a SQL expression.
const LIVE_SLOTS: &str = "(SELECT coalesce(jsonb_object_agg(s.k, s.v), '{}'::jsonb)
       FROM jsonb_each(q.in_flight) AS s(k, v)
      WHERE s.v::float8 > extract(epoch FROM now()))";
/// How many live slots `q.in_flight` holds, as a SQL expression.
const LIVE_COUNT: &str = "(SELECT count(*) FROM jsonb_each(q.in_flight) AS s(k, v)
      WHERE s.v::float8 > extract(epoch FROM now()))";

/// Admits a call of `tenant` under `limits`, taking the slot `slot` (a fresh id), in one
/// statement. A refused call changes nothing.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn admit(
    conn: &mut PgConnection,
    tenant: Uuid,
    slot: &str,
    limits: CallLimits,
) -> Result<Admission, StoreError> {
    Ok(admit_and_read(conn, tenant, slot, limits, None).await?.0)
}

/// [`admit`], and in the same statement (one round trip) the tenant's sandbox `sandbox_id` as
/// it is (read only, like `sandboxes::get`: `None` when the tenant has no such sandbox). The
/// row is read whether or not the call is admitted; a refused call changes nothing.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn admit_and_read(
    conn: &mut PgConnection,
    tenant: Uuid,
    slot: &str,
    limits: CallLimits,
    sandbox_id: Option<&str>,
) -> Result<(Admission, Option<SandboxRow>), StoreError> {
    let per_minute = f64::from(limits.per_minute.max(1));
    // GCRA: the emission interval, and the burst tolerance that admits `per_minute` at once.
    let interval = 60.0 / per_minute;
    let tolerance = 60.0 - interval;
    // Both arms of each CASE see the same (newest, locked) row `q`; a refused start writes the
    // row back unchanged, so RETURNING can say why from the very row that decided.
    let admit = format!(
        "(greatest(q.rate_tat, now()) <= now() + make_interval(secs => $3) AND {LIVE_COUNT} < $4)"
    );
    // The sandbox's row joins the admission's one row (its columns are named apart from the
    // admission's): no sandbox named, or none of the tenant's by that id, leaves them NULL.
    let sql = format!(
        "WITH admission AS (
           INSERT INTO call_quotas AS q (tenant_id, rate_tat, in_flight)
           VALUES ($1, now() + make_interval(secs => $2),
                   jsonb_build_object($5::text, extract(epoch FROM now()) + $6))
           ON CONFLICT (tenant_id) DO UPDATE SET
               rate_tat = CASE WHEN {admit}
                   THEN greatest(q.rate_tat, now()) + make_interval(secs => $2)
                   ELSE q.rate_tat END,
               in_flight = CASE WHEN {admit}
                   THEN {LIVE_SLOTS} || EXCLUDED.in_flight
                   ELSE q.in_flight END
           RETURNING q.in_flight ? $5::text AS admitted,
                     extract(epoch FROM (q.rate_tat - now()))::float8 - $3 AS rate_wait,
                     {NOT_DURABLE} AS not_durable)
         SELECT admission.admitted, admission.rate_wait, admission.not_durable,
                s.id IS NOT NULL AS found, {SANDBOX}
           FROM admission
           LEFT JOIN sandboxes s ON s.id = $7 AND s.tenant_id = $1",
        SANDBOX = crate::sandboxes::COLUMNS
            .split(',')
            .map(|c| format!("s.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", "),
    );
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(interval)
        .bind(tolerance)
        .bind(i64::from(limits.in_flight))
        .bind(slot)
        .bind(f64::from(limits.slot_ttl_seconds))
        .bind(sandbox_id)
        .fetch_one(conn)
        .await?;
    let admitted: bool = row.try_get("admitted")?;
    let rate_wait: f64 = row.try_get("rate_wait")?;
    let sandbox = if row.try_get::<bool, _>("found")? {
        Some(SandboxRow::from_row(&row)?)
    } else {
        None
    };
    if admitted {
        return Ok((Admission::Admitted, sandbox));
    }
    // Over the rate when the (unchanged) row says the next call fits only later; else it was
    // the calls in flight.
    let refused = if rate_wait > 0.0 {
        Admission::OverRate {
            retry_after_seconds: (rate_wait.ceil() as u32).max(1),
        }
    } else {
        Admission::OverInFlight
    };
    Ok((refused, sandbox))
}

/// Frees a call's slot (its start stays counted in the rate).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn release(conn: &mut PgConnection, tenant: Uuid, slot: &str) -> Result<(), StoreError> {
    let sql = format!(
        "UPDATE call_quotas SET in_flight = in_flight - $2 WHERE tenant_id = $1
         RETURNING {NOT_DURABLE}"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(slot)
        .execute(conn)
        .await?;
    Ok(())
}

/// Extends a running call's slot by `ttl_seconds` from now; `false` when the slot is gone (it
/// expired, e.g. while Postgres was away).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn renew(
    conn: &mut PgConnection,
    tenant: Uuid,
    slot: &str,
    ttl_seconds: u32,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE call_quotas
            SET in_flight = jsonb_set(in_flight, ARRAY[$2::text],
                                      to_jsonb(extract(epoch FROM now()) + $3))
          WHERE tenant_id = $1 AND in_flight ? $2",
    )
    .bind(tenant)
    .bind(slot)
    .bind(f64::from(ttl_seconds))
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// How many of a tenant's calls hold a live slot now (for tests and operators).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn in_flight(conn: &mut PgConnection, tenant: Uuid) -> Result<i64, StoreError> {
    let sql = format!("SELECT {LIVE_COUNT} FROM call_quotas AS q WHERE q.tenant_id = $1");
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .fetch_optional(conn)
        .await?
        .unwrap_or(0))
}
