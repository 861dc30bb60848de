//! `[packages]`: packages on demand (`pip install` in a sandbox; the index is `crate::packages`).

use std::path::PathBuf;

use serde::Deserialize;
use url::Url;
use validator::{Validate, ValidationError};

use super::validation::problem;

/// Packages on demand (`[packages]`).
#[derive(Debug, Clone, Deserialize, PartialEq, Validate)]
#[serde(deny_unknown_fields)]
pub struct PackagesConfig {
    /// Whether `pip install` in a sandbox may install anything.
    pub enabled: bool,
    /// The upstream simple index (PEP 503/691); empty: the one this machine's pip uses.
    #[validate(custom(function = an_http_url))]
    pub index_url: String,
    /// A PEM bundle of extra CA certificates for the upstream (a corporate proxy), trusted
    /// besides the system's; empty: none.
    pub ca_bundle: String,
    /// Where wheels are cached (content-addressed, shared by every sandbox on this host; created
    /// mode 0700); empty: `sandgate/packages` in this user's cache directory.
    pub cache_dir: String,
    /// The most the cache holds, MiB: the wheels used least recently are evicted to stay within.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub cache_max_mb: u64,
    /// The largest wheel a sandbox may download, MiB (at most `cache_max_mb`).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_wheel_mb: u64,
    /// What one tenant's sandboxes may download from the upstream index per hour, MiB (wheels
    /// already in the cache cost nothing).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub tenant_download_mb_per_hour: u64,
    /// How long one request to the upstream index may take, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub fetch_timeout_seconds: u64,
}

impl PackagesConfig {
    /// The cache directory, defaulted: systemd's `CACHE_DIRECTORY`, else `$XDG_CACHE_HOME`, else
    /// `~/.cache`, with `sandgate/packages` under the last two; never a shared temporary
    /// directory, where another local user could create it first.
    pub fn cache_dir(&self) -> PathBuf {
        let configured = self.cache_dir.trim();
        if !configured.is_empty() {
            return PathBuf::from(configured);
        }
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
        };
        if let Some(systemd) = var("CACHE_DIRECTORY") {
            // systemd may list several, colon-separated: the first.
            let first = systemd
                .to_string_lossy()
                .split(':')
                .next()
                .map(PathBuf::from);
            return first.unwrap_or(systemd).join("packages");
        }
        var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|home| home.join(".cache")))
            .unwrap_or_else(|| PathBuf::from("/var/cache"))
            .join("sandgate")
            .join("packages")
    }

    /// The check between fields; `Err((key, message))` names the key.
    pub fn check_together(&self) -> Result<(), (String, String)> {
        if self.max_wheel_mb > self.cache_max_mb {
            return Err((
                "packages.max_wheel_mb".into(),
                format!(
                    "must be at most packages.cache_max_mb ({}): a wheel must fit in the cache",
                    self.cache_max_mb
                ),
            ));
        }
        Ok(())
    }
}

/// Empty (this machine's pip's index), or an http(s) URL.
fn an_http_url(index_url: &str) -> Result<(), ValidationError> {
    let url = index_url.trim();
    if !url.is_empty() && !Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https")) {
        return Err(problem(format!("{index_url:?} is not an http(s) URL")));
    }
    Ok(())
}
