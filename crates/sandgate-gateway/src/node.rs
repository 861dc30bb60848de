//! `sandgate node`: a sandbox node only. It owns its engine's containers, warm pool and attach
//! channels (with the reaper and reconciliation of its rows) and serves them to gateways over
//! the node RPC. Its only HTTP is the private listener (`metrics.listen`): `/healthz`,
//! `/readyz` (Postgres, its engine and the sandbox image) and `/metrics` (its pool).

use std::net::SocketAddr;

use sandgate_service::NodeServices;
use sandgate_service::node_rpc::{NodeRpc, NodeRpcError};

use crate::metrics::Metrics;
use crate::private::{PrivateListener, PrivateState};
use crate::{Config, StartError};
use sandgate_service::health::ReadinessProbe;
use sandgate_service::metrics::{CertificateKind, Certificates};

/// A started node, ready to serve.
#[derive(Debug)]
pub struct Node {
    rpc: NodeRpc,
    services: NodeServices,
    /// `/healthz`, `/readyz`, `/metrics`, when `metrics.listen` is set.
    private: Option<(PrivateListener, PrivateState)>,
}

impl Node {
    /// Binds `node.listen` (required), then starts the node's service layer: the schema check
    /// (a node never migrates), the node's registration in Postgres (refused while another live
    /// node serves the same engine) and its heartbeat, the sandbox manager and its warm pool,
    /// the reaper and reconciliation. A node holds no signing key and no secret: `keys.secret`
    /// and `oauth.cookie_secret` are dropped unread.
    pub async fn build(mut config: Config) -> Result<Self, StartError> {
        drop_secrets(&mut config);
        let rpc = NodeRpc::bind(&config.node)
            .await
            .map_err(StartError::Node)?
            .ok_or(StartError::Node(NodeRpcError::NoListen))?;
        let private = PrivateListener::bind(&config).await?;
        if private.is_none() {
            tracing::warn!(
                "metrics.listen is empty: this node serves no /healthz, /readyz or /metrics \
                 (set SANDGATE_METRICS__LISTEN, e.g. 127.0.0.1:9464, for probes and Prometheus)"
            );
        }
        let advertise_url = advertise_url(&config, Some(&rpc));
        rpc.check_advertised(&advertise_url)
            .map_err(StartError::Node)?;
        let services = NodeServices::start(&config, advertise_url).await?;
        let private = private.map(|listener| {
            let state = PrivateState {
                readiness: ReadinessProbe::of_node(&services, &config),
                metrics: Metrics::with_certificates(Certificates::of(
                    &config,
                    vec![CertificateKind::node_server],
                )),
                db: services.db.clone(),
                sandboxes: services.sandboxes.clone(),
                profile: config.sandbox.name.clone(),
            };
            (listener, state)
        });
        Ok(Self {
            rpc,
            services,
            private,
        })
    }

    /// The node's id (its engine's).
    pub fn id(&self) -> &str {
        &self.services.node_id
    }

    /// The private listener's address (`metrics.listen`), when it serves one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.private.as_ref().and_then(|(l, _)| l.local_addr())
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
        let Self {
            rpc,
            services,
            private,
        } = self;
        let stop = tokio_util::sync::CancellationToken::new();
        let private =
            private.map(|(listener, state)| listener.spawn(state, stop.clone().cancelled_owned()));
        let manager = services
            .sandboxes
            .nodes()
            .local()
            .cloned()
            .expect("the service layer runs this process's own node");
        let served = rpc.run(manager, shutdown).await;
        stop.cancel();
        if let Some(private) = private {
            let _ = private.await;
        }
        services.background_stop.cancel();
        services.sandboxes.shutdown().await;
        services.background.close();
        services.background.wait().await;
        served.map_err(StartError::Node)
    }
}

/// Empties the secrets a node never uses, so that it holds none even when its environment sets
/// them (it should not: docs/scale-out.md), and says so.
fn drop_secrets(config: &mut Config) {
    for key in config.drop_gateway_secrets() {
        tracing::warn!(
            key,
            "a node uses no signing key, cookie secret or egress key: this one is ignored; remove it from \
             the node's environment"
        );
    }
}

/// The URL other gateways dial for this process's node: `node.advertise_url`, else derived from
/// the bound RPC address (with port 0 the kernel picked the port: advertise the real one); empty
/// when the node has no RPC listener (`node.listen` empty: it serves only its own process).
pub(crate) fn advertise_url(config: &Config, rpc: Option<&NodeRpc>) -> String {
    let Some(addr) = rpc.and_then(NodeRpc::local_addr) else {
        return String::new();
    };
    if !config.node.advertise_url.is_empty() {
        return config.node.advertise_url.clone();
    }
    let scheme = if config.node.has_tls() {
        "https"
    } else {
        "http"
    };
    format!("{scheme}://{addr}")
}
