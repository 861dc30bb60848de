//! Transcripts: what ran in each sandbox, kept after the sandbox ends (bounded per sandbox) so a
//! person can take over the conversation; deleted after the retention period.
//!
//! Every read takes the caller's tenant and filters by it: another tenant's transcript is
//! indistinguishable from one that does not exist. Entries are opaque JSON here (the
//! `sandgate-transcript` crate gives them their shape).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use sqlx::types::JsonValue;
use uuid::Uuid;

use crate::StoreError;

/// How much one sandbox's transcript keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// Most entries.
    pub max_entries: i32,
    /// Most bytes of entry JSON.
    pub max_bytes: i64,
    /// Most bytes of entry JSON over all of the tenant's transcripts.
    pub tenant_max_bytes: i64,
}

/// Whose transcript entries are appended: a sandbox and its owner.
#[derive(Debug, Clone, Copy)]
pub struct Owner<'a> {
    /// The sandbox's owner.
    pub tenant_id: Uuid,
    /// The sandbox.
    pub sandbox_id: &'a str,
    /// Its conversation, if any.
    pub conversation_id: Option<&'a str>,
}

/// An entry to append.
#[derive(Debug, Clone, Copy)]
pub struct NewEntry<'a> {
    /// When it happened (the call's end).
    pub at: DateTime<Utc>,
    /// `cell`, `command`, `upload` or `fetch`.
    pub kind: &'a str,
    /// The entry.
    pub body: &'a JsonValue,
    /// Its size as JSON text, bytes.
    pub bytes: i64,
}

/// Whether an appended entry was kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// Kept at this position.
    Kept(i32),
    /// Not kept: the transcript is at its bound (it counts one more dropped entry).
    Dropped,
    /// Not kept: the tenant's transcripts are at their byte budget (counted as dropped, and
    /// as over budget).
    OverBudget,
}

/// Appends entries, in order, to a sandbox's transcript; an entry that does not fit the bound
/// (the sandbox's, or the tenant's byte budget over all its transcripts) is counted as dropped
/// instead (a later, smaller one may still fit). Takes the transcript's row lock, so appends
/// from several processes get consecutive positions, and the tenant's transcript lock (a
/// transaction-scoped advisory lock), so appends to several of its sandboxes at once do not
/// pass the budget together; run it in a transaction. Four statements however many entries.
///
/// Entries are written behind the calls that made them, so they may arrive after an
/// operator's purge of the tenant (`sandgate admin tenant purge`, which closes the live
/// sandboxes as `purged` and deletes their transcripts): for a sandbox closed as `purged`
/// nothing is written and the result is empty. The sandbox's row is share-locked first, so a
/// purge running at the same moment either sees these entries and deletes them, or is seen.
#[tracing::instrument(skip_all, fields(sandbox_id = owner.sandbox_id, entries = new.len()))]
pub async fn append_all(
    conn: &mut PgConnection,
    owner: Owner<'_>,
    new: &[NewEntry<'_>],
    bound: Bound,
) -> Result<Vec<Appended>, StoreError> {
    // The tenant's bytes under its lock (namespaced by the table's oid, so no other advisory
    // lock of this database shares the key), then this transcript's row: the no-op update
    // takes the row lock and returns the counts as they are.
    sqlx::query(
        "SELECT 1 FROM pg_advisory_xact_lock('transcripts'::regclass::oid::int4, hashtext($1::text))",
    )
    .bind(owner.tenant_id)
    .execute(&mut *conn)
    .await?;
    let tenant_bytes = tenant_bytes(conn, owner.tenant_id).await?;
    let counts: Option<(i32, i64)> = sqlx::query_as(
        "WITH sandbox AS (SELECT id FROM sandboxes
                           WHERE id = $1 AND close_reason IS DISTINCT FROM 'purged'
                           FOR SHARE)
         INSERT INTO transcripts (sandbox_id, tenant_id, conversation_id)
         SELECT id, $2, $3 FROM sandbox
         ON CONFLICT (sandbox_id) DO UPDATE SET entries = transcripts.entries
         RETURNING entries, bytes",
    )
    .bind(owner.sandbox_id)
    .bind(owner.tenant_id)
    .bind(owner.conversation_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((entries, bytes)) = counts else {
        return Ok(Vec::new());
    };
    let plan = plan(new, bound, entries, bytes, tenant_bytes);
    sqlx::query(
        "WITH e AS (INSERT INTO transcript_entries (sandbox_id, seq, at, kind, body)
                    SELECT $1, u.seq, u.at, u.kind, u.body
                      FROM UNNEST($2::int4[], $3::timestamptz[], $4::text[], $5::jsonb[])
                           AS u(seq, at, kind, body))
         UPDATE transcripts SET entries = $6, bytes = $7, dropped = dropped + $8,
                                over_budget = over_budget + $9
          WHERE sandbox_id = $1",
    )
    .bind(owner.sandbox_id)
    .bind(plan.seqs)
    .bind(plan.ats)
    .bind(plan.kinds)
    .bind(plan.bodies)
    .bind(plan.entries)
    .bind(plan.bytes)
    .bind(plan.dropped)
    .bind(plan.over_budget)
    .execute(conn)
    .await?;
    Ok(plan.appended)
}

/// Which of a batch are kept, and the columns to insert.
struct Plan<'a> {
    appended: Vec<Appended>,
    seqs: Vec<i32>,
    ats: Vec<DateTime<Utc>>,
    kinds: Vec<&'a str>,
    bodies: Vec<&'a JsonValue>,
    entries: i32,
    bytes: i64,
    dropped: i32,
    over_budget: i32,
}

/// Decides entry by entry what fits: the sandbox's bound first, then the tenant's budget.
fn plan<'a>(
    new: &[NewEntry<'a>],
    bound: Bound,
    mut entries: i32,
    mut bytes: i64,
    mut tenant_bytes: i64,
) -> Plan<'a> {
    let mut plan = Plan {
        appended: Vec::with_capacity(new.len()),
        seqs: vec![],
        ats: vec![],
        kinds: vec![],
        bodies: vec![],
        entries,
        bytes,
        dropped: 0,
        over_budget: 0,
    };
    for entry in new {
        if entries >= bound.max_entries || bytes + entry.bytes > bound.max_bytes {
            plan.dropped += 1;
            plan.appended.push(Appended::Dropped);
            continue;
        }
        if tenant_bytes + entry.bytes > bound.tenant_max_bytes {
            plan.dropped += 1;
            plan.over_budget += 1;
            plan.appended.push(Appended::OverBudget);
            continue;
        }
        entries += 1;
        bytes += entry.bytes;
        tenant_bytes += entry.bytes;
        plan.seqs.push(entries);
        plan.ats.push(entry.at);
        plan.kinds.push(entry.kind);
        plan.bodies.push(entry.body);
        plan.appended.push(Appended::Kept(entries));
    }
    plan.entries = entries;
    plan.bytes = bytes;
    plan
}

/// A sandbox's transcript, without its entries.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Summary {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its conversation.
    pub conversation_id: Option<String>,
    /// When the sandbox was leased.
    pub leased_at: Option<DateTime<Utc>>,
    /// When it ended.
    pub closed_at: Option<DateTime<Utc>>,
    /// Entries kept.
    pub entries: i32,
    /// Bytes kept.
    pub bytes: i64,
    /// Entries not kept.
    pub dropped: i32,
    /// Of those, entries not kept for the tenant's byte budget.
    pub over_budget: i32,
}

const SUMMARY: &str =
    "SELECT t.sandbox_id, t.conversation_id, s.leased_at, s.closed_at, t.entries, t.bytes,
            t.dropped, t.over_budget
     FROM transcripts t JOIN sandboxes s ON s.id = t.sandbox_id";

/// The transcript of one of the tenant's sandboxes.
#[tracing::instrument(skip_all, fields(sandbox_id))]
pub async fn of_sandbox(
    conn: &mut PgConnection,
    tenant: Uuid,
    sandbox_id: &str,
) -> Result<Option<Summary>, StoreError> {
    Ok(sqlx::query_as::<_, Summary>(sqlx::AssertSqlSafe(format!(
        "{SUMMARY} WHERE t.tenant_id = $1 AND t.sandbox_id = $2"
    )))
    .bind(tenant)
    .bind(sandbox_id)
    .fetch_optional(conn)
    .await?)
}

/// The transcripts of a tenant's conversation, one per sandbox it had, newest first, at most
/// `limit` of them (a conversation's sandboxes are unbounded over time).
#[tracing::instrument(skip_all)]
pub async fn of_conversation(
    conn: &mut PgConnection,
    tenant: Uuid,
    conversation_id: &str,
    limit: i64,
) -> Result<Vec<Summary>, StoreError> {
    Ok(sqlx::query_as::<_, Summary>(sqlx::AssertSqlSafe(format!(
        "{SUMMARY} WHERE t.tenant_id = $1 AND t.conversation_id = $2
         ORDER BY s.leased_at DESC NULLS LAST, t.created_at DESC LIMIT $3"
    )))
    .bind(tenant)
    .bind(conversation_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// What a tenant's conversation holds beyond its newest `skip` sandboxes: how many, their
/// kept entries and bytes (for the note of an export that leaves them out).
#[tracing::instrument(skip_all)]
pub async fn older_of_conversation(
    conn: &mut PgConnection,
    tenant: Uuid,
    conversation_id: &str,
    skip: i64,
) -> Result<(i64, i64, i64), StoreError> {
    Ok(sqlx::query_as(
        "SELECT count(*), COALESCE(sum(entries), 0)::int8, COALESCE(sum(bytes), 0)::int8 FROM (
             SELECT t.entries, t.bytes FROM transcripts t JOIN sandboxes s ON s.id = t.sandbox_id
              WHERE t.tenant_id = $1 AND t.conversation_id = $2
              ORDER BY s.leased_at DESC NULLS LAST, t.created_at DESC OFFSET $3) older",
    )
    .bind(tenant)
    .bind(conversation_id)
    .bind(skip)
    .fetch_one(conn)
    .await?)
}

/// Bytes of every transcript a tenant keeps (what its budget counts).
pub async fn tenant_bytes(conn: &mut PgConnection, tenant: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(sum(bytes), 0)::int8 FROM transcripts WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_one(conn)
    .await?)
}

/// A stored entry.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct EntryRow {
    /// Position, from 1.
    pub seq: i32,
    /// When it was recorded.
    pub at: DateTime<Utc>,
    /// The entry.
    pub body: JsonValue,
}

/// A sandbox's entries in order (the caller found the sandbox through its tenant first).
#[tracing::instrument(skip_all, fields(sandbox_id))]
pub async fn entries(
    conn: &mut PgConnection,
    sandbox_id: &str,
) -> Result<Vec<EntryRow>, StoreError> {
    Ok(sqlx::query_as::<_, EntryRow>(
        "SELECT seq, at, body FROM transcript_entries WHERE sandbox_id = $1 ORDER BY seq",
    )
    .bind(sandbox_id)
    .fetch_all(conn)
    .await?)
}

/// Deletes the transcripts of ended sandboxes whose retention is over: the tenant's own
/// retention when it has one, else `default_seconds`, counted from when the sandbox ended.
/// Returns how many it deleted.
#[tracing::instrument(skip_all)]
pub async fn purge_expired(
    conn: &mut PgConnection,
    default_seconds: i64,
) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "DELETE FROM transcripts t USING sandboxes s, tenants n
         WHERE s.id = t.sandbox_id AND n.id = t.tenant_id
           AND s.state IN ('closed', 'lost')
           AND COALESCE(s.closed_at, s.last_used_at, s.created_at)
               + make_interval(secs => COALESCE(n.transcript_retention_seconds, $1)::double precision)
               <= now()",
    )
    .bind(default_seconds)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Deletes every transcript of a tenant now. Returns how many it deleted.
#[tracing::instrument(skip_all, fields(%tenant))]
pub async fn purge_tenant(conn: &mut PgConnection, tenant: Uuid) -> Result<u64, StoreError> {
    let done = sqlx::query("DELETE FROM transcripts WHERE tenant_id = $1")
        .bind(tenant)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// A tenant's own transcript retention, seconds (`None`: the configured default).
pub async fn retention_of(
    conn: &mut PgConnection,
    tenant: Uuid,
) -> Result<Option<Option<i32>>, StoreError> {
    Ok(sqlx::query_scalar::<_, Option<i32>>(
        "SELECT transcript_retention_seconds FROM tenants WHERE id = $1",
    )
    .bind(tenant)
    .fetch_optional(conn)
    .await?)
}

/// Sets (or with `None` clears) a tenant's own transcript retention. False when there is no
/// such tenant.
pub async fn set_retention(
    conn: &mut PgConnection,
    tenant: Uuid,
    seconds: Option<i32>,
) -> Result<bool, StoreError> {
    let done = sqlx::query("UPDATE tenants SET transcript_retention_seconds = $2 WHERE id = $1")
        .bind(tenant)
        .bind(seconds)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}
