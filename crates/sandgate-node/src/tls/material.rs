//! The PEM material of one process, the files' stamps that say when to read it again, and the
//! rustls configurations built from it.

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use zeroize::Zeroizing;

use super::verify::{RoleClientVerifier, RoleServerVerifier};
use super::{Source, TlsError};

/// The PEM bytes of a process's certificate, key, CA and CRL.
pub(super) struct Material {
    pub(super) cert: Vec<u8>,
    pub(super) key: Zeroizing<Vec<u8>>,
    pub(super) ca: Vec<u8>,
    pub(super) crl: Option<Vec<u8>>,
}

/// Each file's modification time and length when read: a renewal changes one of them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Stamp(Vec<Option<(SystemTime, u64)>>);

fn files(source: &Source) -> Vec<(&'static str, &Path)> {
    match source {
        Source::Pem => Vec::new(),
        Source::Files { cert, key, ca, crl } => {
            let mut files = vec![
                ("node.tls_cert", cert.as_path()),
                ("node.tls_key", key.as_path()),
                ("node.tls_ca", ca.as_path()),
            ];
            if let Some(crl) = crl {
                files.push(("node.tls_crl", crl.as_path()));
            }
            files
        }
    }
}

/// The files' stamps now (a file that cannot be read has none).
pub(super) fn stamp(source: &Source) -> Stamp {
    Stamp(
        files(source)
            .into_iter()
            .map(|(_, path)| {
                let meta = std::fs::metadata(path).ok()?;
                Some((meta.modified().ok()?, meta.len()))
            })
            .collect(),
    )
}

/// Reads the files of `source`, with their stamps taken first (a change during the read is
/// seen at the next look).
pub(super) fn read(source: &Source) -> Result<(Stamp, Material), TlsError> {
    let stamp = stamp(source);
    let Source::Files { cert, key, ca, crl } = source else {
        unreachable!("PEM material is never read from files");
    };
    let read = |key: &'static str, path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            key,
            path: path.to_owned(),
            source,
        })
    };
    let material = Material {
        cert: read("node.tls_cert", cert)?,
        key: Zeroizing::new(read("node.tls_key", key)?),
        ca: read("node.tls_ca", ca)?,
        crl: crl
            .as_deref()
            .map(|p| read("node.tls_crl", p))
            .transpose()?,
    };
    Ok((stamp, material))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The protocols both sides speak: the node RPC is gRPC, HTTP/2 only.
fn alpn() -> Vec<Vec<u8>> {
    vec![b"h2".to_vec()]
}

impl Material {
    fn chain(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let chain = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| TlsError::Empty {
                key: "node.tls_cert",
                what: "certificate",
            })?;
        if chain.is_empty() {
            return Err(TlsError::Empty {
                key: "node.tls_cert",
                what: "certificate",
            });
        }
        Ok(chain)
    }

    /// This process's own certificate (the first of `tls_cert`).
    pub(super) fn leaf(&self) -> Result<CertificateDer<'static>, TlsError> {
        Ok(self.chain()?.swap_remove(0))
    }

    fn key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_slice(&self.key).map_err(|_| TlsError::Empty {
            key: "node.tls_key",
            what: "private key",
        })
    }

    /// The CA certificates of `tls_ca`, as DER.
    pub(super) fn ca_certs(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(&self.ca)
            .filter_map(Result::ok)
            .collect()
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&self.ca) {
            let ca = ca.map_err(|_| TlsError::Empty {
                key: "node.tls_ca",
                what: "CA certificate",
            })?;
            roots.add(ca)?;
        }
        if roots.is_empty() {
            return Err(TlsError::Empty {
                key: "node.tls_ca",
                what: "CA certificate",
            });
        }
        Ok(Arc::new(roots))
    }

    fn crls(&self) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
        let Some(crl) = &self.crl else {
            return Ok(Vec::new());
        };
        CertificateRevocationListDer::pem_slice_iter(crl)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| TlsError::Empty {
                key: "node.tls_crl",
                what: "CRL",
            })
    }

    /// Everything parses, and the key matches the certificate.
    pub(super) fn server_parts(&self) -> Result<(), TlsError> {
        self.server_config().map(drop)
    }

    /// A node's server configuration: its certificate; client certificates required, signed by
    /// the CA, not revoked, and of the gateway role.
    pub(super) fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let provider = provider();
        let webpki = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .with_crls(self.crls()?)
            .build()?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(Arc::new(RoleClientVerifier::new(webpki)))
            .with_single_cert(self.chain()?, self.key()?)?;
        config.alpn_protocols = alpn();
        Ok(Arc::new(config))
    }

    /// A gateway's client configuration: its certificate; servers signed by the CA, not
    /// revoked, of the node role and naming the host dialled.
    pub(super) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let provider = provider();
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .with_crls(self.crls()?)
        .build()?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(RoleServerVerifier::new(webpki)))
            .with_client_auth_cert(self.chain()?, self.key()?)?;
        config.alpn_protocols = alpn();
        Ok(Arc::new(config))
    }
}
