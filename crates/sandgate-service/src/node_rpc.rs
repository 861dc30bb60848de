//! Serving this process's node to gateways over the node RPC (`[node]`, docs/scale-out.md).

use std::net::SocketAddr;

use sandgate_node::{NodeService, NodeTls, ReadLimits, SandboxManager, ServeError, TlsError};
use tokio::net::TcpListener;

use crate::config::NodeConfig;

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
    /// The certificates could not be read.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Serving failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
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
        let tls = if config.has_tls() {
            Some(NodeTls::from_files(
                &config.tls_cert,
                &config.tls_key,
                &config.tls_ca,
            )?)
        } else {
            None
        };
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
