//! Helpers shared by the integration tests.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, ManagerConfig, OciRuntime, PoolConfig, Sandbox, SandboxManager, SandboxProfile,
};

/// The sandbox image under test. Tests fail (never skip) without it: CI always builds it.
/// `scripts/stack.sh` writes `SANDGATE_SANDBOX_IMAGE`; the configuration's own variable
/// `SANDGATE_SANDBOX__IMAGE` is honoured too.
pub fn image() -> String {
    std::env::var("SANDGATE_SANDBOX__IMAGE")
        .or_else(|_| std::env::var("SANDGATE_SANDBOX_IMAGE"))
        .expect(
            "SANDGATE_SANDBOX_IMAGE is not set; run the tests through scripts/test.sh \
             (or `source <cache>/stack.env` after scripts/stack.sh up)",
        )
}

/// A Docker client for the engine under test.
pub fn docker() -> bollard::Docker {
    bollard::Docker::connect_with_defaults().expect("a Docker client can be configured")
}

/// Tracing for a test run: quiet unless `RUST_LOG` is set.
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// The OCI runtime the tests run under: `SANDGATE_TEST_RUNTIME` (`runc` by default, `runsc` for
/// gVisor; scripts/test.sh runs the suite under both when runsc is registered).
pub fn runtime() -> OciRuntime {
    match std::env::var("SANDGATE_TEST_RUNTIME") {
        Ok(name) => name.parse().expect("SANDGATE_TEST_RUNTIME names a runtime"),
        Err(_) => OciRuntime::Runc,
    }
}

/// The profile the tests run: the defaults of `config/default.toml`.
pub fn profile() -> SandboxProfile {
    SandboxProfile {
        image: image(),
        runtime: runtime(),
        ..SandboxProfile::default()
    }
}

/// Serialises the tests that measure this process's memory with the ones that use a lot of it.
pub static MEMORY_HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One test's sandboxes: a manager whose containers carry a unique instance label, removed at the
/// end (also when the test panics: the drop guard removes whatever carries the label).
pub struct TestEnv {
    pub manager: SandboxManager,
    pub instance: String,
}

/// Connects to the engine and checks it answers and has the image: a missing engine fails the
/// test (CI always has one).
pub async fn backend() -> Arc<DockerBackend> {
    let backend = DockerBackend::connect("").expect("a Docker client can be configured");
    backend
        .ping()
        .await
        .expect("the Docker engine must be reachable (scripts/stack.sh up)");
    backend
        .ensure_image(&image())
        .await
        .expect("the sandbox image must be built (scripts/stack.sh up)");
    Arc::new(backend)
}

impl TestEnv {
    /// A manager for test `name` keeping `min_ready` warm sandboxes.
    pub async fn new(name: &str, min_ready: usize) -> Self {
        Self::with_profile(name, min_ready, profile()).await
    }

    /// Same, with another profile.
    pub async fn with_profile(name: &str, min_ready: usize, profile: SandboxProfile) -> Self {
        Self::with_pool(name, fixed_pool(min_ready), profile).await
    }

    /// A manager for test `name` whose pool follows demand as `pool` says.
    pub async fn with_pool(name: &str, pool: PoolConfig, profile: SandboxProfile) -> Self {
        Self::configured(name, profile, |config| config.pool = pool).await
    }

    /// Same, measuring demand over `window` (see `ManagerConfig::demand_window`).
    pub async fn with_pool_window(name: &str, pool: PoolConfig, window: Duration) -> Self {
        Self::configured(name, profile(), |config| {
            config.pool = pool;
            config.demand_window = window;
        })
        .await
    }

    async fn configured(
        name: &str,
        profile: SandboxProfile,
        configure: impl FnOnce(&mut ManagerConfig),
    ) -> Self {
        init_tracing();
        let instance = format!(
            "sandgate-test-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut config = ManagerConfig::new(&instance);
        configure(&mut config);
        let manager = SandboxManager::start(backend().await, vec![profile], config)
            .expect("valid configuration");
        Self { manager, instance }
    }

    /// A second manager of the same instance, on a fresh engine connection (a restarted gateway).
    pub async fn another_manager(&self) -> SandboxManager {
        manager(&self.instance, fixed_pool(0), profile()).await
    }

    /// Leases a sandbox of the default profile.
    pub async fn lease(&self) -> Sandbox {
        within(
            Duration::from_secs(120),
            "a lease",
            self.manager.lease("default"),
        )
        .await
        .expect("a sandbox can be leased")
    }

    /// Stops the pool and removes every container of this test.
    pub async fn cleanup(self) {
        self.manager.shutdown().await;
        remove_instance(&self.instance).await;
    }
}

/// A pool that keeps `size` ready whatever the demand (what most tests want).
fn fixed_pool(size: usize) -> PoolConfig {
    PoolConfig {
        min_ready: size,
        max_ready: size,
        max_concurrent_starts: 2,
    }
}

async fn manager(instance: &str, pool: PoolConfig, profile: SandboxProfile) -> SandboxManager {
    let mut config = ManagerConfig::new(instance);
    config.pool = pool;
    SandboxManager::start(backend().await, vec![profile], config).expect("valid configuration")
}

/// How many containers (running or not) carry `instance`'s label.
pub async fn containers(instance: &str) -> usize {
    use sandgate_sandbox::SandboxBackend as _;
    let backend = DockerBackend::connect("").expect("a Docker client");
    backend
        .list(instance)
        .await
        .expect("the engine lists containers")
        .len()
}

async fn remove_instance(instance: &str) {
    use sandgate_sandbox::SandboxBackend as _;
    let Ok(backend) = DockerBackend::connect("") else {
        return;
    };
    if let Ok(containers) = backend.list(instance).await {
        for c in containers {
            let _ = backend.remove(&c.container_id).await;
        }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // Runs after `cleanup` too (then there is nothing left); after a panic it is the cleanup.
        let instance = self.instance.clone();
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(remove_instance(&instance));
            }
        })
        .join();
    }
}

/// Awaits `fut`, failing the test if it takes longer than `limit`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

/// Polls `check` until it returns `Some`, failing the test after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A value from `/proc/self/status` in KiB (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} in /proc/self/status"))
}

/// Resets this process's peak RSS (`VmHWM`) to its current RSS (Linux: `clear_refs` 5).
pub fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("the peak RSS can be reset");
}

/// Deterministic pseudo-random bytes (xorshift), so no generator crate is needed.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
