//! The egress component: decides, dials, budgets and audits the CONNECTs a sandbox's agent
//! relays over its channel (PROTOCOL.md, `egress_serve`).
//!
//! It runs where the calls run: in `sandgate serve`, in process, and in a gateway-only replica
//! (never on a node host: `sandgate node` builds none). A CONNECT reaches it only inside a call the
//! gateway opened for that sandbox ([`sandgate_sandbox::AgentChannel::with_egress`]), and only for
//! a sandbox on this process's own node: a node in another process relays no egress yet.
//!
//! Each CONNECT: the tenant's rules are read (a rule taken out applies to the next connection),
//! [`TargetCheck`] admits the name and port before anything is resolved and checks every
//! address, the rule's connections-per-minute budget is charged, the rule's bytes-per-day budget
//! left today bounds the connection, the checked address is dialed (no second lookup), and the
//! connection is audited when it ends (refusals at once): tenant, sandbox, target, outcome,
//! bytes each way.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{Datelike, Utc};
use futures::future::BoxFuture;
use sandgate_sandbox::{EgressHandler, EgressRefusal, EgressTally, EgressUpstream};
use sandgate_store::PgPool;
use sandgate_store::audit::{EgressConnection, Outcome};
use sandgate_store::egress::EgressRule;
use uuid::Uuid;

use super::target::{CheckedTarget, TargetCheck};

/// The egress component of one process. Cheap to clone.
#[derive(Clone)]
pub struct EgressService {
    inner: Arc<Inner>,
}

struct Inner {
    db: PgPool,
    check: TargetCheck,
    connect_timeout: Duration,
    budgets: Mutex<Budgets>,
    /// Sandboxes this process turned the proxy variables on in (`egress_env`).
    proxied: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for EgressService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressService")
            .field("check", &self.inner.check)
            .finish_non_exhaustive()
    }
}

/// A rule's budgets as counted in this process: keyed by tenant, rule host and port.
#[derive(Default)]
struct Budgets {
    /// Connections opened in the current minute: (minute number, count).
    minute: HashMap<(Uuid, String, i32), (i64, i32)>,
    /// Bytes carried today (UTC): (day number, bytes).
    day: HashMap<(Uuid, String, i32), (i32, i64)>,
}

impl EgressService {
    /// The component over `db` (the tenants' rules, the audit trail), checking targets with
    /// `check` and giving servers `connect_timeout` to accept.
    pub fn new(db: PgPool, check: TargetCheck, connect_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                check,
                connect_timeout,
                budgets: Mutex::default(),
                proxied: Mutex::default(),
            }),
        }
    }

    /// The handler of one call's CONNECTs in `sandbox_id` of `tenant`.
    pub fn for_call(&self, tenant: Uuid, sandbox_id: &str) -> Arc<dyn EgressHandler> {
        Arc::new(CallEgress {
            service: self.clone(),
            tenant,
            sandbox_id: sandbox_id.to_owned(),
        })
    }

    /// A tenant's egress rules (empty: no route out).
    pub async fn rules(&self, tenant: Uuid) -> Result<Vec<EgressRule>, sandgate_store::StoreError> {
        let mut conn = self.inner.db.acquire().await?;
        sandgate_store::egress::rules(&mut conn, tenant).await
    }

    /// Whether this process turned the proxy variables on in `sandbox_id`.
    pub(crate) fn proxied(&self, sandbox_id: &str) -> bool {
        lock(&self.inner.proxied).contains(sandbox_id)
    }

    /// Records that the proxy variables are now on (or off) in `sandbox_id`.
    pub(crate) fn set_proxied(&self, sandbox_id: &str, on: bool) {
        let mut proxied = lock(&self.inner.proxied);
        if on {
            proxied.insert(sandbox_id.to_owned());
        } else {
            proxied.remove(sandbox_id);
        }
    }

    /// Writes one connection to the audit trail (in the background: the connection does not
    /// wait; a failure is logged).
    fn audit(&self, connection: EgressConnection) {
        let db = self.inner.db.clone();
        tokio::spawn(async move {
            let written = match db.acquire().await {
                Ok(mut conn) => sandgate_store::audit::record_egress(&mut conn, &connection)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(err) = written {
                tracing::error!(%err, sandbox_id = %connection.sandbox_id, "egress connection not audited");
            }
        });
    }

    /// Charges one connection to `rule`'s per-minute budget; `Err` with the budget when over.
    fn charge_connection(&self, tenant: Uuid, rule: &EgressRule) -> Result<(), i32> {
        let Some(most) = rule.connections_per_minute else {
            return Ok(());
        };
        let minute = Utc::now().timestamp().div_euclid(60);
        let mut budgets = lock(&self.inner.budgets);
        let entry = budgets
            .minute
            .entry((tenant, rule.host.clone(), rule.port))
            .or_insert((minute, 0));
        if entry.0 != minute {
            *entry = (minute, 0);
        }
        if entry.1 >= most {
            return Err(most);
        }
        entry.1 += 1;
        Ok(())
    }

    /// The bytes `rule` may still carry today (`None`: no budget).
    fn bytes_left(&self, tenant: Uuid, rule: &EgressRule) -> Option<u64> {
        let most = rule.bytes_per_day?;
        let today = Utc::now().num_days_from_ce();
        let budgets = lock(&self.inner.budgets);
        let used = budgets
            .day
            .get(&(tenant, rule.host.clone(), rule.port))
            .filter(|(day, _)| *day == today)
            .map_or(0, |(_, used)| *used);
        Some(u64::try_from(most.saturating_sub(used)).unwrap_or(0))
    }

    /// Adds what a connection carried to `rule`'s bytes of today.
    fn spend_bytes(&self, tenant: Uuid, rule: &EgressRule, bytes: u64) {
        if rule.bytes_per_day.is_none() {
            return;
        }
        let today = Utc::now().num_days_from_ce();
        let mut budgets = lock(&self.inner.budgets);
        let entry = budgets
            .day
            .entry((tenant, rule.host.clone(), rule.port))
            .or_insert((today, 0));
        if entry.0 != today {
            *entry = (today, 0);
        }
        entry.1 = entry
            .1
            .saturating_add(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Dials the checked addresses in turn; the first that accepts.
    async fn dial(&self, target: &CheckedTarget) -> std::io::Result<tokio::net::TcpStream> {
        let mut last = None;
        for addr in &target.addrs {
            match tokio::time::timeout(
                self.inner.connect_timeout,
                tokio::net::TcpStream::connect(addr),
            )
            .await
            {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(err)) => last = Some(err),
                Err(_) => last = Some(std::io::ErrorKind::TimedOut.into()),
            }
        }
        Err(last.unwrap_or_else(|| std::io::ErrorKind::AddrNotAvailable.into()))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves counters that are still consistent.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CONNECTs of one call in one sandbox.
struct CallEgress {
    service: EgressService,
    tenant: Uuid,
    sandbox_id: String,
}

impl CallEgress {
    fn record(&self, outcome: Outcome, started: Instant, detail: String) {
        self.service.audit(EgressConnection {
            tenant_id: self.tenant,
            sandbox_id: self.sandbox_id.clone(),
            outcome,
            duration_ms: i32::try_from(started.elapsed().as_millis()).unwrap_or(i32::MAX),
            detail,
        });
    }

    /// Refuses `authority`, audited; what the client hears.
    fn refuse(
        &self,
        started: Instant,
        authority: &str,
        outcome: Outcome,
        status: u16,
        text: String,
    ) -> EgressRefusal {
        tracing::info!(sandbox_id = %self.sandbox_id, %authority, %text, "egress connection refused");
        self.record(outcome, started, format!("{authority} refused: {text}"));
        EgressRefusal { status, text }
    }

    async fn open_checked(&self, authority: &str) -> Result<EgressUpstream, EgressRefusal> {
        let started = Instant::now();
        // The authority is the sandbox's: keep it short and printable in the audit trail.
        let shown: String = authority
            .chars()
            .take(300)
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .collect();
        let rules = match self.service.rules(self.tenant).await {
            Ok(rules) => rules,
            Err(err) => {
                tracing::error!(%err, "egress rules unreadable");
                let text = "the egress component cannot read this tenant's policy now; try again";
                return Err(self.refuse(started, &shown, Outcome::Failed, 503, text.into()));
            }
        };
        let target = match self.service.inner.check.check(authority, &rules).await {
            Ok(target) => target,
            Err(err) => {
                return Err(self.refuse(started, &shown, Outcome::Refused, 403, err.to_string()));
            }
        };
        let rule_name = format!("{}:{}", target.rule.host, target.rule.port);
        if let Err(most) = self.service.charge_connection(self.tenant, &target.rule) {
            let text = format!(
                "{shown}: over this tenant's budget of {most} connections per minute for the \
                 egress rule {rule_name}; try again in a minute"
            );
            return Err(self.refuse(started, &shown, Outcome::Refused, 429, text));
        }
        let byte_limit = self.service.bytes_left(self.tenant, &target.rule);
        if byte_limit == Some(0) {
            let text = format!(
                "{shown}: this tenant's budget of {} bytes per day for the egress rule \
                 {rule_name} is spent",
                target.rule.bytes_per_day.unwrap_or_default()
            );
            return Err(self.refuse(started, &shown, Outcome::Refused, 429, text));
        }
        let stream = match self.service.dial(&target).await {
            Ok(stream) => stream,
            Err(err) => {
                let text = format!("{shown}: the server did not accept a connection ({err})");
                return Err(self.refuse(started, &shown, Outcome::Failed, 502, text));
            }
        };
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string());
        tracing::info!(sandbox_id = %self.sandbox_id, authority = %shown, %peer, "egress connection open");
        let done = CallEgress {
            service: self.service.clone(),
            tenant: self.tenant,
            sandbox_id: self.sandbox_id.clone(),
        };
        let rule = target.rule.clone();
        let on_close = move |tally: EgressTally| {
            done.service
                .spend_bytes(done.tenant, &rule, tally.sent + tally.received);
            done.record(
                Outcome::Ok,
                started,
                format!(
                    "{shown} via {peer} {}: {} bytes sent, {} received",
                    tally.end.as_str(),
                    tally.sent,
                    tally.received
                ),
            );
        };
        Ok(EgressUpstream {
            io: Box::new(stream),
            byte_limit,
            on_close: Box::new(on_close),
        })
    }
}

impl EgressHandler for CallEgress {
    fn open<'a>(
        &'a self,
        authority: &'a str,
    ) -> BoxFuture<'a, Result<EgressUpstream, EgressRefusal>> {
        Box::pin(self.open_checked(authority))
    }
}

impl crate::SandboxService {
    /// This service with egress decided by `egress`.
    #[must_use]
    pub fn with_egress(mut self, egress: EgressService) -> Self {
        self.egress = Some(egress);
        self
    }

    /// Runs `call` (a cell or a command in `resolved`) with the sandbox's package index and, for
    /// a tenant with an egress policy, its egress relay beside it. Before the call, the proxy
    /// variables are turned on in a sandbox of a tenant with a policy (once per sandbox and
    /// process), and off again should the policy be gone.
    pub async fn with_relays<T>(
        &self,
        resolved: &crate::Resolved,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        let call = self.with_package_index(resolved, call);
        let (Some(egress), Some(tenant)) = (&self.egress, resolved.row.tenant_id) else {
            return call.await;
        };
        let sandbox_id = &resolved.row.id;
        let wanted = match egress.rules(tenant).await {
            Ok(rules) => !rules.is_empty(),
            Err(err) => {
                tracing::warn!(%err, "egress rules unreadable; the call runs without egress");
                return call.await;
            }
        };
        if wanted != egress.proxied(sandbox_id) {
            match resolved.sandbox.set_egress_env(wanted).await {
                Some(Ok(info)) => {
                    tracing::debug!(
                        proxy = info.proxy,
                        kernel = info.kernel_applied,
                        "egress env"
                    );
                    egress.set_proxied(sandbox_id, wanted);
                }
                Some(Err(err)) => tracing::warn!(%err, "egress proxy variables not delivered"),
                None => {} // another node's sandbox: no egress there yet
            }
        }
        if !wanted {
            return call.await;
        }
        let handler = egress.for_call(tenant, sandbox_id);
        resolved.sandbox.with_egress(handler, call).await
    }
}
