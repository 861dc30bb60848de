//! A throwaway private CA for tests: certificates for 127.0.0.1 signed by it, as the node RPC's
//! mutual TLS wants them (feature `test-pki`).

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::NodeTls;

/// A deployment's private CA, made for a test.
#[allow(missing_debug_implementations)] // holds a private key
pub struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        Self {
            ca: CertifiedIssuer::self_signed(params, key).expect("a self-signed CA"),
        }
    }

    /// The CA certificate in PEM.
    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for 127.0.0.1 (server and client use), signed by this CA; with the CA as
    /// the peer root.
    pub fn tls(&self) -> NodeTls {
        self.tls_trusting(&self.ca_pem())
    }

    /// Same, trusting `ca_pem` as the peer's root instead.
    pub fn tls_trusting(&self, ca_pem: &str) -> NodeTls {
        let (cert, key) = self.leaf_pem();
        NodeTls::from_pem(cert, key, ca_pem.to_owned())
    }

    /// A certificate for 127.0.0.1 and localhost (server and client use) signed by this CA, and
    /// its key, in PEM.
    pub fn leaf_pem(&self) -> (String, String) {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("leaf params");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params
            .distinguished_name
            .push(DnType::CommonName, "sandgate test");
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("a signed leaf");
        (cert.pem(), key.serialize_pem())
    }
}
