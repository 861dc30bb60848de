//! Setting the package index up from the `[packages]` table (`crate::config::PackagesConfig`):
//! its errors, and the default upstream: the host pip's own.

use std::path::PathBuf;

use url::Url;

use crate::config::PackagesConfig;

/// Why the package index could not be set up (a configuration error; names the key).
#[derive(Debug, thiserror::Error)]
pub enum PackagesConfigError {
    /// The extra CA bundle is unreadable or not PEM.
    #[error("packages.ca_bundle: cannot use {path}: {message}")]
    CaBundle {
        /// The configured path.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The HTTP client could not be built.
    #[error("packages: cannot build the HTTP client for the upstream index: {0}")]
    Client(#[source] reqwest::Error),
    /// The cache directory cannot be created, narrowed to mode 0700 or read.
    #[error("packages.cache_dir: cannot use {} (it must be a directory this user owns or can create; it is kept at mode 0700): {source}", dir.display())]
    Cache {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The upstream index: `index_url`, else what this machine's pip uses (`PIP_INDEX_URL`, its
/// configuration files, else pip's built-in default read from pip itself), so that no index is
/// named in sandgate's own files. `Err` says why installs are off.
pub(super) fn upstream_index(config: &PackagesConfig) -> Result<Url, String> {
    let configured = config.index_url.trim();
    let text = if configured.is_empty() {
        host_pip_index()?
    } else {
        configured.to_owned()
    };
    let mut url = Url::parse(&text).map_err(|e| format!("the package index {text:?}: {e}"))?;
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

/// Asks this machine's pip which index it uses.
fn host_pip_index() -> Result<String, String> {
    if let Ok(url) = std::env::var("PIP_INDEX_URL")
        && !url.trim().is_empty()
    {
        return Ok(url.trim().to_owned());
    }
    // pip's own resolution of its configuration files, then its built-in default.
    let script = "from pip._internal.configuration import Configuration\n\
                  from pip._internal.models.index import PyPI\n\
                  c = Configuration(isolated=False)\n\
                  c.load()\n\
                  url = None\n\
                  for key in ('global.index-url', 'install.index-url', ':env:.index-url'):\n\
                  \x20   try:\n\
                  \x20       url = c.get_value(key)\n\
                  \x20       break\n\
                  \x20   except Exception:\n\
                  \x20       pass\n\
                  print(url or PyPI.simple_url)\n";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .output()
        .map_err(|e| {
            format!("no packages.index_url is configured and this machine's pip cannot be asked for its index (python3: {e}); set packages.index_url")
        })?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || text.is_empty() {
        return Err(format!(
            "no packages.index_url is configured and this machine's pip did not name its index ({}); set packages.index_url",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(text)
}
