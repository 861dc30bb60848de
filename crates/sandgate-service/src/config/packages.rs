//! `[packages]`: packages on demand (`pip install` in a sandbox; the index is `crate::packages`).

use std::path::PathBuf;

use serde::Deserialize;
use url::Url;

/// Packages on demand (`[packages]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PackagesConfig {
    /// Whether `pip install` in a sandbox may install anything.
    pub enabled: bool,
    /// The upstream simple index (PEP 503/691); empty: the one this machine's pip uses.
    pub index_url: String,
    /// A PEM bundle of extra CA certificates for the upstream (a corporate proxy), trusted
    /// besides the system's; empty: none.
    pub ca_bundle: String,
    /// Where wheels are cached (content-addressed, shared by every sandbox on this host); empty:
    /// `sandgate-packages` in the system's temporary directory.
    pub cache_dir: String,
    /// The largest wheel a sandbox may download, MiB.
    pub max_wheel_mb: u64,
    /// How long one request to the upstream index may take, seconds.
    pub fetch_timeout_seconds: u64,
}

impl PackagesConfig {
    /// The cache directory, defaulted.
    pub fn cache_dir(&self) -> PathBuf {
        if self.cache_dir.trim().is_empty() {
            std::env::temp_dir().join("sandgate-packages")
        } else {
            PathBuf::from(&self.cache_dir)
        }
    }

    /// Checks the values; the error names the key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if !self.index_url.trim().is_empty() {
            match Url::parse(self.index_url.trim()) {
                Ok(url) if matches!(url.scheme(), "http" | "https") => {}
                _ => {
                    return Err((
                        "packages.index_url".into(),
                        format!("{:?} is not an http(s) URL", self.index_url),
                    ));
                }
            }
        }
        if self.max_wheel_mb == 0 || self.fetch_timeout_seconds == 0 {
            return Err((
                "packages.max_wheel_mb".into(),
                "max_wheel_mb and fetch_timeout_seconds must be more than 0".into(),
            ));
        }
        Ok(())
    }
}
