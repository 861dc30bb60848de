//! Serving this process's node to gateways over the node RPC (`[node]`, docs/scale-out.md).

use std::net::SocketAddr;

use sandgate_node::{NodeService, NodeTls, ReadLimits, Role, SandboxManager, ServeError, TlsError};
use tokio::net::TcpListener;

use crate::config::NodeConfig;
use crate::config::check_advertise_url;

/// Why the node RPC could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeRpcError {
    /// `node.listen` is not set (`sandgate node` needs it).
    #[error(
        "node.listen is not set: a node serves gateways on it (e.g. SANDGATE_NODE__LISTEN=127.0.0.1:7443)"
    )]
    NoListen,
    /// `node.listen` could not be bound.
    #[error("cannot listen on node.listen = {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// `node.advertise_url` (or the one derived from `node.listen`) is not one gateways dial.
    #[error("node.advertise_url {url:?} {why}")]
    Advertise {
        /// The URL.
        url: String,
        /// Why not.
        why: String,
    },
    /// The certificates could not be read.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Serving failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// Checks that a gateway's `node.tls_cert` (when set) is a gateway certificate: the one it
/// presents to nodes, which refuse any other.
pub fn check_gateway_identity(config: &NodeConfig) -> Result<(), NodeRpcError> {
    if let Some(tls) = config.tls()? {
        tls.check_own(Role::Gateway, None)?;
    }
    Ok(())
}

/// The node RPC's bound listener and certificates, ready to serve.
#[derive(Debug)]
pub struct NodeRpc {
    listener: TcpListener,
    tls: Option<NodeTls>,
    reads: ReadLimits,
}

impl NodeRpc {
    /// Binds `node.listen` and reads the certificates; `None` when no listener is configured.
    pub async fn bind(config: &NodeConfig) -> Result<Option<Self>, NodeRpcError> {
        if config.listen.is_empty() {
            return Ok(None);
        }
        let tls = config.tls()?;
        let listener =
            TcpListener::bind(&config.listen)
                .await
                .map_err(|source| NodeRpcError::Bind {
                    addr: config.listen.clone(),
                    source,
                })?;
        Ok(Some(Self {
            listener,
            tls,
            reads: config.read_limits(),
        }))
    }

    /// Checks the URL gateways will dial for this node (`node.advertise_url`, or the one derived
    /// from the bound address): its shape ([`check_advertise_url`]), and with TLS that this
    /// node's certificate is a node certificate naming its host.
    pub fn check_advertised(&self, url: &str) -> Result<(), NodeRpcError> {
        check_advertise_url(url, self.tls.is_some()).map_err(|why| NodeRpcError::Advertise {
            url: url.to_owned(),
            why,
        })?;
        if let Some(tls) = &self.tls {
            tls.check_own(Role::Node, Some(url))?;
        }
        Ok(())
    }

    /// The address bound (with port 0, the one the kernel chose).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves `manager`'s sandboxes until `shutdown` resolves.
    pub async fn run(
        self,
        manager: SandboxManager,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), NodeRpcError> {
        sandgate_node::serve(
            self.listener,
            NodeService::new(manager).with_read_limits(self.reads),
            self.tls.as_ref(),
            shutdown,
        )
        .await?;
        Ok(())
    }
}
