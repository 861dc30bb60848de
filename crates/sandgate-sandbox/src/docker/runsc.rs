//! Checkpoint and restore by runsc itself, past Docker's checkpoint API and containerd's copies
//! (docs/snapshots.md, "Restoring without Docker's copies"): where the engine's checkpointing
//! runtime is `scripts/sandgate-runsc` (stack.sh registers it as `runsc2024`), which restores a
//! container whose environment names an image directory under its images directory.
//!
//! - Checkpoint: the manager runs that runtime itself, with the engine's arguments and runsc's
//!   state root for the container (`--root`, read from the container's sandbox process), as
//!   `checkpoint --image-path=<plain>/sandgate/images/<name> --compression=none`: the image is
//!   written where it stays, uncompressed (nothing to inflate on a restore).
//! - Restore: an ordinary create (today's container configuration plus
//!   [`RESTORE_ENV`]`=<image dir>`), attach and start; the runtime's `create` becomes
//!   `runsc restore --detach --image-path=<dir>` and its `start` a no-op. The restored processes
//!   keep the template's environment: the variable is only in the container's OCI bundle.

use crate::faults::SnapshotStep;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bollard::query_parameters::{InspectContainerOptions, StartContainerOptions};

use super::DockerBackend;
use super::snapshot::{SnapshotSettings, files, link_tree, remove_tree, tree_size};
use crate::backend::{LaunchSpec, Launched, SandboxBackend};
use crate::snapshot::{SnapshotError, SnapshotImage};

/// The environment variable that asks `sandgate-runsc` to restore a container from an image.
pub const RESTORE_ENV: &str = "SANDGATE_RESTORE_FROM";

/// The file name of the wrapper, as registered in the engine's `daemon.json`.
const WRAPPER_NAME: &str = "sandgate-runsc";

/// How long runsc's checkpoint may take.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(120);

/// The engine's checkpointing runtime when it is `sandgate-runsc` restoring from this manager's
/// images directory: its path and the arguments the engine gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Wrapper {
    path: PathBuf,
    args: Vec<String>,
}

impl Wrapper {
    /// The wrapper, if `path` and `args` (a runtime of `docker info`) are it, set up to restore
    /// from `images`.
    pub(super) fn recognise(path: &str, args: &[String], images: &Path) -> Option<Self> {
        let path = PathBuf::from(path);
        let ours = format!("--sandgate-images={}", images.display());
        (path.file_name().is_some_and(|n| n == WRAPPER_NAME)
            && path.is_absolute()
            && args.contains(&ours))
        .then(|| Self {
            path,
            args: args.to_vec(),
        })
    }
}

/// Whether `name` is a name the wrapper accepts for an image directory.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// runsc's `--root` in the command line of process `pid` (the container's sandbox).
fn root_of(pid: i64) -> Option<PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0).map(String::from_utf8_lossy);
    while let Some(arg) = args.next() {
        let value = match arg.strip_prefix("--root=") {
            Some(v) => v.to_owned(),
            None if arg == "--root" => args.next()?.into_owned(),
            None => continue,
        };
        let root = PathBuf::from(value);
        return (root.is_absolute() && root.is_dir()).then_some(root);
    }
    None
}

impl DockerBackend {
    /// runsc's state root for a running container (where the engine's shim keeps it).
    async fn runsc_root(&self, container_id: &str) -> Result<PathBuf, SnapshotError> {
        let refuse = |reason: &str| SnapshotError::NotCheckpointable {
            container_id: container_id.to_owned(),
            reason: reason.to_owned(),
        };
        let details = self
            .docker
            .inspect_container(container_id, None::<InspectContainerOptions>)
            .await
            .map_err(|e| refuse(&e.to_string()))?;
        let pid = details
            .state
            .and_then(|s| s.pid)
            .filter(|pid| *pid > 0)
            .ok_or_else(|| refuse("it has no process"))?;
        root_of(pid).ok_or_else(|| {
            refuse("its sandbox process names no runsc state root (is it not a runsc container?)")
        })
    }

    /// Checkpoints by running the wrapper's `checkpoint` into the images directory.
    pub(super) async fn checkpoint_direct(
        &self,
        wrapper: &Wrapper,
        settings: &SnapshotSettings,
        container_id: &str,
        name: &str,
        leave_running: bool,
    ) -> Result<SnapshotImage, SnapshotError> {
        if !plain_name(name) {
            return Err(SnapshotError::NotCheckpointable {
                container_id: container_id.to_owned(),
                reason: format!("{name:?} is not a plain name for its image"),
            });
        }
        let root = self.runsc_root(container_id).await?;
        let images = settings.images();
        std::fs::create_dir_all(&images).map_err(files("creating", &images))?;
        let dir = images.join(name);
        std::fs::create_dir(&dir).map_err(files("creating", &dir))?;
        let taken = async {
            self.fault_at(SnapshotStep::CheckpointLinked)?;
            self.run_checkpoint(wrapper, &root, &dir, container_id, leave_running)
                .await?;
            self.fault_at(SnapshotStep::CheckpointTaken)?;
            if !leave_running {
                self.wait_stopped(container_id).await?;
            }
            self.fault_at(SnapshotStep::CheckpointMoved)?;
            let size_bytes = tree_size(&dir).map_err(files("measuring", &dir))?;
            Ok(SnapshotImage {
                dir: dir.clone(),
                size_bytes,
                name: name.to_owned(),
                agent: super::agent_fingerprint(),
            })
        };
        let result = taken.await;
        if result.is_err() {
            let _ = remove_tree(&dir);
        }
        result
    }

    async fn run_checkpoint(
        &self,
        wrapper: &Wrapper,
        root: &Path,
        dir: &Path,
        container_id: &str,
        leave_running: bool,
    ) -> Result<(), SnapshotError> {
        let mut command = tokio::process::Command::new(&wrapper.path);
        command
            .args(&wrapper.args)
            .arg("--root")
            .arg(root)
            .arg("checkpoint")
            .arg(format!("--image-path={}", dir.display()))
            .arg("--compression=none");
        if leave_running {
            command.arg("--leave-running");
        }
        command.arg(container_id).kill_on_drop(true);
        let failed = |message: String| SnapshotError::Runsc {
            container_id: container_id.to_owned(),
            message,
        };
        let output = tokio::time::timeout(CHECKPOINT_WAIT, command.output())
            .await
            .map_err(|_| failed(format!("no answer within {CHECKPOINT_WAIT:?}")))?
            .map_err(|e| failed(format!("running {}: {e}", wrapper.path.display())))?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(failed(format!(
            "{}: {}",
            output.status,
            stderr.trim().chars().take(1000).collect::<String>()
        )))
    }

    /// Restores by an ordinary create and start of a container that names the image; an image
    /// outside the images directory is linked into it for the restore.
    pub(super) async fn restore_direct(
        &self,
        settings: &SnapshotSettings,
        spec: &LaunchSpec,
        image: &SnapshotImage,
    ) -> Result<Launched, SnapshotError> {
        let images = settings.images();
        let in_place = image.dir.parent() == Some(images.as_path())
            && image
                .dir
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(plain_name);
        let placed = if in_place {
            None
        } else {
            let name: String = spec
                .sandbox_id
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            let dir = images.join(format!("{name}-restore"));
            link_tree(&image.dir, &dir).map_err(files("placing", &dir))?;
            Some(dir)
        };
        let from = placed.as_ref().unwrap_or(&image.dir);
        let result = self.create_and_start_restored(spec, from).await;
        if let Some(dir) = &placed {
            let _ = remove_tree(dir);
        }
        result
    }

    async fn create_and_start_restored(
        &self,
        spec: &LaunchSpec,
        from: &Path,
    ) -> Result<Launched, SnapshotError> {
        let env = format!("{RESTORE_ENV}={}", from.display());
        let created = self
            .create_and_attach(spec, &[env])
            .await
            .map_err(SnapshotError::Prepare)?;
        let started = async {
            // The image is named in the container's configuration: created is placed.
            self.fault_at(SnapshotStep::RestoreCreated)?;
            self.fault_at(SnapshotStep::RestorePlaced)?;
            self.docker
                .start_container(&created.container_id, None::<StartContainerOptions>)
                .await
                .map_err(|err| SnapshotError::Restore {
                    container_id: created.container_id.clone(),
                    status: match &err {
                        bollard::errors::Error::DockerResponseServerError {
                            status_code, ..
                        } => *status_code,
                        _ => 0,
                    },
                    message: err.to_string().chars().take(1000).collect(),
                })?;
            self.fault_at(SnapshotStep::RestoreStarted)
        };
        match started.await {
            Ok(()) => Ok(created),
            Err(err) => {
                if let Err(cleanup) = self.remove(&created.container_id).await {
                    tracing::warn!(error = %cleanup, "removing a container that failed to restore failed");
                }
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wrapper_is_recognised_only_restoring_from_our_images() {
        let images = Path::new("/c/docker/plain/sandgate/images");
        let args = vec![
            "--sandgate-runsc=/c/runsc".to_owned(),
            "--sandgate-images=/c/docker/plain/sandgate/images".to_owned(),
            "--network=none".to_owned(),
        ];
        assert!(Wrapper::recognise("/c/gvisor/sandgate-runsc", &args, images).is_some());
        assert!(Wrapper::recognise("/c/gvisor/runsc", &args, images).is_none());
        assert!(Wrapper::recognise("sandgate-runsc", &args, images).is_none());
        let other = Path::new("/c/docker2/plain/sandgate/images");
        assert!(Wrapper::recognise("/c/gvisor/sandgate-runsc", &args, other).is_none());
    }

    #[test]
    fn image_names_are_plain() {
        assert!(plain_name("snap_0193abc-1"));
        assert!(!plain_name(""));
        assert!(!plain_name(".."));
        assert!(!plain_name("a/b"));
        assert!(!plain_name("a b"));
    }
}
