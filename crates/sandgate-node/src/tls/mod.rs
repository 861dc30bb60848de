//! Mutual TLS between gateways and nodes (docs/security.md, "Node identity"): one private CA
//! per deployment, and two roles it certifies, told apart by a URI SAN and the extended key
//! usage each role needs:
//!
//! - a **gateway** certificate names [`GATEWAY_URI`] and has the `clientAuth` usage; a node
//!   accepts only such clients;
//! - a **node** certificate names [`NODE_URI`], has the `serverAuth` usage and names the host of
//!   the node's `advertise_url`; a gateway accepts only such servers, for the URL it dials.
//!
//! A certificate without an extended key usage (which the Web PKI reads as "any use") fits
//! neither role. An optional CRL (`node.tls_crl`) revokes certificates before they expire. The
//! files are read again when they change on disk (a renewal, cert-manager's or `pki.sh`'s), so the
//! next connection uses the new certificate with no restart.

mod io;
mod material;
mod verify;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub(crate) use io::{connector, incoming};
use material::{Material, Stamp};
pub(crate) use verify::url_host;
pub use verify::{GATEWAY_URI, NODE_URI, Role};

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
    /// A PEM file holds nothing usable.
    #[error("{key} holds no {what} in PEM (make it with deploy/pki.sh)")]
    Empty {
        /// The configuration key that names the file.
        key: &'static str,
        /// What was looked for.
        what: &'static str,
    },
    /// rustls refused the material (a key that does not match, a CA or CRL it cannot parse).
    #[error("the node TLS material cannot be used: {0}")]
    Rustls(#[from] rustls::Error),
    /// The CA or CRL cannot make a verifier.
    #[error("the node TLS CA or CRL cannot be used: {0}")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
    /// This process's own certificate does not hold the role it is used for.
    #[error(
        "node.tls_cert is not a {role} certificate: {why} (issue one with deploy/pki.sh {hint})"
    )]
    WrongRole {
        /// The role it was to be used for.
        role: Role,
        /// What is missing.
        why: String,
        /// The pki.sh command that issues one.
        hint: &'static str,
    },
    /// This node's own certificate does not name the host gateways dial.
    #[error(
        "node.tls_cert does not name {host}, the host of node.advertise_url {url}: gateways would \
         refuse it; issue a certificate for it (deploy/pki.sh add-node NAME --dns/--ip {host}) or \
         set node.advertise_url to a name the certificate holds"
    )]
    NotForHost {
        /// The URL.
        url: String,
        /// Its host.
        host: String,
    },
}

/// When the certificates of a [`NodeTls`] expire, Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// This process's own certificate (`node.tls_cert`).
    pub own: Option<i64>,
    /// The earliest-expiring certificate of the CA bundle (`node.tls_ca`).
    pub ca: Option<i64>,
}

/// Where the material comes from: PEM bytes (tests), or files read again when they change.
enum Source {
    Pem,
    Files {
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
        crl: Option<PathBuf>,
    },
}

/// A certificate, its key, the deployment's CA and an optional CRL. Cheap to clone; a clone
/// sees the files' renewals too.
#[derive(Clone)]
pub struct NodeTls {
    inner: Arc<Inner>,
}

struct Inner {
    source: Source,
    /// The material last read, and the files' stamps it was read at.
    current: Mutex<(Stamp, Arc<Material>)>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls").finish_non_exhaustive()
    }
}

impl NodeTls {
    /// From PEM bytes (never re-read).
    pub fn from_pem(
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
        ca: impl Into<Vec<u8>>,
    ) -> Self {
        let material = Material {
            cert: cert.into(),
            key: key.into().into(),
            ca: ca.into(),
            crl: None,
        };
        Self::new(Source::Pem, Stamp::default(), material)
    }

    /// Same, with a CRL in PEM.
    pub fn from_pem_with_crl(
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
        ca: impl Into<Vec<u8>>,
        crl: impl Into<Vec<u8>>,
    ) -> Self {
        let material = Material {
            cert: cert.into(),
            key: key.into().into(),
            ca: ca.into(),
            crl: Some(crl.into()),
        };
        Self::new(Source::Pem, Stamp::default(), material)
    }

    /// From the files that `node.tls_cert`, `node.tls_key` and `node.tls_ca` name; read again
    /// whenever one of them changes.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        Self::from_files_with_crl(cert, key, ca, None)
    }

    /// Same, with the CRL `node.tls_crl` names (when set), read again when it changes too.
    pub fn from_files_with_crl(
        cert: &Path,
        key: &Path,
        ca: &Path,
        crl: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let source = Source::Files {
            cert: cert.to_owned(),
            key: key.to_owned(),
            ca: ca.to_owned(),
            crl: crl.map(Path::to_owned),
        };
        let (stamp, material) = material::read(&source)?;
        let tls = Self::new(source, stamp, material);
        // Fail at start, with the key's name, rather than at the first handshake.
        tls.material().server_parts()?;
        Ok(tls)
    }

    fn new(source: Source, stamp: Stamp, material: Material) -> Self {
        Self {
            inner: Arc::new(Inner {
                source,
                current: Mutex::new((stamp, Arc::new(material))),
            }),
        }
    }

    /// The material now: read again when a file changed since the last read. A renewal caught
    /// half-written (a key that does not match its certificate yet) keeps the previous material
    /// and is read again at the next connection.
    fn material(&self) -> Arc<Material> {
        let mut current = self.inner.current.lock().expect("node TLS material");
        if let Source::Files { .. } = &self.inner.source {
            let stamp = material::stamp(&self.inner.source);
            if stamp != current.0 {
                match material::read(&self.inner.source).and_then(|(stamp, m)| {
                    m.server_parts()?;
                    Ok((stamp, m))
                }) {
                    Ok((stamp, m)) => {
                        tracing::info!("node TLS files changed on disk: using the new ones");
                        *current = (stamp, Arc::new(m));
                    }
                    Err(err) => tracing::warn!(
                        error = %err,
                        "node TLS files changed on disk but cannot be used yet; keeping the previous ones"
                    ),
                }
            }
        }
        current.1.clone()
    }

    /// Checks that this process's certificate holds `role` (and, for a node, names the host of
    /// `advertise_url`), so a misissued certificate fails at start with what to do.
    pub fn check_own(&self, role: Role, advertise_url: Option<&str>) -> Result<(), TlsError> {
        let material = self.material();
        let cert = material.leaf()?;
        verify::holds_role(&cert, role).map_err(|why| TlsError::WrongRole {
            role,
            why,
            hint: role.pki_hint(),
        })?;
        if let Some(url) = advertise_url {
            verify::names_host(&cert, url)?;
        }
        Ok(())
    }

    /// When the certificates in use now expire (their notAfter, Unix seconds): this process's
    /// own (the first of `tls_cert`) and the earliest of the CA bundle. Reads the files again
    /// first when they changed, as the next connection would, so after a renewal it says the
    /// new certificate's. `None` for one that cannot be parsed.
    pub fn expiry(&self) -> Expiry {
        let material = self.material();
        let not_after = |der: &[u8]| {
            x509_parser::parse_x509_certificate(der)
                .ok()
                .map(|(_, cert)| cert.validity().not_after.timestamp())
        };
        Expiry {
            own: material.leaf().ok().and_then(|cert| not_after(&cert)),
            ca: material
                .ca_certs()
                .iter()
                .filter_map(|cert| not_after(cert))
                .min(),
        }
    }

    /// A node's server side now: its certificate; gateway certificates of the CA required.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        self.material().server_config()
    }

    /// A gateway's client side now: its certificate; node certificates of the CA, for the host
    /// dialled, required.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        self.material().client_config()
    }
}
