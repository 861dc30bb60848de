//! The wheel cache: content-addressed files on this host (`<dir>/<sha256>.whl`), shared by every
//! sandbox, bounded in bytes. A wheel is written under a temporary name, its sha256 checked
//! against the one the index published, and only then renamed into place. Sandboxes never see
//! this directory: the agent relays the bytes.
//!
//! - **Bounded**: room for a download is reserved before it starts (the largest wheel it may
//!   be: its announced length, else the largest allowed), by evicting the wheels used least recently; files and reservations together never pass
//!   `packages.cache_max_mb`.
//! - **Only the service writes it**: the directory is created (or narrowed to) mode 0700.
//! - **Re-verified**: a hit is hashed again before it is handed out; a file whose bytes are not
//!   its name's sha256 is removed and downloaded again.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use lru::LruCache;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

/// The cache directory and what is in it.
#[derive(Debug)]
pub(super) struct WheelCache {
    dir: PathBuf,
    max_bytes: u64,
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    /// The cached wheels, sha256 → size, least recently used first out.
    wheels: LruCache<String, u64>,
    /// Bytes of the cached wheels.
    stored: u64,
    /// Bytes reserved for downloads under way.
    reserved: u64,
}

/// Room held for one download; given back when dropped (the wheel, once stored, is counted by
/// its real size instead).
#[derive(Debug)]
pub(super) struct Reservation {
    state: Arc<Mutex<State>>,
    bytes: u64,
}

/// No room can be made: every byte of the cache is reserved by downloads under way.
#[derive(Debug)]
pub(super) struct CacheBusy;

impl WheelCache {
    /// Creates the directory (mode 0700) if needed, narrows an existing one to 0700, removes
    /// partial downloads left by a previous process, and counts the wheels in it (oldest download
    /// first out), evicting down to `max_bytes`.
    pub(super) fn open(dir: &Path, max_bytes: u64) -> std::io::Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".partial") {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            let Some(sha256) = name.strip_suffix(".whl").filter(|s| is_sha256(s)) else {
                continue;
            };
            let meta = entry.metadata()?;
            found.push((meta.modified().ok(), sha256.to_owned(), meta.len()));
        }
        found.sort();
        let mut state = State {
            wheels: LruCache::unbounded(),
            stored: 0,
            reserved: 0,
        };
        for (_, sha256, size) in found {
            state.stored += size;
            state.wheels.put(sha256, size);
        }
        let cache = Self {
            dir: dir.to_path_buf(),
            max_bytes,
            state: Arc::new(Mutex::new(state)),
        };
        let victims = cache.evict_for(0);
        cache.remove(&victims);
        Ok(cache)
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The most the cache holds, bytes.
    pub(super) fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Where the wheel with this sha256 (lower-case hex) lives.
    fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}.whl"))
    }

    /// The size of the cached wheel with this sha256 (now its most recent use), if there is one.
    pub(super) fn size(&self, sha256: &str) -> Option<u64> {
        self.lock().wheels.get(sha256).copied()
    }

    /// The cached wheel, hashed again: its path when its bytes are still its sha256. A file that
    /// is gone or whose bytes changed is forgotten (and removed), so the caller downloads it.
    pub(super) async fn verified(&self, sha256: &str) -> Option<PathBuf> {
        self.size(sha256)?;
        let path = self.path(sha256);
        match hash_file(&path).await {
            Ok(got) if got == sha256 => Some(path),
            outcome => {
                tracing::warn!(
                    sha256,
                    ?outcome,
                    "a cached wheel is missing or no longer matches its sha256; it is fetched again"
                );
                self.forget(sha256);
                None
            }
        }
    }

    /// Reserves `bytes` for a download, evicting the least recently used wheels to make room.
    pub(super) fn reserve(&self, bytes: u64) -> Result<Reservation, CacheBusy> {
        if bytes > self.max_bytes {
            return Err(CacheBusy);
        }
        let victims = self.evict_for(bytes);
        let reserved = {
            let mut state = self.lock();
            if state.stored + state.reserved + bytes > self.max_bytes {
                Err(CacheBusy)
            } else {
                state.reserved += bytes;
                Ok(Reservation {
                    state: Arc::clone(&self.state),
                    bytes,
                })
            }
        };
        self.remove(&victims);
        reserved
    }

    /// A fresh temporary path for a download into the cache (same file system: rename is atomic).
    pub(super) fn temporary(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!(
            ".{sha256}.{}.partial",
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// Moves a checked download from `partial` into the cache under `sha256` (its `size` taking
    /// the place of `reservation`); the wheel's path.
    pub(super) async fn store(
        &self,
        reservation: Reservation,
        partial: &Path,
        sha256: &str,
        size: u64,
    ) -> std::io::Result<PathBuf> {
        let path = self.path(sha256);
        if let Err(err) = tokio::fs::rename(partial, &path).await {
            let _ = tokio::fs::remove_file(partial).await;
            return Err(err);
        }
        let mut state = self.lock();
        // Another call may have stored the same wheel meanwhile: counted once.
        if state.wheels.put(sha256.to_owned(), size).is_none() {
            state.stored += size;
        }
        drop(state);
        drop(reservation);
        Ok(path)
    }

    /// Takes the least recently used wheels out of the count until `bytes` more fit; their
    /// files are for [`Self::remove`].
    fn evict_for(&self, bytes: u64) -> Vec<String> {
        let mut state = self.lock();
        let mut victims = Vec::new();
        while state.stored + state.reserved + bytes > self.max_bytes {
            let Some((sha256, size)) = state.wheels.pop_lru() else {
                break;
            };
            state.stored -= size;
            victims.push(sha256);
        }
        victims
    }

    fn forget(&self, sha256: &str) {
        let mut state = self.lock();
        if let Some(size) = state.wheels.pop(sha256) {
            state.stored -= size;
        }
        drop(state);
        self.remove(&[sha256.to_owned()]);
    }

    fn remove(&self, victims: &[String]) {
        for sha256 in victims {
            match std::fs::remove_file(self.path(sha256)) {
                Ok(()) => tracing::debug!(sha256, "evicted a wheel from the cache"),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => tracing::warn!(%err, sha256, "cannot remove a wheel from the cache"),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.reserved -= self.bytes;
    }
}

/// The sha256 (lower-case hex) of a file's bytes, read in chunks.
async fn hash_file(path: &Path) -> std::io::Result<String> {
    let mut file = tokio::fs::File::open(path).await?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0; 1 << 16];
    loop {
        let n = file.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Whether `s` is a sha256 in lower-case hex.
pub(super) fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    async fn put(cache: &WheelCache, n: u8, size: u64) {
        let reservation = cache.reserve(size).expect("room");
        let partial = cache.temporary(&sha(n));
        std::fs::write(&partial, vec![0; size as usize]).unwrap();
        cache
            .store(reservation, &partial, &sha(n), size)
            .await
            .unwrap();
    }

    fn on_disk(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    #[tokio::test]
    async fn the_cache_stays_within_its_cap_and_evicts_the_least_recently_used() {
        let dir = std::env::temp_dir().join(format!("sgcache-{}", uuid::Uuid::new_v4().simple()));
        let cache = WheelCache::open(&dir, 300).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "only the service can write the cache");
        put(&cache, 1, 100).await;
        put(&cache, 2, 100).await;
        put(&cache, 3, 100).await;
        assert!(
            cache.size(&sha(1)).is_some(),
            "a use makes 1 the most recent"
        );
        put(&cache, 4, 100).await;
        assert!(cache.size(&sha(2)).is_none(), "2 was used least recently");
        assert!(cache.size(&sha(1)).is_some() && cache.size(&sha(4)).is_some());
        assert!(on_disk(&dir) <= 300, "files within the cap");
        let held = cache
            .reserve(300)
            .expect("everything can be evicted for it");
        assert!(
            cache.reserve(1).is_err(),
            "reservations count against the cap"
        );
        drop(held);
        assert!(cache.reserve(301).is_err(), "larger than the cache");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_hit_whose_bytes_changed_is_removed_not_served() {
        let dir = std::env::temp_dir().join(format!("sgcache-{}", uuid::Uuid::new_v4().simple()));
        let cache = WheelCache::open(&dir, 1 << 20).unwrap();
        let bytes = b"a wheel".to_vec();
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let reservation = cache.reserve(100).unwrap();
        let partial = cache.temporary(&sha256);
        std::fs::write(&partial, &bytes).unwrap();
        let path = cache
            .store(reservation, &partial, &sha256, bytes.len() as u64)
            .await
            .unwrap();
        assert_eq!(
            cache.verified(&sha256).await.as_deref(),
            Some(path.as_path())
        );
        std::fs::write(&path, b"tampered").unwrap();
        assert_eq!(cache.verified(&sha256).await, None, "not served");
        assert!(!path.exists(), "and removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
