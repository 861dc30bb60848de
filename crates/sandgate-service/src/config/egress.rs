//! `[egress]`: egress a tenant chooses (issue 29): the key tenants' secrets are sealed under, the
//! dial timeout, and the tests' host overrides.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use validator::Validate;

use crate::egress::target::{TargetCheck, TestOverrides};
use crate::egress::{DEVELOPMENT_SECRETS_KEY, SecretSealer};

/// Egress settings (`[egress]`).
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// The key tenants' egress secrets are sealed under (`sandgate admin tenant secret`): a key
    /// of its own, not `keys.secret`, so the egress component needs no other. Empty: the public
    /// development key on a loopback-only deployment, and no secrets at all on any other.
    pub secrets_key: SecretString,
    /// How long the egress component waits for a server to accept a connection, in seconds.
    #[validate(range(min = 1, max = 300))]
    pub connect_timeout_seconds: u64,
    /// Tests only: `name=127.0.0.1:port` pairs, comma-separated. Each name resolves to that
    /// loopback address (never through the system's resolver), and that address is reachable
    /// although loopback is refused otherwise. `name=address` (no port) only resolves, to test
    /// the address checks: nothing but the listed loopback servers is ever dialed. A name listed
    /// twice resolves to both. Refused at start unless the deployment is
    /// loopback-only; empty (the default) in every real deployment.
    pub test_hosts: String,
    /// Tests only: a PEM file of CA certificates the egress component trusts, besides the
    /// system's trust store, when it re-originates TLS to an intercepted host (the tests' HTTPS
    /// servers on loopback). Refused at start unless the deployment is loopback-only; empty (the
    /// default) in every real deployment.
    pub test_ca_file: String,
}

impl EgressConfig {
    /// Checks the key (by hand, like `keys.secret`: the validator's errors carry the value they
    /// refused); `loopback` is whether only this host can reach the deployment
    /// ([`super::Config::only_loopback`], the rule `keys.secret`'s development value follows).
    /// `Err((key, message))` names the key.
    pub fn check_secrets_key(&self, loopback: bool) -> Result<(), (String, String)> {
        let key = self.secrets_key.expose_secret();
        let invalid = |message: &str| Err(("egress.secrets_key".to_owned(), message.to_owned()));
        if key == DEVELOPMENT_SECRETS_KEY && !loopback {
            return invalid(
                "is the public development key, accepted only when the public URL and the \
                 listen address are both loopback. Set SANDGATE_EGRESS__SECRETS_KEY to at least \
                 32 random characters of its own (e.g. `openssl rand -base64 48`), the same on \
                 every replica, or leave it empty to keep tenant secrets off",
            );
        }
        if !key.is_empty() && key.len() < 32 {
            return invalid(
                "must be empty or at least 32 characters (e.g. `openssl rand -base64 48`)",
            );
        }
        if !self.test_hosts.trim().is_empty() {
            self.target_check(loopback)
                .map_err(|message| ("egress.test_hosts".to_owned(), message))?;
        }
        if !self.test_ca_file.trim().is_empty() {
            self.test_ca_pem(loopback)
                .map_err(|message| ("egress.test_ca_file".to_owned(), message))?;
        }
        Ok(())
    }

    /// The tests' CA certificates (`test_ca_file`), refused unless `loopback`; `None` when unset.
    pub fn test_ca_pem(&self, loopback: bool) -> Result<Option<String>, String> {
        let path = self.test_ca_file.trim();
        if path.is_empty() {
            return Ok(None);
        }
        if !loopback {
            return Err(
                "is for tests only: a CA the egress component trusts besides the system's, \
                 accepted only when the public URL and the listen address are both loopback; \
                 leave it empty"
                    .to_owned(),
            );
        }
        std::fs::read_to_string(path)
            .map(Some)
            .map_err(|e| format!("{path} cannot be read: {e}"))
    }

    /// The TLS client configuration of intercepted connections' servers: the system's trust
    /// store and, on loopback in tests, `test_ca_file`.
    pub fn upstream_tls(
        &self,
        loopback: bool,
    ) -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
        let test_ca = self.test_ca_pem(loopback)?;
        crate::egress::upstream_config(test_ca.as_deref())
    }

    /// The target check egress connections go through: the system's resolver, or with
    /// `test_hosts` the tests' overrides (refused unless `loopback`). `Err` says what is wrong
    /// with `test_hosts`.
    pub fn target_check(&self, loopback: bool) -> Result<TargetCheck, String> {
        let hosts = self.test_hosts.trim();
        if hosts.is_empty() {
            return Ok(TargetCheck::system());
        }
        let mut overrides = TestOverrides::new(loopback).map_err(|e| e.to_string())?;
        // A name may be listed more than once (it resolves to every address given); a pair
        // without a port only resolves (to test the address checks), it is never dialed.
        let mut names: Vec<(String, Vec<std::net::IpAddr>)> = Vec::new();
        for pair in hosts.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, addr) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not name=127.0.0.1:port (or name=address)"))?;
            let (name, addr) = (name.trim(), addr.trim());
            let ip = if let Ok(server) = addr.parse::<std::net::SocketAddr>() {
                overrides = overrides.reach(server).map_err(|e| e.to_string())?;
                server.ip()
            } else {
                addr.parse::<std::net::IpAddr>()
                    .map_err(|_| format!("{addr:?} is not an address (and port)"))?
            };
            match names.iter_mut().find(|(n, _)| n == name) {
                Some((_, ips)) => ips.push(ip),
                None => names.push((name.to_owned(), vec![ip])),
            }
        }
        for (name, ips) in &names {
            overrides = overrides.resolve(name, ips);
        }
        Ok(TargetCheck::test(overrides))
    }

    /// The sealer of tenants' secrets: under the configured key, else under the development key
    /// when `loopback`; `None` when the key is empty off loopback (secrets cannot be set).
    pub fn sealer(&self, loopback: bool) -> Option<SecretSealer> {
        match self.secrets_key.expose_secret() {
            "" if loopback => Some(SecretSealer::new(DEVELOPMENT_SECRETS_KEY.as_bytes())),
            "" => None,
            key => Some(SecretSealer::new(key.as_bytes())),
        }
    }
}
