//! `[egress]`: egress a tenant chooses (issue 29). For now the key tenants' secrets are sealed
//! under; nothing leaves a sandbox yet.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use validator::Validate;

use crate::egress::{DEVELOPMENT_SECRETS_KEY, SecretSealer};

/// Egress settings (`[egress]`).
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// The key tenants' egress secrets are sealed under (`sandgate admin tenant secret`): a key
    /// of its own, not `keys.secret`, so the egress component needs no other. Empty: the public
    /// development key on a loopback-only deployment, and no secrets at all on any other.
    pub secrets_key: SecretString,
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
        Ok(())
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
