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
    /// Where wheels are cached (content-addressed, shared by every sandbox on this host); empty:
    /// `sandgate-packages` in the system's temporary directory.
    pub cache_dir: String,
    /// The largest wheel a sandbox may download, MiB.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_wheel_mb: u64,
    /// How long one request to the upstream index may take, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
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
}

/// Empty (this machine's pip's index), or an http(s) URL.
fn an_http_url(index_url: &str) -> Result<(), ValidationError> {
    let url = index_url.trim();
    if !url.is_empty() && !Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https")) {
        return Err(problem(format!("{index_url:?} is not an http(s) URL")));
    }
    Ok(())
}
