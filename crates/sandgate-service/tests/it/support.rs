//! A fresh, migrated database per test, and a sandbox manager on the snapshot engine.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, ManagerConfig, OciRuntime, PoolConfig, SandboxBackend as _, SandboxManager,
    SandboxProfile,
};
use sandgate_store::nodes::{self, NewNode};
use sandgate_store::{PgPool, PoolSettings};
use sqlx::Connection;

/// A test's own database; dropped (best effort) by [`TestDb::drop_db`].
pub struct TestDb {
    pub pool: PgPool,
    name: String,
    admin: String,
}

impl TestDb {
    pub async fn new() -> Self {
        let admin = std::env::var("DATABASE_URL").expect(
            "DATABASE_URL is not set; source the stack's environment (scripts/stack.sh prints it)",
        );
        let name = format!("sandgate_service_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .expect("the stack's Postgres accepts connections");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("a test database can be created");
        let base = admin.split('?').next().unwrap_or(&admin);
        let url = format!(
            "{}/{name}",
            &base[..base.rfind('/').expect("a database in the URL")]
        );
        let settings = PoolSettings {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(30),
        };
        let pool = sandgate_store::connect_lazy(&url, &settings).expect("a pool");
        sandgate_store::migrate(&pool)
            .await
            .expect("migrations apply");
        Self { pool, name, admin }
    }

    pub async fn drop_db(self) {
        self.pool.close().await;
        if let Ok(mut conn) = sqlx::PgConnection::connect(&self.admin).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

/// A manager on the snapshot engine with one profile, `snap` (runsc2024), and no pool.
pub struct SnapEngine {
    pub manager: SandboxManager,
    pub backend: Arc<DockerBackend>,
    pub host: String,
    pub instance: String,
    /// The engine's plaintext tmpfs.
    pub plain: PathBuf,
    /// The engine's data root.
    pub data_root: PathBuf,
    /// The profile `snap`.
    pub profile: SandboxProfile,
}

impl SnapEngine {
    /// Panics, saying what is missing, when the engine cannot take snapshots.
    pub async fn new(name: &str) -> Self {
        Self::with_faults(name, None).await
    }

    /// [`Self::new`], with `faults` armable at the checkpoint's and restore's steps.
    pub async fn with_faults(
        name: &str,
        faults: Option<Arc<sandgate_sandbox::SnapshotFaults>>,
    ) -> Self {
        let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
        let plain = PathBuf::from(
            std::env::var("SANDGATE_TEST_SNAPSHOT_PLAIN")
                .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into()),
        );
        let mut backend = DockerBackend::connect(&host)
            .expect("a Docker client")
            .with_snapshots(&plain);
        if let Some(faults) = faults {
            backend = backend.with_snapshot_faults(faults);
        }
        if let Err(reason) = backend.snapshot_support("runsc2024").await {
            panic!(
                "snapshots are not available on the engine at {host:?} with plaintext tmpfs {}: \
                 {reason} (scripts/stack.sh up sets them up)",
                plain.display()
            );
        }
        let data_root = PathBuf::from(
            backend
                .client()
                .info()
                .await
                .expect("docker info")
                .docker_root_dir
                .expect("DockerRootDir"),
        );
        let instance = format!(
            "sandgate-test-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut config = ManagerConfig::new(&instance);
        config.pool = PoolConfig {
            min_ready: 0,
            max_ready: 0,
            max_concurrent_starts: 2,
        };
        // These tests checkpoint by hand and search the plaintext tmpfs for their image's bytes:
        // a template of the same profile (same image, same imported stack) would share them.
        config.templates.enabled = false;
        let image = std::env::var("SANDGATE_SANDBOX__IMAGE")
            .or_else(|_| std::env::var("SANDGATE_SANDBOX_IMAGE"))
            .expect("SANDGATE_SANDBOX_IMAGE is not set (source the stack's environment)");
        let snap = SandboxProfile {
            name: "snap".into(),
            image,
            runtime: OciRuntime::Runsc2024,
            ..SandboxProfile::default()
        };
        let backend = Arc::new(backend);
        let manager = SandboxManager::start(backend.clone(), vec![snap.clone()], config)
            .expect("valid configuration");
        Self {
            manager,
            backend,
            host,
            instance,
            plain,
            data_root,
            profile: snap,
        }
    }

    /// How many containers of this test exist.
    pub async fn containers(&self) -> usize {
        self.backend
            .list(&self.instance)
            .await
            .expect("a listing")
            .len()
    }

    pub async fn cleanup(&self) {
        self.manager.shutdown().await;
        remove_instance(&self.host, &self.instance).await;
    }
}

async fn remove_instance(host: &str, instance: &str) {
    let Ok(backend) = DockerBackend::connect(host) else {
        return;
    };
    if let Ok(found) = backend.list(instance).await {
        for c in found {
            let _ = backend.remove(&c.container_id).await;
        }
    }
}

impl Drop for SnapEngine {
    fn drop(&mut self) {
        // After `cleanup` nothing is left; after a panic this is the cleanup, on a fresh
        // runtime (the test's may be gone).
        let (host, instance) = (self.host.clone(), self.instance.clone());
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(remove_instance(&host, &instance));
            }
        })
        .join();
    }
}

/// Registers node `id` (at a loopback URL nothing serves) with its last heartbeat
/// `silent_seconds` ago.
pub async fn register_node(db: &TestDb, id: &str, silent_seconds: i64) {
    let mut conn = db.pool.acquire().await.unwrap();
    nodes::register_locked(
        &mut conn,
        &NewNode {
            id,
            name: id,
            advertise_url: "http://127.0.0.1:9",
            slots: 10,
            memory_bytes: 1 << 30,
            draining: false,
            process: uuid::Uuid::new_v4(),
        },
    )
    .await
    .unwrap();
    sqlx::query("UPDATE nodes SET heartbeat_at = now() - make_interval(secs => $2) WHERE id = $1")
        .bind(id)
        .bind(silent_seconds as f64)
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// Awaits `fut`, failing the test if it takes longer than `limit` (a hang, not a slow run).
pub async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}
