//! The egress component: decides, dials, budgets and audits the CONNECTs a sandbox's agent
//! relays over its channel (PROTOCOL.md, `egress_serve`).
//!
//! It runs where the calls run: in `sandgate serve`, in process, and in a gateway-only replica
//! (never on a node host: `sandgate node` builds none). A CONNECT reaches it only inside a call the
//! gateway opened for that sandbox ([`sandgate_sandbox::AgentChannel::with_egress`]); for a
//! sandbox on a node in another process, that node relays the call's CONNECTs back here on the
//! call's own stream (`sandgate_node`'s egress relay), and they are decided here all the same.
//!
//! Each CONNECT: the tenant's rules are read (a rule taken out applies to the next connection),
//! [`TargetCheck`] admits the name and port before anything is resolved and checks every
//! address, the rule's connections-per-minute budget is charged, the rule's bytes-per-day budget
//! is charged as the connection's bytes flow (a connection that reaches it is ended, so
//! connections open at once cannot together pass it), the checked address is dialed (no second
//! lookup), and the connection is audited when it ends (refusals at once): tenant, sandbox,
//! target, outcome, bytes each way.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{Datelike, Utc};
use futures::future::BoxFuture;
use sandgate_sandbox::{
    EgressBudget, EgressEnv, EgressHandler, EgressRefusal, EgressTally, EgressUpstream,
};
use sandgate_store::PgPool;
use sandgate_store::audit::{EgressConnection, Outcome};
use sandgate_store::egress::EgressRule;
use uuid::Uuid;

use super::intercept::{Interception, OpenSecret, SandboxCa};
use super::rules::HostPattern;
use super::secrets::SecretSealer;
use super::target::{CheckedTarget, TargetCheck, TargetError};
use sandgate_store::egress_approvals as approvals;

/// The most CONNECTs one sandbox may make per minute (made or refused), and at once in a burst:
/// past them a CONNECT is answered 429 without reading the policy, and only the first such
/// refusal of a minute is audited, so a flood of refused names costs the database one row a
/// minute.
const CONNECTS_PER_MINUTE: u32 = 120;
const CONNECTS_BURST: u32 = 60;

/// How many sandboxes' egress state (CA, what was delivered) a process keeps; the least recently
/// used beyond it are forgotten (a forgotten sandbox gets a new CA and its variables again).
const SANDBOXES_KEPT: usize = 65_536;

/// How long a request for a person's approval of a host stays open.
const APPROVAL_PENDING_FOR: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// The port a person may always approve (HTTPS); others only where a rule of the tenant
/// names them.
const APPROVABLE_PORT: u16 = 443;

/// How long a person's approval (or denial) of a host for a sandbox holds.
pub const APPROVAL_HOLDS_FOR: chrono::TimeDelta = chrono::TimeDelta::hours(24);

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
    /// Opens the tenants' secrets and makes their placeholders; `None`: no secrets key.
    sealer: Option<SecretSealer>,
    /// TLS to the servers of intercepted connections.
    upstream_tls: Arc<rustls::ClientConfig>,
    /// Per sandbox: its CA in this process and what this process delivered to it.
    sandboxes: Mutex<lru::LruCache<String, SandboxEgress>>,
    /// Per sandbox: its CONNECTs' rate.
    connects: governor::DefaultKeyedRateLimiter<String>,
    /// Per sandbox: the minute whose refusals over the rate were last audited (one row a
    /// minute says they happened; the rest are counted in the metrics only).
    rate_audited: Mutex<lru::LruCache<String, i64>>,
    /// The console's page of approvals (`<public_url>/console/egress`), named in the refusals
    /// of tenants with approvals on; `None`: no console here, no requests are made.
    approvals_page: Option<String>,
}

/// One sandbox's egress state in this process.
struct SandboxEgress {
    ca: Arc<SandboxCa>,
    /// The container and the `egress_env` (a digest of it) last delivered there.
    delivered: Option<(String, u64)>,
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
    /// The component over `db` (the tenants' rules and secrets, the audit trail), checking
    /// targets with `check`, giving servers `connect_timeout` to accept, opening secrets with
    /// `sealer` and verifying the servers of intercepted connections with `upstream_tls`.
    pub fn new(
        db: PgPool,
        check: TargetCheck,
        connect_timeout: Duration,
        sealer: Option<SecretSealer>,
        upstream_tls: Arc<rustls::ClientConfig>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                check,
                connect_timeout,
                budgets: Mutex::default(),
                sealer,
                upstream_tls,
                sandboxes: Mutex::new(lru::LruCache::new(
                    NonZeroUsize::new(SANDBOXES_KEPT).expect("not zero"),
                )),
                rate_audited: Mutex::new(lru::LruCache::new(
                    NonZeroUsize::new(SANDBOXES_KEPT).expect("not zero"),
                )),
                connects: governor::RateLimiter::keyed(
                    governor::Quota::per_minute(
                        std::num::NonZeroU32::new(CONNECTS_PER_MINUTE).expect("not zero"),
                    )
                    .allow_burst(std::num::NonZeroU32::new(CONNECTS_BURST).expect("not zero")),
                ),
                approvals_page: None,
            }),
        }
    }

    /// This component, naming `page` (the console's approvals page, an absolute URL) in the
    /// refusals of hosts a person of the tenant may approve.
    #[must_use]
    pub fn with_approvals_page(self, page: String) -> Self {
        let inner = Arc::try_unwrap(self.inner).unwrap_or_else(|_| {
            unreachable!("with_approvals_page is called before the component is shared")
        });
        Self {
            inner: Arc::new(Inner {
                approvals_page: Some(page),
                ..inner
            }),
        }
    }

    /// The tenant's rules, then the hosts approved for `sandbox_id` that no rule admits, as
    /// rules without budgets, each with who approved it. A tenant without a rule has no route
    /// out, whatever was approved.
    async fn rules_for(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
    ) -> Result<(Vec<EgressRule>, Vec<(EgressRule, String)>), sandgate_store::StoreError> {
        let mut conn = self.inner.db.acquire().await?;
        let rules = sandgate_store::egress::rules(&mut conn, tenant).await?;
        let mut approved = Vec::new();
        if self.inner.approvals_page.is_some() && !rules.is_empty() {
            for (host, port, by) in approvals::approved(&mut conn, tenant, sandbox_id).await? {
                // A rule of the policy that admits the name (added since) keeps it, with its
                // budgets: an approval only adds what no rule admits.
                let admitted = rules.iter().any(|r| {
                    r.port == port && HostPattern::parse(&r.host).is_ok_and(|p| p.matches(&host))
                });
                if !admitted {
                    let rule = EgressRule {
                        host,
                        port,
                        connections_per_minute: None,
                        bytes_per_day: None,
                    };
                    approved.push((rule, by));
                }
            }
        }
        Ok((rules, approved))
    }

    /// The refusal of `host:port` (not in the policy, `refused` says so) when the tenant has
    /// approvals on: the request's link first (a client may show only the first 200
    /// characters), or why there is none. `None` when approvals are off, and for a name no
    /// rule could ever hold (a single label such as `localhost`): never a request.
    async fn approval_text(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        host: &str,
        port: u16,
        refused: &str,
        rules: &[EgressRule],
    ) -> Option<String> {
        let page = self.inner.approvals_page.as_ref()?;
        if HostPattern::parse(host).is_err() {
            return None;
        }
        // A person approves 443 and the ports the operator's rules name: a tunnel to another
        // port (mail, SSH, a database) is the operator's to allow, as a rule.
        if port != APPROVABLE_PORT && !rules.iter().any(|r| r.port == i32::from(port)) {
            return Some(format!(
                "{host}:{port}: a person can approve port {APPROVABLE_PORT} and the ports of \
                 this tenant's rules only, other ports are the operator's to allow; {refused}"
            ));
        }
        let asked = async {
            let mut conn = self.inner.db.acquire().await?;
            approvals::request(
                &mut conn,
                tenant,
                sandbox_id,
                host,
                i32::from(port),
                APPROVAL_PENDING_FOR,
            )
            .await
        };
        let until = |t: chrono::DateTime<Utc>| t.format("%Y-%m-%d %H:%M UTC").to_string();
        let text = match asked.await {
            Ok(approvals::Asked::Off) => return None,
            Ok(approvals::Asked::Request(request)) => match request.state {
                approvals::ApprovalState::Pending => format!(
                    "awaiting approval at {page}?id={}: {host}:{port} is not in this tenant's \
                     egress policy; a person of the tenant with the approver role can approve it \
                     for this sandbox until {} (nothing was resolved)",
                    request.id,
                    until(request.expires_at)
                ),
                approvals::ApprovalState::Denied => format!(
                    "{host}:{port} was denied for this sandbox by a person of this tenant (until \
                     {}); {refused}",
                    until(request.expires_at)
                ),
                // Approved since this connection's rules were read: the next one goes through.
                approvals::ApprovalState::Approved => {
                    format!("{host}:{port} was approved for this sandbox just now: try again")
                }
            },
            Ok(approvals::Asked::Full) => format!(
                "{host}:{port}: too many requests wait for a person's approval already (at most \
                 {} per sandbox, {} per tenant), no new one was made; {refused}",
                approvals::MAX_PENDING_PER_SANDBOX,
                approvals::MAX_PENDING_PER_TENANT
            ),
            Err(err) => {
                tracing::error!(%err, "egress: the approval request could not be recorded");
                format!(
                    "{host}:{port}: the request for a person's approval could not be recorded \
                     now; {refused}"
                )
            }
        };
        Some(text)
    }

    /// The handler of one call's CONNECTs in `sandbox_id` of `tenant`.
    fn for_call(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        ca: Arc<SandboxCa>,
        notes: CallNotes,
    ) -> Arc<dyn EgressHandler> {
        Arc::new(CallEgress {
            service: self.clone(),
            tenant,
            sandbox_id: sandbox_id.to_owned(),
            ca,
            notes,
        })
    }

    /// `sandbox_id`'s CA in this process (made on first use).
    fn ca(&self, sandbox_id: &str) -> Result<Arc<SandboxCa>, String> {
        let mut sandboxes = lock(&self.inner.sandboxes);
        if let Some(state) = sandboxes.get(sandbox_id) {
            return Ok(state.ca.clone());
        }
        let ca = Arc::new(SandboxCa::new(sandbox_id).map_err(|e| e.to_string())?);
        sandboxes.put(
            sandbox_id.to_owned(),
            SandboxEgress {
                ca: ca.clone(),
                delivered: None,
            },
        );
        Ok(ca)
    }

    /// Whether `env` (its digest) is what this process last delivered to `sandbox_id` in
    /// `container`.
    fn delivered(&self, sandbox_id: &str, container: &str, digest: u64) -> bool {
        lock(&self.inner.sandboxes)
            .get(sandbox_id)
            .and_then(|s| s.delivered.as_ref())
            .is_some_and(|(c, d)| c == container && *d == digest)
    }

    /// Records what was delivered to `sandbox_id` in `container`.
    fn set_delivered(&self, sandbox_id: &str, container: &str, digest: u64) {
        if let Some(state) = lock(&self.inner.sandboxes).get_mut(sandbox_id) {
            state.delivered = Some((container.to_owned(), digest));
        }
    }

    /// What `egress_env` gives `sandbox_id` of `tenant` now: the proxy, its CA and the
    /// placeholders of the tenant's secrets, or (`proxy` false) nothing.
    async fn env_for(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        proxy: bool,
    ) -> Result<(EgressEnv, Option<Arc<SandboxCa>>), String> {
        if !proxy {
            return Ok((EgressEnv::default(), None));
        }
        let ca = self.ca(sandbox_id)?;
        let mut placeholders = BTreeMap::new();
        if let Some(sealer) = &self.inner.sealer {
            let mut conn = self.inner.db.acquire().await.map_err(|e| e.to_string())?;
            for secret in sandgate_store::egress::list_secrets(&mut conn, tenant)
                .await
                .map_err(|e| e.to_string())?
            {
                let token = sealer.placeholder(tenant, sandbox_id, &secret.name);
                placeholders.insert(secret.name, token);
            }
        }
        let env = EgressEnv {
            proxy: true,
            ca_pem: Some(ca.pem().to_owned()),
            placeholders,
        };
        Ok((env, Some(ca)))
    }

    /// The tenant's secrets bound to `host`, opened, with `sandbox_id`'s placeholders.
    async fn secrets_for(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        host: &str,
    ) -> Result<Vec<OpenSecret>, String> {
        let Some(sealer) = &self.inner.sealer else {
            return Ok(Vec::new());
        };
        let mut conn = self.inner.db.acquire().await.map_err(|e| e.to_string())?;
        let bound = sandgate_store::egress::bound_secrets(&mut conn, tenant)
            .await
            .map_err(|e| e.to_string())?;
        let mut open = Vec::new();
        for secret in bound {
            let applies = secret
                .hosts
                .iter()
                .any(|h| HostPattern::parse(h).is_ok_and(|p| p.matches(host)));
            if !applies {
                continue;
            }
            let value = sealer
                .open(tenant, &secret.name, secret.version, &secret.sealed)
                .map_err(|e| e.to_string())?;
            open.push(OpenSecret {
                placeholder: sealer.placeholder(tenant, sandbox_id, &secret.name),
                name: secret.name,
                value,
                headers: secret.headers,
            });
        }
        Ok(open)
    }

    /// A tenant's egress rules (empty: no route out).
    pub async fn rules(&self, tenant: Uuid) -> Result<Vec<EgressRule>, sandgate_store::StoreError> {
        let mut conn = self.inner.db.acquire().await?;
        sandgate_store::egress::rules(&mut conn, tenant).await
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

    /// Charges `bytes` a connection carried to `rule`'s bytes of today, as they flow; false when
    /// they do not fit (the day's budget is then spent: the connection is ended, and the rule
    /// refuses new ones until tomorrow).
    fn spend_bytes(&self, tenant: Uuid, rule: &EgressRule, bytes: u64) -> bool {
        let Some(most) = rule.bytes_per_day else {
            return true;
        };
        let today = Utc::now().num_days_from_ce();
        let mut budgets = lock(&self.inner.budgets);
        let entry = budgets
            .day
            .entry((tenant, rule.host.clone(), rule.port))
            .or_insert((today, 0));
        if entry.0 != today {
            *entry = (today, 0);
        }
        let after = entry
            .1
            .saturating_add(i64::try_from(bytes).unwrap_or(i64::MAX));
        if after > most {
            entry.1 = most;
            return false;
        }
        entry.1 = after;
        true
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

/// The most connections one call's transcript note lists (the rest are counted).
const NOTE_LINES: usize = 50;

/// The egress connections of one call, for the transcript note after its entry. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct CallNotes(Arc<Mutex<(Vec<String>, u64)>>);

impl CallNotes {
    fn push(&self, line: String) {
        let mut notes = lock(&self.0);
        if notes.0.len() < NOTE_LINES {
            notes.0.push(line);
        } else {
            notes.1 += 1;
        }
    }

    /// The transcript note of what was pushed so far (`None`: no connection).
    pub fn entry(&self) -> Option<sandgate_transcript::Entry> {
        let notes = lock(&self.0);
        (!notes.0.is_empty()).then(|| {
            sandgate_transcript::Entry::Egress(sandgate_transcript::EgressNote {
                connections: notes.0.clone(),
                more: notes.1,
                by: None,
            })
        })
    }
}

/// The CONNECTs of one call in one sandbox.
struct CallEgress {
    service: EgressService,
    tenant: Uuid,
    sandbox_id: String,
    ca: Arc<SandboxCa>,
    notes: CallNotes,
}

impl CallEgress {
    fn record(&self, outcome: Outcome, started: Instant, detail: String) {
        self.notes.push(detail.clone());
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
        let counted = match outcome {
            Outcome::Refused => super::metrics::ConnectionOutcome::refused,
            _ => super::metrics::ConnectionOutcome::failed,
        };
        super::metrics::connection(counted, super::metrics::ConnectionKind::tunnel);
        self.record(outcome, started, format!("{authority} refused: {text}"));
        EgressRefusal { status, text }
    }

    async fn open_checked(&self, authority: &str) -> Result<EgressUpstream, EgressRefusal> {
        let started = Instant::now();
        let connects = &self.service.inner.connects;
        if connects.len() > SANDBOXES_KEPT {
            connects.retain_recent();
        }
        if connects.check_key(&self.sandbox_id).is_err() {
            tracing::warn!(sandbox_id = %self.sandbox_id, "egress: over the sandbox's CONNECT rate; refused");
            super::metrics::connection(
                super::metrics::ConnectionOutcome::refused,
                super::metrics::ConnectionKind::tunnel,
            );
            let text = format!(
                "this sandbox asked for more than {CONNECTS_PER_MINUTE} egress connections in a \
                 minute; wait and try again"
            );
            // The first such refusal of a minute is audited (and noted in the transcript),
            // saying that more may follow unlisted: a flood costs one row a minute.
            let minute = Utc::now().timestamp().div_euclid(60);
            let first = lock(&self.service.inner.rate_audited).put(self.sandbox_id.clone(), minute)
                != Some(minute);
            if first {
                self.record(
                    Outcome::Refused,
                    started,
                    format!(
                        "{} refused: {text} (further refusals over the rate this minute are \
                         counted in /metrics, not listed)",
                        authority
                            .chars()
                            .take(300)
                            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
                            .collect::<String>()
                    ),
                );
            }
            return Err(EgressRefusal { status: 429, text });
        }
        // The authority is the sandbox's: keep it short and printable in the audit trail.
        let shown: String = authority
            .chars()
            .take(300)
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .collect();
        let (mut rules, approved) =
            match self.service.rules_for(self.tenant, &self.sandbox_id).await {
                Ok(rules) => rules,
                Err(err) => {
                    tracing::error!(%err, "egress rules unreadable");
                    let text =
                        "the egress component cannot read this tenant's policy now; try again";
                    return Err(self.refuse(started, &shown, Outcome::Failed, 503, text.into()));
                }
            };
        rules.extend(approved.iter().map(|(rule, _)| rule.clone()));
        let target = match self.service.inner.check.check(authority, &rules).await {
            Ok(target) => target,
            Err(err) => {
                let mut text = err.to_string();
                if let TargetError::NotAllowed { host, port } = &err
                    && let Some(asked) = self
                        .service
                        .approval_text(self.tenant, &self.sandbox_id, host, *port, &text, &rules)
                        .await
                {
                    text = asked;
                }
                return Err(self.refuse(started, &shown, Outcome::Refused, 403, text));
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
        if self.service.bytes_left(self.tenant, &target.rule) == Some(0) {
            let text = format!(
                "{shown}: this tenant's budget of {} bytes per day for the egress rule \
                 {rule_name} is spent",
                target.rule.bytes_per_day.unwrap_or_default()
            );
            return Err(self.refuse(started, &shown, Outcome::Refused, 429, text));
        }
        // Admitted by a person's approval rather than a rule: no secret goes there (the
        // operator bound secrets for the hosts of the policy; an approver did not see them),
        // and the audit names who approved it.
        let approved_by = approved
            .iter()
            .find(|(rule, _)| *rule == target.rule)
            .map(|(_, by)| by.clone());
        // The secrets bound to this host (their values opened now: a value that does not open
        // refuses the connection rather than sending a request without it).
        let secrets = match approved_by {
            Some(_) => Ok(Vec::new()),
            None => {
                self.service
                    .secrets_for(self.tenant, &self.sandbox_id, &target.host)
                    .await
            }
        };
        let secrets = match secrets {
            Ok(secrets) => secrets,
            Err(err) => {
                tracing::error!(%err, authority = %shown, "egress: a secret bound to the target does not open");
                let text = format!(
                    "{shown}: a secret bound to this host cannot be opened now; the operator's \
                     log says why"
                );
                return Err(self.refuse(started, &shown, Outcome::Failed, 503, text));
            }
        };
        let interception = if secrets.is_empty() {
            None
        } else {
            match Interception::new(
                &self.ca,
                &target.host,
                target.port,
                self.service.inner.upstream_tls.clone(),
                secrets,
            ) {
                Ok(interception) => Some(interception),
                Err(err) => {
                    tracing::error!(%err, "egress: no certificate for an intercepted connection");
                    let text =
                        format!("{shown}: the egress component cannot intercept it now ({err})");
                    return Err(self.refuse(started, &shown, Outcome::Failed, 503, text));
                }
            }
        };
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
        tracing::info!(
            sandbox_id = %self.sandbox_id,
            authority = %shown,
            %peer,
            intercepted = interception.is_some(),
            "egress connection open"
        );
        super::metrics::connection(
            super::metrics::ConnectionOutcome::ok,
            if interception.is_some() {
                super::metrics::ConnectionKind::intercepted
            } else {
                super::metrics::ConnectionKind::tunnel
            },
        );
        let (io, injected): (Box<dyn sandgate_sandbox::EgressIo>, _) = match interception {
            None => (Box::new(stream), None),
            Some(interception) => {
                let injected = interception.injected.clone();
                let (ours, theirs) = tokio::io::duplex(64 * 1024);
                tokio::spawn(interception.run(theirs, stream));
                (Box::new(ours), Some(injected))
            }
        };
        let done = CallEgress {
            service: self.service.clone(),
            tenant: self.tenant,
            sandbox_id: self.sandbox_id.clone(),
            ca: self.ca.clone(),
            notes: self.notes.clone(),
        };
        let budget = target.rule.bytes_per_day.map(|_| {
            Arc::new(DayBudget {
                service: self.service.clone(),
                tenant: self.tenant,
                rule: target.rule.clone(),
            }) as Arc<dyn EgressBudget>
        });
        let on_close = move |tally: EgressTally| {
            super::metrics::carried(tally.sent, tally.received);
            let secrets = injected.map_or_else(String::new, |names| {
                let names = lock(&names);
                if names.is_empty() {
                    "; intercepted, no secret injected".to_owned()
                } else {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    format!("; intercepted, secrets injected: {}", names.join(", "))
                }
            });
            let secrets = match &approved_by {
                Some(by) => format!("{secrets}; approved for this sandbox by {by}"),
                None => secrets,
            };
            done.record(
                Outcome::Ok,
                started,
                format!(
                    "{shown} via {peer} {}: {} bytes sent, {} received{secrets}",
                    tally.end.as_str(),
                    tally.sent,
                    tally.received
                ),
            );
        };
        Ok(EgressUpstream {
            io,
            byte_limit: None,
            budget,
            on_close: Box::new(on_close),
        })
    }
}

/// A rule's bytes-per-day budget, charged as a connection's bytes flow (in this process).
struct DayBudget {
    service: EgressService,
    tenant: Uuid,
    rule: EgressRule,
}

impl EgressBudget for DayBudget {
    fn spend(&self, bytes: u64) -> bool {
        self.service.spend_bytes(self.tenant, &self.rule, bytes)
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
    /// variables, the sandbox's CA and the secrets' placeholders are delivered to a sandbox of a
    /// tenant with a policy (again whenever they change or the sandbox is in a new container: a
    /// restore, a resume), and taken out again should the policy be gone. Each connection the
    /// call's sandbox opens or is refused goes into `notes` (the transcript's note after it).
    pub async fn with_relays<T>(
        &self,
        resolved: &crate::Resolved,
        notes: &CallNotes,
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
        let container = resolved.sandbox.container_id();
        let (env, ca) = match egress.env_for(tenant, sandbox_id, wanted).await {
            Ok(env) => env,
            Err(err) => {
                tracing::warn!(%err, "egress variables unknown; the call runs without egress");
                return call.await;
            }
        };
        let digest = {
            use std::hash::{Hash as _, Hasher as _};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            serde_json::to_string(&env)
                .unwrap_or_default()
                .hash(&mut hasher);
            hasher.finish()
        };
        // A sandbox this process never turned egress on in needs nothing to turn it off.
        let known = lock(&egress.inner.sandboxes).contains(sandbox_id);
        if (wanted || known) && !egress.delivered(sandbox_id, container, digest) {
            match resolved.sandbox.set_egress_env(&env).await {
                Ok(info) => {
                    tracing::debug!(
                        proxy = info.proxy,
                        kernel = info.kernel_applied,
                        placeholders = ?info.placeholders,
                        "egress env"
                    );
                    egress.set_delivered(sandbox_id, container, digest);
                }
                // A node older than egress over the RPC does not know the call: its sandbox
                // gets no variables (no route out) until it is in a new container, and this is
                // said once for it, not on every call.
                Err(err @ sandgate_sandbox::SandboxError::OlderNode { .. }) => {
                    tracing::warn!(%err, "egress proxy variables not delivered");
                    egress.set_delivered(sandbox_id, container, digest);
                }
                Err(err) => tracing::warn!(%err, "egress proxy variables not delivered"),
            }
        }
        let Some(ca) = ca else {
            return call.await;
        };
        let handler = egress.for_call(tenant, sandbox_id, ca, notes.clone());
        resolved.sandbox.with_egress(handler, call).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> EgressService {
        // Never connected: the budgets live in the process.
        let db = PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").expect("a lazy pool");
        let tls = crate::egress::upstream_config(None).expect("the system's roots");
        EgressService::new(db, TargetCheck::system(), Duration::from_secs(1), None, tls)
    }

    fn rule(bytes_per_day: Option<i64>) -> EgressRule {
        EgressRule {
            host: "shop.test".into(),
            port: 443,
            connections_per_minute: None,
            bytes_per_day,
        }
    }

    #[tokio::test]
    async fn a_days_byte_budget_holds_for_connections_open_at_once() {
        let service = service();
        let tenant = Uuid::new_v4();
        let rule = rule(Some(1000));
        let budget = |tenant| DayBudget {
            service: service.clone(),
            tenant,
            rule: rule.clone(),
        };
        // Two connections open at once, both admitted while the whole day's budget was left.
        let (a, b) = (budget(tenant), budget(tenant));
        assert!(a.spend(400) && b.spend(400), "800 of 1000 bytes fit");
        assert!(
            !a.spend(400),
            "a piece that would take the two past the day's budget does not fit"
        );
        assert_eq!(
            service.bytes_left(tenant, &rule),
            Some(0),
            "the budget is spent: new connections of the rule are refused today"
        );
        assert!(!b.spend(1), "and the other open connection is ended too");
        // Another tenant's budget for the same rule is its own.
        assert!(budget(Uuid::new_v4()).spend(1000));
        // A rule without a budget never ends a connection.
        let unbounded = DayBudget {
            service: service.clone(),
            tenant,
            rule: self::rule(None),
        };
        assert!(unbounded.spend(u64::MAX));
    }
}
