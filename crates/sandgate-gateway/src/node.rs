//! `sandgate node`: a sandbox node only. It owns its engine's containers, warm pool and attach
//! channels (with the reaper and reconciliation of its rows) and serves them to gateways over
//! the node RPC; it has no HTTP faces.

use std::net::SocketAddr;

use sandgate_service::Services;
use sandgate_service::node_registry::{self, Registration};
use sandgate_service::node_rpc::{NodeRpc, NodeRpcError};

use crate::{Config, StartError};

/// A started node, ready to serve.
#[derive(Debug)]
pub struct Node {
    rpc: NodeRpc,
    services: Services,
    registration: Registration,
}

impl Node {
    /// Binds `node.listen` (required), then starts the service layer (migrations, the sandbox
    /// manager and its warm pool, the reaper and reconciliation) and registers the node in
    /// Postgres, heartbeating from then on. Refused while another node's heartbeat on the same
    /// engine is live.
    pub async fn build(config: Config) -> Result<Self, StartError> {
        let rpc = NodeRpc::bind(&config.node)
            .await
            .map_err(StartError::Node)?
            .ok_or(StartError::Node(NodeRpcError::NoListen))?;
        // With port 0 the kernel picked the port: advertise the real one.
        let advertise = match (config.node.advertise_url.is_empty(), rpc.local_addr()) {
            (true, Some(addr)) => {
                let scheme = if config.node.has_tls() {
                    "https"
                } else {
                    "http"
                };
                format!("{scheme}://{addr}")
            }
            _ => config.node.advertise_url().unwrap_or_default(),
        };
        let registration = node_registry::register_configured(&config, &advertise)
            .await
            .map_err(StartError::Registry)?;
        let services = Services::start(&config).await?;
        node_registry::spawn_heartbeat(
            &registration,
            &config.node,
            services.sandboxes.clone(),
            services.background_stop.clone(),
            &services.background,
        );
        Ok(Self {
            rpc,
            services,
            registration,
        })
    }

    /// The node's id (its engine's).
    pub fn id(&self) -> &str {
        &self.registration.row.id
    }

    /// The RPC address bound.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.rpc.local_addr()
    }

    /// Serves until `shutdown` resolves. Leased sandboxes keep running for the next start to
    /// re-attach to; warm ones recorded in Postgres stay.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let Self { rpc, services, .. } = self;
        let manager = services
            .sandboxes
            .node()
            .local()
            .cloned()
            .expect("the service layer runs this process's own node");
        let served = rpc.run(manager, shutdown).await;
        services.background_stop.cancel();
        services.sandboxes.shutdown().await;
        services.background.close();
        services.background.wait().await;
        served.map_err(StartError::Node)
    }
}
