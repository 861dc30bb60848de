//! Warm pools restored from a template (issue 26, docs/snapshots.md): for each profile whose
//! runtime can take snapshots here, a fresh sandbox (never lent, never ran a cell) is started,
//! left to import its data stack, and checkpointed; that snapshot is the profile's template. Pool
//! refills and cold starts of the profile restore it instead of starting Python, and fall back to
//! an ordinary start when a restore fails.
//!
//! A template is used only once verified (a clone answers `1+1` with pandas loaded) and only while
//! its image's digest (SHA-256 over its files, taken when it was made) is unchanged: it is checked
//! before every restore. It is rebuilt when its fingerprint (the image's id, the profile, the
//! agent) changes and once older than `max_age`, and replaced atomically: restores in flight keep
//! the one they started with (`Arc`). A build that fails is retried with a doubling backoff.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use sha2::{Digest as _, Sha256};
use tokio::sync::Notify;

use super::launcher::Launcher;
use super::pool::Pool;
use super::{Sandbox, SandboxError, SandboxManager};
use crate::channel::ExecOptions;
use crate::config::{SandboxProfile, TemplateConfig};
use crate::snapshot::Snapshot;
use crate::telemetry::{TemplateBuild, TemplateRestore, counters};

/// How long a template sandbox may take to import its data stack.
const PRELOAD_WAIT: Duration = Duration::from_secs(300);

/// The cell a clone of a new template must answer, and its answer, before the template is used.
const VERIFY_CELL: &str = "import sys\n(1 + 1, 'pandas' in sys.modules)";
const VERIFY_ANSWER: &str = "(2, True)";

/// Restores of a template that fail in a row before it is discarded (and rebuilt later).
const FAILURES_BEFORE_DISCARD: u32 = 3;

/// A profile's template: a verified snapshot of a fresh sandbox with its data stack imported.
#[derive(Debug)]
pub(super) struct Template {
    snapshot: Snapshot,
    /// SHA-256 over the image's files, taken when it was made.
    digest: [u8; 32],
    /// What it was made from (image id, profile, agent).
    fingerprint: String,
    made: Instant,
}

/// Why a template could not be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template sandbox did not start.
    #[error("starting the template sandbox failed")]
    Start(#[source] SandboxError),
    /// Asking the template sandbox whether its data stack is imported failed.
    #[error("asking the template sandbox whether its data stack is imported failed")]
    Preload(#[source] SandboxError),
    /// The template sandbox's data stack was not imported in time (or a cell had run).
    #[error(
        "the template sandbox did not import its data stack within {} s without running a cell \
         (import ended: {done}, modules loaded: {modules:?}, next cell number: {next_count:?})",
        PRELOAD_WAIT.as_secs()
    )]
    NotPreloaded {
        /// Whether the import ended.
        done: bool,
        /// The preloaded modules loaded.
        modules: Vec<String>,
        /// The next cell's number (1 in a sandbox that ran none).
        next_count: Option<u64>,
    },
    /// Checkpointing the template sandbox failed.
    #[error("checkpointing the template sandbox failed")]
    Checkpoint(#[source] SandboxError),
    /// The template's image could not be read to compute its digest.
    #[error("reading the template image {} failed", path.display())]
    Digest {
        /// The image's directory.
        path: PathBuf,
        /// The file system's error.
        #[source]
        source: io::Error,
    },
    /// The template's image is not what was taken: refused (and discarded).
    #[error(
        "the image of template {snapshot_id} changed since it was taken (its SHA-256 differs): \
         refused"
    )]
    Changed {
        /// The template's snapshot.
        snapshot_id: String,
    },
    /// Restoring a clone of the template failed.
    #[error("restoring a clone of the template failed")]
    Restore(#[source] SandboxError),
    /// The verification cell failed on a clone.
    #[error("the verification cell on a clone of the template failed")]
    Verify(#[source] SandboxError),
    /// A clone answered the verification cell wrongly.
    #[error(
        "a clone of the template answered {got:?} to `1 + 1` with pandas loaded, not {VERIFY_ANSWER}"
    )]
    WrongAnswer {
        /// What it answered (its value or error).
        got: String,
    },
    /// The manager stopped during the build.
    #[error("the sandbox manager stopped while the template was built")]
    Stopped,
}

/// An error with its causes, on one line (for the status and the log).
/// The start of the ids of this instance's templates (`snap_t<8 hex of the instance>_`): a
/// restarted process finds by it the images a killed one left on the tmpfs, and no other
/// instance's.
pub(super) fn template_prefix(instance: &str) -> String {
    let tag = hex::encode(&Sha256::digest(instance.as_bytes())[..4]);
    format!("snap_t{tag}_")
}

/// Deletes the template images of `instance` left in `images` (by a process that was killed
/// before it could delete them: they are plaintext, if never tenant data); returns how many.
/// One process per engine holds an instance's pools, so none of these is in use.
pub(super) fn sweep_templates(images: &Path, instance: &str) -> usize {
    let prefix = template_prefix(instance);
    let Ok(entries) = std::fs::read_dir(images) else {
        return 0;
    };
    let mut swept = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(&prefix) {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => swept += 1,
            Err(err) => {
                tracing::warn!(error = %err, image = %entry.path().display(), "deleting a leftover template image failed")
            }
        }
    }
    swept
}

fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// SHA-256 over the files under `dir`: each one's relative path, length and bytes, in path
/// order (symbolic links by their target).
fn digest_dir(dir: &Path) -> io::Result<[u8; 32]> {
    fn collect(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                collect(root, &entry.path(), out)?;
            } else {
                out.push(
                    entry
                        .path()
                        .strip_prefix(root)
                        .unwrap_or(&entry.path())
                        .to_owned(),
                );
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut hash = Sha256::new();
    for relative in files {
        let path = dir.join(&relative);
        hash.update(relative.as_os_str().as_encoded_bytes());
        hash.update([0]);
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            hash.update(std::fs::read_link(&path)?.as_os_str().as_encoded_bytes());
            continue;
        }
        hash.update(meta.len().to_le_bytes());
        io::copy(&mut std::fs::File::open(&path)?, &mut hash)?;
    }
    Ok(hash.finalize().into())
}

impl Template {
    /// Checks the image against the digest taken when it was made (on a blocking thread: tens of
    /// megabytes are read).
    async fn check(self: &Arc<Self>) -> Result<(), TemplateError> {
        let template = self.clone();
        let read = tokio::task::spawn_blocking(move || digest_dir(&template.snapshot.image.dir))
            .await
            .unwrap_or_else(|join| Err(io::Error::other(join)));
        match read {
            Ok(digest) if digest == self.digest => Ok(()),
            Ok(_) => Err(TemplateError::Changed {
                snapshot_id: self.snapshot.id.clone(),
            }),
            // A file gone or unreadable is a changed image too.
            Err(err) if err.kind() == io::ErrorKind::NotFound => Err(TemplateError::Changed {
                snapshot_id: self.snapshot.id.clone(),
            }),
            Err(source) => Err(TemplateError::Digest {
                path: self.snapshot.image.dir.clone(),
                source,
            }),
        }
    }
}

/// What a pool knows of its template, for `/readyz`, `/metrics` and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateStatus {
    /// Whether pools fill from templates at all (`TemplateConfig::enabled`).
    pub enabled: bool,
    /// Whether snapshots of the profile can be taken here: `Some(Ok)` yes, `Some(Err)` why not,
    /// `None` not checked yet.
    pub snapshots: Option<Result<(), String>>,
    /// The template in use, when there is one.
    pub template: Option<TemplateInfo>,
    /// Why the last build failed or the last template was discarded, until a template is in use.
    pub last_error: Option<String>,
}

/// The template a pool uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateInfo {
    /// Its snapshot's id (what [`Sandbox::restored_from`] says of its clones).
    pub snapshot_id: String,
    /// How long ago it was made.
    pub age: Duration,
    /// Its image's size.
    pub size_bytes: u64,
    /// Where its image is (on the engine's plaintext tmpfs).
    pub dir: PathBuf,
}

#[derive(Debug, Default)]
struct SlotState {
    snapshots: Option<Result<(), String>>,
    last_error: Option<String>,
    /// Builds (or uses) that failed in a row: the backoff's exponent.
    failures: u32,
    /// No build before this.
    retry_at: Option<Instant>,
    /// Restores of the current template that failed in a row.
    restore_failures: u32,
}

/// A pool's template, swapped atomically, and what is known about building it.
#[derive(Debug, Default)]
pub(super) struct TemplateSlot {
    current: ArcSwapOption<Template>,
    state: Mutex<SlotState>,
    /// Wakes the keeper early (a template was discarded).
    wake: Notify,
}

impl TemplateSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn current(&self) -> Option<Arc<Template>> {
        self.current.load_full()
    }

    /// Drops the template (at the manager's stop: its image goes once no restore holds it).
    pub(super) fn clear(&self) {
        self.current.store(None);
    }

    fn install(&self, template: Arc<Template>) {
        self.current.store(Some(template));
        let mut state = self.state();
        state.failures = 0;
        state.restore_failures = 0;
        state.retry_at = None;
        state.last_error = None;
    }

    /// Records a failure: the next build waits `retry` doubled per failure in a row.
    fn failed(&self, why: String, config: &TemplateConfig) {
        let mut state = self.state();
        let wait = config
            .retry
            .saturating_mul(1 << state.failures.min(16))
            .min(config.max_retry);
        state.failures += 1;
        state.retry_at = Some(Instant::now() + wait);
        state.last_error = Some(why);
    }

    /// Discards `template` if it is still the one in use (the pool starts afresh until another is
    /// built, after the backoff) and wakes the keeper.
    fn discard(&self, template: &Arc<Template>, why: String, config: &TemplateConfig) {
        let before = self.current.rcu(|current| match current {
            Some(c) if Arc::ptr_eq(c, template) => None,
            other => other.clone(),
        });
        if before.as_ref().is_some_and(|b| Arc::ptr_eq(b, template)) {
            self.failed(why, config);
            self.wake.notify_one();
        }
    }

    /// How long until the next build may start, if it must wait.
    fn retry_wait(&self) -> Option<Duration> {
        let at = self.state().retry_at?;
        at.checked_duration_since(Instant::now())
            .filter(|w| !w.is_zero())
    }

    /// Records the snapshot capability, logging it when it is new or changed (once at start).
    fn note_capability(&self, profile: &str, now: Result<(), String>) {
        let mut state = self.state();
        if state.snapshots.as_ref() == Some(&now) {
            return;
        }
        match &now {
            Ok(()) => tracing::info!(
                profile,
                "snapshots are available: the pool is filled from a template"
            ),
            Err(reason) => tracing::info!(
                profile,
                reason = %reason,
                "snapshots are not available for this profile: its pool keeps ordinary starts"
            ),
        }
        state.snapshots = Some(now);
    }

    /// The status, for `/readyz` and metrics.
    pub(super) fn status(&self, enabled: bool) -> TemplateStatus {
        let template = self.current().map(|t| TemplateInfo {
            snapshot_id: t.snapshot.id.clone(),
            age: t.made.elapsed(),
            size_bytes: t.snapshot.size_bytes(),
            dir: t.snapshot.image.dir.clone(),
        });
        let state = self.state();
        TemplateStatus {
            enabled,
            snapshots: state.snapshots.clone(),
            template,
            last_error: state.last_error.clone(),
        }
    }
}

/// A clone of `template`, once its image is checked.
async fn clone_of(launcher: &Launcher, template: &Arc<Template>) -> Result<Sandbox, TemplateError> {
    template.check().await?;
    launcher
        .restore(&template.snapshot, None)
        .await
        .map_err(TemplateError::Restore)
}

/// A start for `profile`'s pool (a refill or a cold start): a clone of its template when it has
/// one, else, or when that fails, an ordinary start. A template whose image changed is discarded;
/// so is one whose restores keep failing.
pub(super) async fn start_pooled(
    launcher: &Launcher,
    slot: &TemplateSlot,
    config: &TemplateConfig,
    profile: &SandboxProfile,
) -> Result<Sandbox, SandboxError> {
    if let Some(template) = slot.current() {
        match clone_of(launcher, &template).await {
            Ok(sandbox) => {
                counters().template_restore(TemplateRestore::restored);
                slot.state().restore_failures = 0;
                return Ok(sandbox);
            }
            Err(err) => {
                let why = chain(&err);
                tracing::warn!(error = %why, profile = %profile.name, "a restore of the pool's template failed; starting a sandbox afresh");
                let refused = matches!(err, TemplateError::Changed { .. });
                counters().template_restore(if refused {
                    TemplateRestore::refused
                } else {
                    TemplateRestore::failed
                });
                counters().template_fallbacks.inc();
                let failures = {
                    let mut state = slot.state();
                    state.restore_failures += 1;
                    state.restore_failures
                };
                if refused || failures >= FAILURES_BEFORE_DISCARD {
                    slot.discard(&template, why, config);
                }
            }
        }
    }
    launcher.launch(profile).await
}

impl SandboxManager {
    /// `profile`'s template as it stands (`None` for an unknown profile).
    pub fn template_status(&self, profile: &str) -> Option<TemplateStatus> {
        let pool = self.inner.pools.get(profile)?;
        Some(pool.template.status(self.inner.config.templates.enabled))
    }

    /// The start of every template id (and image directory name) of `instance`'s pools.
    pub fn template_id_prefix(instance: &str) -> String {
        template_prefix(instance)
    }

    /// Deletes the template images a killed process of this instance left on the engine's
    /// tmpfs. Called once at start, before any keeper builds a template.
    pub(super) fn sweep_leftover_templates(&self) {
        let Some(images) = self.inner.launcher.backend.snapshot_images_dir() else {
            return;
        };
        let swept = sweep_templates(&images, &self.inner.config.instance);
        if swept > 0 {
            tracing::info!(
                swept,
                "deleted template images a previous process of this instance left on the tmpfs"
            );
        }
    }

    /// Keeps `profile`'s template for as long as the manager lives: checks the capability, builds,
    /// checks and rebuilds it (see the module's documentation).
    pub(super) fn spawn_template_keeper(&self, profile: String) {
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        let slot = self.inner.pools[&profile].template.clone();
        self.inner.tasks.spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let wait = (SandboxManager { inner }).keep_template(&profile).await;
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = slot.wake.notified() => {}
                    () = stop.cancelled() => return,
                }
            }
        });
    }

    /// One round of the keeper; returns how long until the next.
    async fn keep_template(&self, name: &str) -> Duration {
        let pool = &self.inner.pools[name];
        let config = &self.inner.config.templates;
        let available = self
            .snapshots_available(name)
            .await
            .map_err(|err| chain(&err));
        let capable = available.is_ok();
        pool.template.note_capability(name, available);
        if !capable || !config.enabled || self.inner.stop.is_cancelled() {
            pool.template.clear();
            return config.check_interval;
        }
        let fingerprint = fingerprint(&self.inner.launcher, &pool.profile).await;
        if let Some(current) = pool.template.current() {
            let age = current.made.elapsed();
            if current.fingerprint == fingerprint && age < config.max_age {
                if let Err(err) = current.check().await {
                    tracing::warn!(error = %chain(&err), profile = name, "the pool's template was refused");
                    pool.template.discard(&current, chain(&err), config);
                } else {
                    return config.check_interval.min(config.max_age - age);
                }
            }
        }
        if let Some(wait) = pool.template.retry_wait() {
            return wait;
        }
        match self.build_template(pool, fingerprint).await {
            Ok(template) => {
                tracing::info!(
                    profile = name,
                    snapshot = %template.snapshot.id,
                    bytes = template.snapshot.size_bytes(),
                    "a new template is in use: the pool is filled by restoring it"
                );
                counters().template_build(TemplateBuild::built);
                pool.template.install(template);
                config.check_interval.min(config.max_age)
            }
            Err(err) => {
                let why = chain(&err);
                tracing::warn!(error = %why, profile = name, "building the pool's template failed; its pool keeps ordinary starts and tries again later");
                counters().template_build(TemplateBuild::failed);
                // A template of another image or profile, or past its age, goes with the failure.
                pool.template.clear();
                pool.template.failed(why, config);
                pool.template.retry_wait().unwrap_or(config.check_interval)
            }
        }
    }

    /// Starts a fresh sandbox of the pool's profile (never lent), waits for its data stack,
    /// checkpoints it and verifies a clone.
    async fn build_template(
        &self,
        pool: &Pool,
        fingerprint: String,
    ) -> Result<Arc<Template>, TemplateError> {
        let launcher = &self.inner.launcher;
        let started = {
            let _permit = pool
                .gate
                .acquire(&pool.profile.name, || pool.state().demand.start_limit())
                .await;
            launcher
                .launch(&pool.profile)
                .await
                .map_err(TemplateError::Start)?
        };
        let taken = self.checkpoint_template(&started).await;
        // Stopped by its checkpoint, or still running when that failed: it goes either way.
        if let Err(err) = started.close().await {
            tracing::warn!(error = %err, "removing the template sandbox failed");
        }
        let snapshot = taken?;
        let dir = snapshot.image.dir.clone();
        let digest = tokio::task::spawn_blocking(move || digest_dir(&dir))
            .await
            .unwrap_or_else(|join| Err(io::Error::other(join)))
            .map_err(|source| TemplateError::Digest {
                path: snapshot.image.dir.clone(),
                source,
            })?;
        let template = Arc::new(Template {
            snapshot,
            digest,
            fingerprint,
            made: Instant::now(),
        });
        self.verify(&template).await?;
        Ok(template)
    }

    /// Waits until `sandbox` has imported its data stack without running a cell, then
    /// checkpoints it (stopping it).
    async fn checkpoint_template(&self, sandbox: &Sandbox) -> Result<Snapshot, TemplateError> {
        let info = sandbox
            .channel()
            .preloaded(PRELOAD_WAIT)
            .await
            .map_err(|e| TemplateError::Preload(SandboxError::Channel(e)))?;
        if !info.done || info.next_count != Some(1) || !info.modules.iter().any(|m| m == "pandas") {
            return Err(TemplateError::NotPreloaded {
                done: info.done,
                modules: info.modules,
                next_count: info.next_count,
            });
        }
        if self.inner.stop.is_cancelled() {
            return Err(TemplateError::Stopped);
        }
        let id = format!(
            "{}{}",
            template_prefix(&self.inner.config.instance),
            uuid::Uuid::now_v7().simple()
        );
        self.checkpoint_as(sandbox, &id, false)
            .await
            .map_err(TemplateError::Checkpoint)
    }

    /// Restores one clone of `template` and checks that it answers `1 + 1` with pandas loaded.
    async fn verify(&self, template: &Arc<Template>) -> Result<(), TemplateError> {
        let clone = clone_of(&self.inner.launcher, template).await?;
        let answered = clone.exec(VERIFY_CELL, ExecOptions::default(), None).await;
        if let Err(err) = clone.close().await {
            tracing::warn!(error = %err, "removing the template's verification clone failed");
        }
        let outcome = answered.map_err(TemplateError::Verify)?;
        let got = outcome
            .result
            .as_ref()
            .and_then(|bundle| bundle.get("text/plain").cloned())
            .or_else(|| {
                outcome
                    .error
                    .as_ref()
                    .map(|e| format!("{}: {}", e.name, e.value))
            })
            .unwrap_or_default();
        if got != VERIFY_ANSWER || outcome.execution_count != Some(1) {
            return Err(TemplateError::WrongAnswer {
                got: format!("{got} (cell number {:?})", outcome.execution_count),
            });
        }
        Ok(())
    }
}

/// What a template is made from: the image's id (its name when the engine cannot say), the
/// profile and the embedded agent, hashed.
async fn fingerprint(launcher: &Launcher, profile: &SandboxProfile) -> String {
    let image = launcher
        .backend
        .image_id(&profile.image)
        .await
        .unwrap_or_else(|| format!("named {}", profile.image));
    let made_of = format!(
        "{profile:?}\n{image}\n{}",
        crate::docker::agent_fingerprint()
    );
    hex::encode(Sha256::digest(made_of.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_covers_every_file_and_its_name() {
        let dir = std::env::temp_dir().join(format!("sandgate-digest-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a"), b"one").unwrap();
        std::fs::write(dir.join("sub/b"), b"two").unwrap();
        let before = digest_dir(&dir).unwrap();
        assert_eq!(
            before,
            digest_dir(&dir).unwrap(),
            "the same files, the same digest"
        );
        std::fs::write(dir.join("sub/b"), b"twO").unwrap();
        let changed = digest_dir(&dir).unwrap();
        assert_ne!(before, changed, "a changed byte changes it");
        std::fs::rename(dir.join("sub/b"), dir.join("sub/c")).unwrap();
        assert_ne!(
            changed,
            digest_dir(&dir).unwrap(),
            "a renamed file changes it"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_backoff_doubles_up_to_its_ceiling() {
        let config = TemplateConfig {
            retry: Duration::from_secs(10),
            max_retry: Duration::from_secs(35),
            ..TemplateConfig::default()
        };
        let slot = TemplateSlot::default();
        let mut waits = Vec::new();
        for _ in 0..4 {
            slot.failed("no".into(), &config);
            waits.push(slot.retry_wait().unwrap().as_secs_f64().round() as u64);
        }
        assert_eq!(waits, [10, 20, 35, 35]);
        assert_eq!(slot.status(true).last_error.as_deref(), Some("no"));
    }
}
