//! A private CA per test, a node serving a real sandbox manager, and cleanup.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use sandgate_node::test_pki::Pki;
use sandgate_node::{NodeService, NodeTls, RemoteNode};
use sandgate_sandbox::{
    DockerBackend, ManagerConfig, PoolConfig, SandboxBackend as _, SandboxManager, SandboxProfile,
};
use tokio_util::sync::CancellationToken;

/// The sandbox image under test (`scripts/stack.sh` writes `SANDGATE_SANDBOX_IMAGE`).
pub fn image() -> String {
    std::env::var("SANDGATE_SANDBOX__IMAGE")
        .or_else(|_| std::env::var("SANDGATE_SANDBOX_IMAGE"))
        .expect("SANDGATE_SANDBOX_IMAGE is not set; `source <cache>/stack.env` after scripts/stack.sh up")
}

/// The default profile of `config/default.toml`.
pub fn profile() -> SandboxProfile {
    SandboxProfile {
        image: image(),
        ..SandboxProfile::default()
    }
}

/// A node serving a real manager on 127.0.0.1 over mutual TLS, and the CA it trusts.
pub struct TestNode {
    pub pki: Pki,
    pub addr: SocketAddr,
    pub instance: String,
    stop: CancellationToken,
}

impl TestNode {
    /// Starts a node for test `name` with an empty warm pool.
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, "127.0.0.1", None, NodeService::new).await
    }

    /// Starts a node for test `name` listening on `ip` (a loopback address), presenting a
    /// certificate for exactly `names` (default: 127.0.0.1 and localhost), its service set up
    /// by `service`.
    pub async fn start_with(
        name: &str,
        ip: &str,
        names: Option<&[&str]>,
        service: impl FnOnce(SandboxManager) -> NodeService,
    ) -> Self {
        Self::start_serving(name, ip, names, vec![profile()], service).await
    }

    /// Starts a node for test `name` on 127.0.0.1 whose manager serves `profiles`.
    pub async fn start_with_profiles(
        name: &str,
        profiles: Vec<SandboxProfile>,
        service: impl FnOnce(SandboxManager) -> NodeService,
    ) -> Self {
        Self::start_serving(name, "127.0.0.1", None, profiles, service).await
    }

    /// Starts a node for test `name` on 127.0.0.1 serving `profiles` on the snapshot engine
    /// (`SANDGATE_TEST_SNAPSHOT_DOCKER`, its tmpfs `SANDGATE_TEST_SNAPSHOT_PLAIN`; the defaults as
    /// in the sandbox crate's snapshot tests).
    pub async fn start_snapshotting(name: &str, profiles: Vec<SandboxProfile>) -> Self {
        let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
        let plain = std::env::var("SANDGATE_TEST_SNAPSHOT_PLAIN")
            .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into());
        let backend = DockerBackend::connect(&host)
            .expect("a Docker client")
            .with_snapshots(plain);
        Self::start_on(backend, name, "127.0.0.1", None, profiles, NodeService::new).await
    }

    async fn start_serving(
        name: &str,
        ip: &str,
        names: Option<&[&str]>,
        profiles: Vec<SandboxProfile>,
        service: impl FnOnce(SandboxManager) -> NodeService,
    ) -> Self {
        let backend = DockerBackend::connect("").expect("a Docker client");
        Self::start_on(backend, name, ip, names, profiles, service).await
    }

    /// Starts a node for test `name` on 127.0.0.1 presenting `tls` (made from `pki`, or files
    /// the test replaces), with an empty warm pool.
    pub async fn start_presenting(name: &str, pki: Pki, tls: NodeTls) -> Self {
        let backend = DockerBackend::connect("").expect("a Docker client");
        let service = NodeService::new;
        Self::start_tls(
            backend,
            name,
            "127.0.0.1",
            vec![profile()],
            service,
            pki,
            |_| tls,
        )
        .await
    }

    async fn start_on(
        backend: DockerBackend,
        name: &str,
        ip: &str,
        names: Option<&[&str]>,
        profiles: Vec<SandboxProfile>,
        service: impl FnOnce(SandboxManager) -> NodeService,
    ) -> Self {
        let pki = Pki::new("sandgate test CA");
        let tls = |pki: &Pki| match names {
            Some(names) => pki.tls_for(names),
            None => pki.tls(),
        };
        Self::start_tls(backend, name, ip, profiles, service, pki, tls).await
    }

    async fn start_tls(
        backend: DockerBackend,
        name: &str,
        ip: &str,
        profiles: Vec<SandboxProfile>,
        service: impl FnOnce(SandboxManager) -> NodeService,
        pki: Pki,
        tls: impl FnOnce(&Pki) -> NodeTls,
    ) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let instance = format!(
            "sandgate-test-node-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        backend
            .ping()
            .await
            .expect("the Docker engine must be reachable (scripts/stack.sh up)");
        let mut config = ManagerConfig::new(&instance);
        config.pool = PoolConfig {
            min_ready: 0,
            max_ready: 0,
            max_concurrent_starts: 2,
        };
        let manager = SandboxManager::start(Arc::new(backend), profiles, config)
            .expect("a valid configuration");
        let listener = tokio::net::TcpListener::bind((ip, 0))
            .await
            .expect("a loopback port");
        let addr = listener.local_addr().expect("its address");
        let stop = CancellationToken::new();
        let tls = tls(&pki);
        let wait = stop.clone().cancelled_owned();
        let service = service(manager);
        tokio::spawn(async move {
            sandgate_node::serve(listener, service, Some(&tls), wait)
                .await
                .expect("the node serves");
        });
        Self {
            pki,
            addr,
            instance,
            stop,
        }
    }

    /// The node's URL.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// A gateway's client with a certificate of the node's CA.
    pub fn client(&self) -> RemoteNode {
        RemoteNode::connect_lazy(&self.url(), &self.pki.tls()).expect("a client")
    }

    /// Stops serving and removes the test's containers.
    pub async fn cleanup(self) {
        self.stop.cancel();
        remove_instance(&self.instance).await;
    }
}

async fn remove_instance(instance: &str) {
    let Ok(backend) = DockerBackend::connect("") else {
        return;
    };
    if let Ok(containers) = backend.list(instance).await {
        for c in containers {
            let _ = backend.remove(&c.container_id).await;
        }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        // After a panic this is the cleanup (after `cleanup` there is nothing left).
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

/// `fut`, or a panic naming `what` once `limit` passed (a hung call fails the test, never the
/// suite).
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}
