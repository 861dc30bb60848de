//! The two roles the deployment's CA certifies, and the verifiers that hold each side to its
//! peer's: the Web PKI's checks (chain, validity, CRL, host name) first, then the role.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, Error, OtherError, SignatureScheme};
use x509_parser::extensions::GeneralName;

use super::TlsError;

/// The URI SAN of a gateway certificate (a client of nodes).
pub const GATEWAY_URI: &str = "urn:sandgate:role:gateway";
/// The URI SAN of a node certificate (a server to gateways).
pub const NODE_URI: &str = "urn:sandgate:role:node";

/// Which side of the node RPC a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A client of nodes: `clientAuth` and [`GATEWAY_URI`].
    Gateway,
    /// A server to gateways: `serverAuth` and [`NODE_URI`].
    Node,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Gateway => "gateway",
            Role::Node => "node",
        })
    }
}

impl Role {
    fn uri(self) -> &'static str {
        match self {
            Role::Gateway => GATEWAY_URI,
            Role::Node => NODE_URI,
        }
    }

    pub(super) fn pki_hint(self) -> &'static str {
        match self {
            Role::Gateway => "add-gateway NAME",
            Role::Node => "add-node NAME --dns … --ip …",
        }
    }
}

/// Whether `cert` holds `role`: an extended key usage that names the role's use (a certificate
/// with none, "any use" to the Web PKI, is no role's) and the role's URI SAN. The reason when
/// not.
pub(super) fn holds_role(cert: &CertificateDer<'_>, role: Role) -> Result<(), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| format!("it cannot be parsed ({e})"))?;
    let usage = cert
        .extended_key_usage()
        .map_err(|e| format!("its extended key usage cannot be parsed ({e})"))?
        .ok_or("it has no extended key usage")?;
    let (has_usage, usage_name) = match role {
        Role::Gateway => (usage.value.client_auth, "clientAuth"),
        Role::Node => (usage.value.server_auth, "serverAuth"),
    };
    if !has_usage {
        return Err(format!("its extended key usage lacks {usage_name}"));
    }
    let names = cert
        .subject_alternative_name()
        .map_err(|e| format!("its subject alternative names cannot be parsed ({e})"))?;
    let has_uri = names.is_some_and(|san| {
        san.value
            .general_names
            .iter()
            .any(|n| matches!(n, GeneralName::URI(uri) if *uri == role.uri()))
    });
    if !has_uri {
        return Err(format!("it has no URI SAN {}", role.uri()));
    }
    Ok(())
}

/// Whether `cert` is valid for the host of `url` (as a gateway dialling it checks).
pub(super) fn names_host(cert: &CertificateDer<'_>, url: &str) -> Result<(), TlsError> {
    let not_for = |host: &str| TlsError::NotForHost {
        url: url.to_owned(),
        host: host.to_owned(),
    };
    let host = url_host(url).ok_or_else(|| not_for(""))?;
    let name = ServerName::try_from(host.to_owned()).map_err(|_| not_for(&host))?;
    let cert = webpki::EndEntityCert::try_from(cert).map_err(|_| not_for(&host))?;
    cert.verify_is_valid_for_subject_name(&name)
        .map_err(|_| not_for(&host))
}

/// The host of `scheme://host[:port]…`, without an IPv6 address's brackets.
pub(crate) fn url_host(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
    )
}

fn refused(role: Role, why: String) -> Error {
    #[derive(Debug, thiserror::Error)]
    #[error("the peer's certificate is not a {role} certificate: {why}")]
    struct NotOfRole {
        role: Role,
        why: String,
    }
    Error::InvalidCertificate(rustls::CertificateError::Other(OtherError(Arc::new(
        NotOfRole { role, why },
    ))))
}

/// A node's check of its clients: the Web PKI's, then the gateway role.
#[derive(Debug)]
pub(super) struct RoleClientVerifier {
    webpki: Arc<dyn ClientCertVerifier>,
}

impl RoleClientVerifier {
    pub(super) fn new(webpki: Arc<dyn ClientCertVerifier>) -> Self {
        Self { webpki }
    }
}

impl ClientCertVerifier for RoleClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.webpki.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        let verified = self
            .webpki
            .verify_client_cert(end_entity, intermediates, now)?;
        holds_role(end_entity, Role::Gateway).map_err(|why| refused(Role::Gateway, why))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// A gateway's check of a node: the Web PKI's (the host it dials included), then the node role.
#[derive(Debug)]
pub(super) struct RoleServerVerifier {
    webpki: Arc<dyn ServerCertVerifier>,
}

impl RoleServerVerifier {
    pub(super) fn new(webpki: Arc<dyn ServerCertVerifier>) -> Self {
        Self { webpki }
    }
}

impl ServerCertVerifier for RoleServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let verified = self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        holds_role(end_entity, Role::Node).map_err(|why| refused(Role::Node, why))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
