//! A tenant's secrets: checked, and sealed under the egress secrets key, a key of its own (not
//! derived from `keys.secret`, not a signing key), so the component that opens them holds
//! nothing else, and what holds `keys.secret` opens none of them.
//!
//! Sealed form: `version (1) ‖ nonce (24) ‖ ciphertext+tag`, XChaCha20-Poly1305 with the tenant,
//! the secret's name and its rotation version as associated data: a sealed value moved to
//! another tenant or name, or an older value put back after a rotation, does not open.

use std::sync::Arc;

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use uuid::Uuid;
use zeroize::Zeroize as _;

use super::rules::{HostPattern, RuleError};

const SEALED_V1: u8 = 1;
const NONCE_BYTES: usize = 24;
/// The label of the sealing key's derivation from the configured egress secrets key.
const SEAL_PURPOSE: &str = "tenant egress secrets v1";
/// The label of the placeholders' key's derivation from the configured egress secrets key.
const PLACEHOLDER_PURPOSE: &str = "tenant egress placeholders v1";
/// Environment variables a secret's placeholder may not take (the agent's own guard is the same):
/// names the shell, Python, the loader, the proxy and the CA bundle read.
const RESERVED_NAMES: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "PWD",
    "OLDPWD",
    "TERM",
    "TMPDIR",
    "TZ",
    "LANG",
    "LANGUAGE",
    "HOSTNAME",
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "MPLCONFIGDIR",
    "MPLBACKEND",
    "IPYTHONDIR",
    "BASH_ENV",
    "ENV",
    "IFS",
    "PS4",
    "PROMPT_COMMAND",
    "GLIBC_TUNABLES",
    "GCONV_PATH",
    "HOSTALIASES",
    "SSLKEYLOGFILE",
    "CURL_HOME",
    "JAVA_TOOL_OPTIONS",
    "PERL5OPT",
    "PERL5LIB",
];
/// Prefixes of variables a placeholder may not take.
const RESERVED_PREFIXES: &[&str] = &[
    "LC_", "LD_", "PYTHON", "SANDGATE", "PIP_", "JUPYTER", "NODE_", "OPENSSL", "GIT_", "XDG_",
];
/// The label of a sealed value's associated data.
const AAD_PURPOSE: &[u8] = b"sandgate tenant secret v1\0";
/// The longest value, bytes (a header value: a token, not a document).
pub const MAX_VALUE_BYTES: usize = 8 * 1024;

/// The egress secrets key used when none is configured on a loopback-only deployment
/// (`crate::config::EgressConfig::sealer`). Public: a
/// secret sealed under it is protected only by the host's loopback interface.
pub const DEVELOPMENT_SECRETS_KEY: &str =
    "sandgate development egress secrets key: loopback only, never for a deployment";

/// A secret, a name or a binding that is refused, or a sealed value that does not open.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The name is not an environment variable name this accepts.
    #[error(
        "{0:?} is not a secret name: write 1 to 64 upper-case letters, digits and `_`, starting \
         with a letter (it becomes the placeholder's environment variable, e.g. SHOP_TOKEN)"
    )]
    BadName(String),
    /// The name is an environment variable the sandbox's programs need for themselves.
    #[error(
        "{0} cannot be a secret's name: its placeholder would replace an environment variable          the sandbox needs (PATH, HOME, the proxy and CA variables, LC_*, LD_*, PYTHON*,          SANDGATE*, PIP_*, NODE_*, ...); choose a name of its own, e.g. SHOP_TOKEN"
    )]
    ReservedName(String),
    /// The header may not carry a secret.
    #[error(
        "{0:?} cannot carry a secret: name an HTTP request header such as authorization or \
         x-api-key (not one that frames or routes the request: host, content-length, \
         transfer-encoding, connection, te, upgrade, trailer, proxy-*)"
    )]
    BadHeader(String),
    /// A bound host is not a rule host.
    #[error(transparent)]
    BadHost(#[from] RuleError),
    /// The binding names no host or no header.
    #[error("a secret must be bound to at least one host (--host) and one header (--header)")]
    Unbound,
    /// The value is empty, too long, or holds bytes a header value cannot.
    #[error(
        "the secret's value {0}: give it on standard input as one line of printable characters \
         (at most 8 KiB; the final newline is dropped)"
    )]
    BadValue(&'static str),
    /// The sealed value does not open.
    #[error(
        "secret {name} of tenant {tenant} does not open with the egress secrets key: the row was \
         altered or moved, or egress.secrets_key changed since it was set (set it back, or set \
         the secret again with `sandgate admin tenant secret set`)"
    )]
    Unseal {
        /// The tenant.
        tenant: Uuid,
        /// The secret's name.
        name: String,
    },
}

/// Checks a secret's name.
pub fn check_secret_name(name: &str) -> Result<(), SecretError> {
    let ok = (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_uppercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(SecretError::BadName(name.to_owned()));
    }
    if RESERVED_NAMES.contains(&name) || RESERVED_PREFIXES.iter().any(|p| name.starts_with(p)) {
        return Err(SecretError::ReservedName(name.to_owned()));
    }
    Ok(())
}

/// Checks a header a secret may go into; returns it lower-case.
pub fn check_header_name(header: &str) -> Result<String, SecretError> {
    let bad = || SecretError::BadHeader(header.to_owned());
    let name = http::HeaderName::from_bytes(header.trim().as_bytes()).map_err(|_| bad())?;
    let framing = [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
    ];
    if framing.contains(&name.as_str()) || name.as_str().starts_with("proxy-") {
        return Err(bad());
    }
    Ok(name.as_str().to_owned())
}

/// Checks a value read from standard input (one final newline dropped); returns it.
pub fn check_secret_value(raw: &str) -> Result<&str, SecretError> {
    let value = raw
        .strip_suffix("\r\n")
        .or_else(|| raw.strip_suffix('\n'))
        .unwrap_or(raw);
    if value.is_empty() {
        return Err(SecretError::BadValue("is empty"));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(SecretError::BadValue("is longer than 8 KiB"));
    }
    if value.bytes().any(|b| b.is_ascii_control() || !b.is_ascii()) {
        return Err(SecretError::BadValue(
            "holds a control character or a non-ASCII byte",
        ));
    }
    Ok(value)
}

/// The hosts and headers a secret may go to, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretBinding {
    /// Host names or wildcards, as rule hosts (no port).
    pub hosts: Vec<String>,
    /// Lower-case request header names.
    pub headers: Vec<String>,
}

impl SecretBinding {
    /// Checks `hosts` and `headers` (at least one of each; duplicates dropped).
    pub fn parse(hosts: &[String], headers: &[String]) -> Result<Self, SecretError> {
        let mut binding = Self {
            hosts: Vec::new(),
            headers: Vec::new(),
        };
        for host in hosts {
            let host = HostPattern::parse(host)?.as_str().to_owned();
            if !binding.hosts.contains(&host) {
                binding.hosts.push(host);
            }
        }
        for header in headers {
            let header = check_header_name(header)?;
            if !binding.headers.contains(&header) {
                binding.headers.push(header);
            }
        }
        if binding.hosts.is_empty() || binding.headers.is_empty() {
            return Err(SecretError::Unbound);
        }
        Ok(binding)
    }
}

/// Seals and opens tenants' secrets. Cheap to clone; never printed.
#[derive(Clone)]
pub struct SecretSealer {
    cipher: Arc<XChaCha20Poly1305>,
    /// Keys the placeholders (`Self::placeholder`).
    placeholders: Arc<zeroize::Zeroizing<[u8; 32]>>,
}

impl std::fmt::Debug for SecretSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSealer").finish_non_exhaustive()
    }
}

impl SecretSealer {
    /// The sealer whose key is derived from the egress secrets key `key` (at least 32 bytes,
    /// checked by the configuration).
    pub fn new(key: &[u8]) -> Self {
        let mut derived = crate::keys::derive_key(key, SEAL_PURPOSE);
        let cipher = XChaCha20Poly1305::new(&derived.into());
        derived.zeroize();
        Self {
            cipher: Arc::new(cipher),
            placeholders: Arc::new(zeroize::Zeroizing::new(crate::keys::derive_key(
                key,
                PLACEHOLDER_PURPOSE,
            ))),
        }
    }

    /// The placeholder of secret `name` in sandbox `sandbox_id` of `tenant`: an opaque token
    /// (`sgp_` and 32 hex digits), the same on every replica and across rotations, different in
    /// every sandbox, so a placeholder seen in one sandbox stands for nothing in another.
    pub fn placeholder(&self, tenant: Uuid, sandbox_id: &str, name: &str) -> String {
        use hmac::{Hmac, Mac};
        let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.placeholders[..])
            .expect("HMAC takes any key length");
        mac.update(tenant.as_bytes());
        mac.update(sandbox_id.as_bytes());
        mac.update(&[0]);
        mac.update(name.as_bytes());
        let digest = mac.finalize().into_bytes();
        format!("sgp_{}", hex::encode(&digest[..16]))
    }

    fn aad(tenant: Uuid, name: &str, version: i32) -> Vec<u8> {
        let mut aad = AAD_PURPOSE.to_vec();
        aad.extend_from_slice(tenant.as_bytes());
        aad.extend_from_slice(name.as_bytes());
        aad.push(0);
        aad.extend_from_slice(&version.to_be_bytes());
        aad
    }

    /// `value` sealed for secret `name`'s `version` of `tenant`.
    pub fn seal(&self, tenant: Uuid, name: &str, version: i32, value: &[u8]) -> Vec<u8> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = Self::aad(tenant, name, version);
        let sealed = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: value,
                    aad: &aad,
                },
            )
            .expect("sealing a value of at most 8 KiB cannot fail");
        let mut out = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
        out.push(SEALED_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The value of secret `name`'s `version` of `tenant`, from its `sealed` form.
    pub fn open(
        &self,
        tenant: Uuid,
        name: &str,
        version: i32,
        sealed: &[u8],
    ) -> Result<zeroize::Zeroizing<Vec<u8>>, SecretError> {
        let refused = || SecretError::Unseal {
            tenant,
            name: name.to_owned(),
        };
        let (&format, rest) = sealed.split_first().ok_or_else(refused)?;
        if format != SEALED_V1 || rest.len() < NONCE_BYTES {
            return Err(refused());
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_BYTES);
        let nonce = XNonce::from(<[u8; NONCE_BYTES]>::try_from(nonce).map_err(|_| refused())?);
        let aad = Self::aad(tenant, name, version);
        self.cipher
            .decrypt(
                &nonce,
                Payload {
                    msg: ciphertext,
                    aad: &aad,
                },
            )
            .map(zeroize::Zeroizing::new)
            .map_err(|_| refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"an egress secrets key of at least 32 characters";

    #[test]
    fn a_sealed_secret_opens_only_for_its_tenant_name_version_and_key() {
        let sealer = SecretSealer::new(KEY);
        let (acme, other) = (Uuid::new_v4(), Uuid::new_v4());
        let value = b"shpat_real_value_0123456789";
        let sealed = sealer.seal(acme, "SHOP_TOKEN", 2, value);
        assert!(
            !sealed.windows(value.len()).any(|w| w == value),
            "the sealed form does not hold the value"
        );
        let opened = sealer.open(acme, "SHOP_TOKEN", 2, &sealed).unwrap();
        assert_eq!(opened.as_slice(), value);
        assert!(
            sealer.open(other, "SHOP_TOKEN", 2, &sealed).is_err(),
            "another tenant"
        );
        assert!(
            sealer.open(acme, "OTHER_TOKEN", 2, &sealed).is_err(),
            "another name"
        );
        assert!(
            sealer.open(acme, "SHOP_TOKEN", 3, &sealed).is_err(),
            "a newer version"
        );
        assert!(
            sealer.open(acme, "SHOP_TOKEN", 1, &sealed).is_err(),
            "an older version"
        );
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert!(sealer.open(acme, "SHOP_TOKEN", 2, &altered).is_err());
        assert!(sealer.open(acme, "SHOP_TOKEN", 2, &sealed[..30]).is_err());
        assert!(sealer.open(acme, "SHOP_TOKEN", 2, &[]).is_err());
        let other_key = SecretSealer::new(b"another egress secrets key, also 32 characters");
        assert!(other_key.open(acme, "SHOP_TOKEN", 2, &sealed).is_err());
    }

    #[test]
    fn a_placeholder_is_opaque_and_differs_by_sandbox_tenant_name_and_key() {
        let sealer = SecretSealer::new(KEY);
        let (acme, other) = (Uuid::new_v4(), Uuid::new_v4());
        let one = sealer.placeholder(acme, "sbx_1", "SHOP_TOKEN");
        assert!(one.starts_with("sgp_") && one.len() == 36, "{one}");
        assert_eq!(
            one,
            sealer.placeholder(acme, "sbx_1", "SHOP_TOKEN"),
            "stable"
        );
        for different in [
            sealer.placeholder(acme, "sbx_2", "SHOP_TOKEN"),
            sealer.placeholder(other, "sbx_1", "SHOP_TOKEN"),
            sealer.placeholder(acme, "sbx_1", "SHOP_KEY"),
            SecretSealer::new(b"another egress secrets key, also 32 characters").placeholder(
                acme,
                "sbx_1",
                "SHOP_TOKEN",
            ),
        ] {
            assert_ne!(one, different);
        }
    }

    #[test]
    fn the_deployment_secret_opens_no_tenant_secret() {
        // keys.secret and the egress secrets key are separate settings; even the same text in
        // both derives another key here than the signing seeds' and the snapshots'.
        let secret = b"the same text in both settings, 32 characters long";
        let tenant = Uuid::new_v4();
        let sealed = SecretSealer::new(secret).seal(tenant, "SHOP_TOKEN", 1, b"value");
        for purpose in ["signing-key seeds", "snapshot data keys v1"] {
            assert_ne!(
                crate::keys::derive_key(secret, purpose),
                crate::keys::derive_key(secret, SEAL_PURPOSE)
            );
        }
        let dev = SecretSealer::new(DEVELOPMENT_SECRETS_KEY.as_bytes());
        assert!(dev.open(tenant, "SHOP_TOKEN", 1, &sealed).is_err());
        let development_secret = SecretSealer::new(crate::config::DEVELOPMENT_SECRET.as_bytes());
        let dev_sealed = dev.seal(tenant, "SHOP_TOKEN", 1, b"value");
        assert!(
            development_secret
                .open(tenant, "SHOP_TOKEN", 1, &dev_sealed)
                .is_err(),
            "the development egress key is not the development keys.secret"
        );
    }

    #[test]
    fn names_headers_values_and_bindings_are_checked() {
        for good in ["SHOP_TOKEN", "A", "X_1"] {
            assert!(check_secret_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "shop_token",
            "1TOKEN",
            "_T",
            "SHOP-TOKEN",
            "PATH=X",
            &"A".repeat(65),
        ] {
            assert!(check_secret_name(bad).is_err(), "{bad:?}");
        }
        for reserved in [
            "PATH",
            "HOME",
            "LD_PRELOAD",
            "PYTHONPATH",
            "SSL_CERT_FILE",
            "LC_ALL",
        ] {
            assert!(
                matches!(
                    check_secret_name(reserved),
                    Err(SecretError::ReservedName(_))
                ),
                "{reserved}"
            );
        }
        assert_eq!(check_header_name("Authorization").unwrap(), "authorization");
        assert_eq!(check_header_name("X-Api-Key").unwrap(), "x-api-key");
        for bad in [
            "Host",
            "content-length",
            "Transfer-Encoding",
            "connection",
            "proxy-authorization",
            "bad header",
            "x:y",
            "",
        ] {
            assert!(check_header_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check_secret_value("tok\n").unwrap(), "tok");
        assert_eq!(check_secret_value("tok\r\n").unwrap(), "tok");
        for bad in ["", "\n", "a\nb", "a\rb", "a\0b", "tök"] {
            assert!(check_secret_value(bad).is_err(), "{bad:?}");
        }
        assert!(check_secret_value(&"a".repeat(MAX_VALUE_BYTES + 1)).is_err());
        let binding = SecretBinding::parse(
            &["API.shop.test".into(), "api.shop.test".into()],
            &["Authorization".into()],
        )
        .unwrap();
        assert_eq!(binding.hosts, ["api.shop.test"]);
        assert_eq!(binding.headers, ["authorization"]);
        assert!(matches!(
            SecretBinding::parse(&[], &["authorization".into()]),
            Err(SecretError::Unbound)
        ));
        assert!(SecretBinding::parse(&["127.0.0.1".into()], &["authorization".into()]).is_err());
    }
}
