//! Readiness: whether this process can serve (Postgres, Docker and the sandbox image answer).
//! The gateway's `/readyz` serves it.

use std::time::Duration;

use sandgate_sandbox::DockerBackend;
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
}

/// Each dependency's check.
#[derive(Debug, Serialize)]
pub struct Checks {
    /// Postgres answers a query.
    pub postgres: Check,
    /// The Docker engine answers a ping.
    pub docker: Check,
    /// The sandbox image exists on the engine.
    pub sandbox_image: Check,
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

/// Checks Postgres, the Docker engine and the sandbox `image` at once, each bounded in time.
pub async fn readiness(db: &PgPool, docker: &DockerBackend, image: &str) -> Readiness {
    let (postgres, docker_ping, sandbox_image) = tokio::join!(
        tokio::time::timeout(CHECK_TIMEOUT, sandgate_store::ping(db)),
        tokio::time::timeout(CHECK_TIMEOUT, docker.ping()),
        tokio::time::timeout(CHECK_TIMEOUT, docker.ensure_image(image)),
    );
    let checks = Checks {
        postgres: Check::from_result(postgres),
        docker: Check::from_result(docker_ping),
        sandbox_image: Check::from_result(sandbox_image),
    };
    let ready = checks.postgres.ok && checks.docker.ok && checks.sandbox_image.ok;
    Readiness {
        status: if ready { "ready" } else { "not_ready" },
        checks,
    }
}

impl Readiness {
    /// Whether every check passed.
    pub fn is_ready(&self) -> bool {
        self.status == "ready"
    }
}
