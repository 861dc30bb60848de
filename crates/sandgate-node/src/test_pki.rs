//! A throwaway private CA for tests: certificates for 127.0.0.1 (or the names a test asks for)
//! signed by it, as the node RPC's mutual TLS wants them (feature `test-pki`).

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::{GATEWAY_URI, NODE_URI, NodeTls};

/// What a test certificate is for: the roles it holds ([`crate::Role`]), or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    /// Both roles, as a `sandgate serve` that runs a node and dials others holds.
    Both,
    /// A gateway's only: `clientAuth` and the gateway URI.
    Gateway,
    /// A node's only: `serverAuth` and the node URI.
    Node,
    /// No extended key usage and no role URI: "any use" to the Web PKI, no role's to sandgate.
    NoUsage,
}

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

    /// A certificate for 127.0.0.1 (both roles), signed by this CA; with the CA as
    /// the peer root.
    pub fn tls(&self) -> NodeTls {
        self.tls_trusting(&self.ca_pem())
    }

    /// Same, trusting `ca_pem` as the peer's root instead.
    pub fn tls_trusting(&self, ca_pem: &str) -> NodeTls {
        let (cert, key) = self.leaf_pem();
        NodeTls::from_pem(cert, key, ca_pem.to_owned())
    }

    /// A certificate for 127.0.0.1 and localhost (both roles) signed by this CA, and
    /// its key, in PEM.
    pub fn leaf_pem(&self) -> (String, String) {
        self.leaf_pem_for(&["127.0.0.1", "localhost"])
    }

    /// A certificate for exactly `names` (both roles) signed by this CA, and its key, in PEM. A
    /// name that parses as an IP address (`10.1.2.3`, `::1`) becomes an IP address SAN, as a
    /// node advertised by its pod IP needs; any other a DNS name SAN.
    pub fn leaf_pem_for(&self, names: &[&str]) -> (String, String) {
        self.leaf_pem_of(Leaf::Both, names)
    }

    /// A certificate of `leaf`'s kind for exactly `names`, signed by this CA, and its key.
    pub fn leaf_pem_of(&self, leaf: Leaf, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        let (usages, uris): (&[ExtendedKeyUsagePurpose], &[&str]) = match leaf {
            Leaf::Both => (
                &[
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
                &[GATEWAY_URI, NODE_URI],
            ),
            Leaf::Gateway => (&[ExtendedKeyUsagePurpose::ClientAuth], &[GATEWAY_URI]),
            Leaf::Node => (&[ExtendedKeyUsagePurpose::ServerAuth], &[NODE_URI]),
            Leaf::NoUsage => (&[], &[]),
        };
        params.extended_key_usages = usages.to_vec();
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().expect("a URI SAN")));
        }
        params
            .distinguished_name
            .push(DnType::CommonName, "sandgate test");
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("a signed leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// A certificate for 127.0.0.1 and localhost (both roles) that expires at the start of
    /// `year`-01-02 (a renewal with a notAfter of its own), and its key, in PEM.
    pub fn leaf_pem_expiring(&self, year: i32) -> (String, String) {
        let names = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        let mut params = CertificateParams::new(names).expect("leaf params");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        for uri in [GATEWAY_URI, NODE_URI] {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().expect("a URI SAN")));
        }
        params.not_after = rcgen::date_time_ymd(year, 1, 2);
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("a signed leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// TLS material of `leaf`'s kind for 127.0.0.1 and localhost, with this CA as the peer root.
    pub fn tls_of(&self, leaf: Leaf) -> NodeTls {
        let (cert, key) = self.leaf_pem_of(leaf, &["127.0.0.1", "localhost"]);
        NodeTls::from_pem(cert, key, self.ca_pem())
    }

    /// TLS material with a certificate for exactly `names` (see [`Self::leaf_pem_for`]), with
    /// this CA as the peer root.
    pub fn tls_for(&self, names: &[&str]) -> NodeTls {
        let (cert, key) = self.leaf_pem_for(names);
        NodeTls::from_pem(cert, key, self.ca_pem())
    }
}
