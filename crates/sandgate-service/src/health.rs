//! Readiness: whether this process can serve: Postgres answers, and with a node of its own
//! Docker and the sandbox image; without one (`serve --gateway-only`), at least one live node
//! is registered (a draining one too: the replica's pages and leased sandboxes still serve, and
//! `new_sandboxes` says that new ones wait). The gateway's `/readyz` serves it.

use std::collections::BTreeMap;
use std::time::Duration;

use sandgate_sandbox::{DockerBackend, SandboxManager, TemplateStatus};
use sandgate_store::PgPool;
use serde::Serialize;

/// How long one readiness check may take before it counts as failed.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The body of `/readyz`.
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// One entry per dependency.
    pub checks: Checks,
    /// Whether this process's node can snapshot sandboxes of each profile: `"available"`, or
    /// why not (`"unknown"` before the first check). Information, never a failure: ordinary
    /// starts work either way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<BTreeMap<String, String>>,
    /// Which engine serves each profile's sandboxes on this process's node, and why
    /// (`"lean (forked from a warmed zygote)"`, `"docker (runc)"`; information).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engines: Option<BTreeMap<String, String>>,
    /// Whether each profile's pool is filled from a template, and which (information too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub templates: Option<BTreeMap<String, TemplateReport>>,
}

/// A profile's template, as `/readyz` shows it.
#[derive(Debug, Serialize)]
pub struct TemplateReport {
    /// Whether pools fill from templates at all (`snapshots.templates`).
    pub enabled: bool,
    /// Whether a template is in use: the pool's starts restore it.
    pub in_use: bool,
    /// Its snapshot's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Its age, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<u64>,
    /// Its image's size, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Why the last build failed or the last template was refused, while none is in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl From<TemplateStatus> for TemplateReport {
    fn from(status: TemplateStatus) -> Self {
        let template = status.template.as_ref();
        Self {
            enabled: status.enabled,
            in_use: template.is_some(),
            snapshot_id: template.map(|t| t.snapshot_id.clone()),
            age_seconds: template.map(|t| t.age.as_secs()),
            bytes: template.map(|t| t.size_bytes),
            error: status.last_error,
        }
    }
}

/// The snapshot capability and template of each of `profiles` on `manager`.
fn snapshot_reports(
    manager: &SandboxManager,
    profiles: &[String],
) -> (BTreeMap<String, String>, BTreeMap<String, TemplateReport>) {
    let mut snapshots = BTreeMap::new();
    let mut templates = BTreeMap::new();
    for profile in profiles {
        let Some(status) = manager.template_status(profile) else {
            continue;
        };
        let capability = match &status.snapshots {
            Some(Ok(())) => "available".to_owned(),
            Some(Err(reason)) => reason.clone(),
            None => "unknown".to_owned(),
        };
        snapshots.insert(profile.clone(), capability);
        templates.insert(profile.clone(), status.into());
    }
    (snapshots, templates)
}

/// Each dependency's check.
#[derive(Debug, Serialize)]
pub struct Checks {
    /// Postgres answers a query.
    pub postgres: Check,
    /// The Docker engine answers a ping (a process with a node of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docker: Option<Check>,
    /// The sandbox image exists on the engine (a process with a node of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_image: Option<Check>,
    /// At least one live node is registered (a gateway-only process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Check>,
    /// One of the live nodes takes new leases (a gateway-only process). Information, never a
    /// failure: while every node drains (a roll), the replica still serves its pages and the
    /// sandboxes already leased, so it stays ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_sandboxes: Option<Check>,
}

/// The outcome of one check.
#[derive(Debug, Serialize)]
pub struct Check {
    /// Whether it passed.
    pub ok: bool,
    /// What failed and what to do, when it did not pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Check {
    fn from_result<E: std::fmt::Display>(
        result: Result<Result<(), E>, tokio::time::error::Elapsed>,
    ) -> Self {
        match result {
            Ok(Ok(())) => Check {
                ok: true,
                error: None,
            },
            Ok(Err(e)) => Check {
                ok: false,
                error: Some(e.to_string()),
            },
            Err(_) => Check {
                ok: false,
                error: Some(format!("no answer within {} s", CHECK_TIMEOUT.as_secs())),
            },
        }
    }
}

/// Why a gateway-only process has no node to use.
#[derive(Debug, thiserror::Error)]
enum NoNode {
    #[error(transparent)]
    Store(#[from] sandgate_store::StoreError),
    #[error(
        "no live sandbox node is registered: start `sandgate node` (a node is live while its \
         heartbeat is younger than node.away_after_seconds)"
    )]
    None,
}

/// Why a gateway-only process cannot start new sandboxes, while it serves everything else.
#[derive(Debug, thiserror::Error)]
#[error(
    "every live sandbox node ({live}) is draining: sandboxes already leased keep working and \
     the sign-in, consent, console and transcript pages serve, but a new sandbox waits for a \
     node (start one, or undrain one with `sandgate admin nodes undrain <id>`)"
)]
struct AllDraining {
    live: i64,
}

/// Whether a live node is registered (heartbeat within `node.away_after_seconds`, passed in as
/// `lost_after_seconds`), and whether one of them takes new leases.
async fn a_node(db: &PgPool, lost_after_seconds: i64) -> Result<Result<(), AllDraining>, NoNode> {
    let mut conn = db
        .acquire()
        .await
        .map_err(sandgate_store::StoreError::from)?;
    let counts = sandgate_store::nodes::live_counts(&mut conn, lost_after_seconds).await?;
    if counts.live == 0 {
        return Err(NoNode::None);
    }
    if counts.placeable == 0 {
        return Ok(Err(AllDraining { live: counts.live }));
    }
    Ok(Ok(()))
}

/// What readiness checks besides Postgres.
#[derive(Debug, Clone, Copy)]
pub enum Needs<'a> {
    /// This process's own node: its Docker engine answers and has the sandbox `image`.
    Engine {
        /// The engine.
        docker: &'a DockerBackend,
        /// The sandbox image.
        image: &'a str,
    },
    /// A gateway-only process: a live node is registered (and whether one takes new leases).
    Nodes {
        /// `node.lost_after_seconds`.
        lost_after_seconds: i64,
    },
}

/// Checks Postgres and what `needs` names at once, each bounded in time.
pub async fn readiness(db: &PgPool, needs: Needs<'_>) -> Readiness {
    let postgres = tokio::time::timeout(CHECK_TIMEOUT, sandgate_store::ping(db));
    let checks = match needs {
        Needs::Engine { docker, image } => {
            let (postgres, docker_ping, sandbox_image) = tokio::join!(
                postgres,
                tokio::time::timeout(CHECK_TIMEOUT, docker.ping()),
                tokio::time::timeout(CHECK_TIMEOUT, docker.ensure_image(image)),
            );
            Checks {
                postgres: Check::from_result(postgres),
                docker: Some(Check::from_result(docker_ping)),
                sandbox_image: Some(Check::from_result(sandbox_image)),
                nodes: None,
                new_sandboxes: None,
            }
        }
        Needs::Nodes { lost_after_seconds } => {
            let (postgres, nodes) = tokio::join!(
                postgres,
                tokio::time::timeout(CHECK_TIMEOUT, a_node(db, lost_after_seconds)),
            );
            let new_sandboxes = match &nodes {
                Ok(Ok(Err(all_draining))) => Check {
                    ok: false,
                    error: Some(all_draining.to_string()),
                },
                Ok(Ok(Ok(()))) => Check {
                    ok: true,
                    error: None,
                },
                // No live node, or the check failed: `nodes` says so.
                _ => Check {
                    ok: false,
                    error: None,
                },
            };
            Checks {
                postgres: Check::from_result(postgres),
                docker: None,
                sandbox_image: None,
                nodes: Some(Check::from_result(nodes.map(|n| n.map(|_| ())))),
                new_sandboxes: Some(new_sandboxes),
            }
        }
    };
    let ready = checks.postgres.ok
        && [&checks.docker, &checks.sandbox_image, &checks.nodes]
            .into_iter()
            .flatten()
            .all(|c| c.ok);
    Readiness {
        status: if ready { "ready" } else { "not_ready" },
        checks,
        snapshots: None,
        engines: None,
        templates: None,
    }
}

impl Readiness {
    /// Whether every check passed.
    pub fn is_ready(&self) -> bool {
        self.status == "ready"
    }
}

/// What `/readyz` checks for this process, ready to run: Postgres, and Docker and the sandbox
/// image with a node of its own, a live registered node without. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ReadinessProbe {
    db: PgPool,
    docker: Option<DockerBackend>,
    image: String,
    lost_after_seconds: i64,
    /// This process's node's manager and its profiles (for the snapshot report).
    manager: Option<SandboxManager>,
    profiles: Vec<String>,
}

impl ReadinessProbe {
    /// The probe of the running `services` under `config`.
    pub fn of(services: &crate::Services, config: &crate::Config) -> Self {
        Self::new(
            &services.db,
            services.docker.clone(),
            &services.sandboxes,
            config,
        )
    }

    /// The probe of a running node (`sandgate node`).
    pub fn of_node(services: &crate::NodeServices, config: &crate::Config) -> Self {
        Self::new(
            &services.db,
            Some(services.docker.clone()),
            &services.sandboxes,
            config,
        )
    }

    fn new(
        db: &PgPool,
        docker: Option<DockerBackend>,
        sandboxes: &crate::SandboxService,
        config: &crate::Config,
    ) -> Self {
        Self {
            db: db.clone(),
            docker,
            image: config.sandbox.image.clone(),
            lost_after_seconds: i64::try_from(config.node.away_after_seconds).unwrap_or(i64::MAX),
            manager: sandboxes.nodes().local().cloned(),
            profiles: vec![config.sandbox.name.clone()],
        }
    }

    /// Runs the checks, each bounded in time.
    pub async fn check(&self) -> Readiness {
        let needs = match &self.docker {
            Some(docker) => Needs::Engine {
                docker,
                image: &self.image,
            },
            None => Needs::Nodes {
                lost_after_seconds: self.lost_after_seconds,
            },
        };
        let mut readiness = readiness(&self.db, needs).await;
        if let Some(manager) = &self.manager {
            let (snapshots, templates) = snapshot_reports(manager, &self.profiles);
            readiness.snapshots = Some(snapshots);
            readiness.engines = Some(
                self.profiles
                    .iter()
                    .filter_map(|p| Some((p.clone(), manager.engine(p)?)))
                    .collect(),
            );
            readiness.templates = Some(templates);
        }
        readiness
    }
}
