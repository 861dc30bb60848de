//! The wheel cache: content-addressed files on this host (`<dir>/<sha256>.whl`), shared by every
//! sandbox. A wheel is written under a temporary name, its sha256 checked against the one the
//! index published, and only then renamed into place, so a file in the cache is always whole and
//! always the wheel its name says. Sandboxes never see this directory: the agent relays the bytes.

use std::path::{Path, PathBuf};

/// The cache directory.
#[derive(Debug)]
pub(super) struct WheelCache {
    dir: PathBuf,
}

impl WheelCache {
    /// Creates the directory if needed.
    pub(super) fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the wheel with this sha256 (lower-case hex) lives.
    pub(super) fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}.whl"))
    }

    /// A fresh temporary path for a download into the cache (same file system: rename is atomic).
    pub(super) fn temporary(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!(
            ".{sha256}.{}.partial",
            uuid::Uuid::new_v4().simple()
        ))
    }
}

/// Whether `s` is a sha256 in lower-case hex.
pub(super) fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
