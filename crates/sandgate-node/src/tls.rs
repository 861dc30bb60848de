//! Mutual TLS between gateways and nodes: one private CA per deployment. A node presents its
//! certificate and accepts only clients with a certificate the CA signed; a gateway presents its
//! own and accepts only nodes the CA signed.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Why the TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read.
    #[error("cannot read {key} ({path}): {source}")]
    Read {
        /// The configuration key that names the file.
        key: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A certificate, its key and the deployment's CA, in PEM.
#[derive(Clone)]
pub struct NodeTls {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls").finish_non_exhaustive()
    }
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        key,
        path: path.to_owned(),
        source,
    })
}

impl NodeTls {
    /// From PEM bytes.
    pub fn from_pem(
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
        ca: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            cert: cert.into(),
            key: key.into(),
            ca: ca.into(),
        }
    }

    /// From the files that `node.tls_cert`, `node.tls_key` and `node.tls_ca` name.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert: read("node.tls_cert", cert)?,
            key: read("node.tls_key", key)?,
            ca: read("node.tls_ca", ca)?,
        })
    }

    /// A node's server side: its certificate; client certificates required, signed by the CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
            .client_auth_optional(false)
    }

    /// A gateway's client side: its certificate; nodes verified against the CA only.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .ca_certificate(Certificate::from_pem(&self.ca))
    }
}
