//! Checkpoint and restore: the route is chosen per engine ([`Route`]): runsc driven directly where
//! the engine's runtime is `sandgate-runsc` (super::runsc), else Docker's experimental
//! checkpoint API (docs/snapshots.md, "What
//! the sandbox manager needs to do"): gVisor's runsc of 2024 as the runtime, images only on a
//! tmpfs, the restore's start sent as one raw request (bollard cannot say `start?checkpoint=`).
//!
//! Layout on the plaintext tmpfs `plain` (the engine's own, stack.sh: `$TMPDIR` is `plain/tmp`):
//! - `plain/sandgate/links/<container id>/`: where `<data root>/containers/<id>/checkpoints`
//!   points, so that the engine writes and reads checkpoint images there, never on its disk;
//! - `plain/sandgate/images/<snapshot id>/`: a taken image, moved out of the engine's reach.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bollard::container::CreateCheckpointOptions;
use bollard::query_parameters::{InspectContainerOptions, WaitContainerOptionsBuilder};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::DockerBackend;
use super::runsc::Wrapper;
use crate::backend::{LaunchSpec, Launched, SandboxBackend};
use crate::faults::SnapshotStep;
use crate::snapshot::{SnapshotError, SnapshotImage, SnapshotUnavailable};

/// The runtimes that can checkpoint sandboxes on these hosts (runc needs a CRIU they lack).
pub const CHECKPOINT_RUNTIMES: &[&str] = &["runsc2024"];

/// The file each restore's copy of an image gets, naming the new container: containerd keys a
/// checkpoint by its digest, and identical images restored at once would collide.
const CLONE_MARK: &str = "sandgate-clone";

/// How long a stopping checkpoint may take to show the container stopped.
const STOP_WAIT: Duration = Duration::from_secs(30);
/// How long the restore's start may take.
const RESTORE_WAIT: Duration = Duration::from_secs(120);
/// containerd's restore copies older than this are swept even without our mark.
const STALE_COPY: Duration = Duration::from_secs(600);

/// How an engine takes and restores snapshots of a runtime.
#[derive(Debug)]
pub(super) enum Route {
    /// runsc driven directly through `sandgate-runsc` (super::runsc).
    Direct(Wrapper),
    /// Docker's checkpoint API, with images placed in the engine's data root.
    Engine {
        /// `DockerRootDir`.
        data_root: PathBuf,
    },
}

/// Where a Docker engine's snapshots go (see [`DockerBackend::with_snapshots`]).
#[derive(Debug, Clone)]
pub(super) struct SnapshotSettings {
    /// The engine's plaintext tmpfs.
    pub(super) plain: PathBuf,
}

pub(super) fn files(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SnapshotError {
    let path = path.to_owned();
    move |source| SnapshotError::Files { what, path, source }
}

/// Copies directory `from` to `to` by hard links (same tmpfs: no data is copied).
pub(super) fn link_tree(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path())?, &target)?;
        } else {
            std::fs::hard_link(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// The bytes of the files under `dir`.
pub(super) fn tree_size(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            tree_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// Whether a file named [`CLONE_MARK`] holding `mark` is at most three levels under `dir`.
fn holds_mark(dir: &Path, mark: &str, depth: u32) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let path = entry.path();
        if entry.file_name() == CLONE_MARK {
            return std::fs::read_to_string(&path).is_ok_and(|m| m == mark);
        }
        depth > 0 && path.is_dir() && holds_mark(&path, mark, depth - 1)
    })
}

/// Removes a directory tree, succeeding when it is absent.
pub(super) fn remove_tree(path: &Path) -> Result<(), SnapshotError> {
    match std::fs::remove_dir_all(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(files("removing", path)(err)),
        _ => Ok(()),
    }
}

impl SnapshotSettings {
    fn links(&self, container_id: &str) -> PathBuf {
        self.plain.join("sandgate/links").join(container_id)
    }

    pub(super) fn images(&self) -> PathBuf {
        self.plain.join("sandgate/images")
    }

    /// Makes the container's checkpoint directory in the data root a link into the tmpfs (Docker
    /// made it, empty, or not yet); returns the tmpfs side.
    fn link_checkpoints(
        &self,
        data_root: &Path,
        container_id: &str,
    ) -> Result<PathBuf, SnapshotError> {
        let link = data_root
            .join("containers")
            .join(container_id)
            .join("checkpoints");
        let target = self.links(container_id);
        std::fs::create_dir_all(&target).map_err(files("creating", &target))?;
        if std::fs::read_link(&link).is_ok_and(|to| to == target) {
            return Ok(target);
        }
        match std::fs::symlink_metadata(&link) {
            // Docker's own (empty: nothing was checkpointed into it), or a stale link.
            Ok(meta) if meta.is_dir() => {
                std::fs::remove_dir(&link).map_err(files("emptying", &link))?
            }
            Ok(_) => std::fs::remove_file(&link).map_err(files("replacing", &link))?,
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&target, &link).map_err(files("linking", &link))?;
        Ok(target)
    }

    /// Removes containerd's copies of this restore's image in the engine's TMPDIR (it leaves one
    /// per restore, containerd/containerd#10166), and any restore copy older than
    /// [`STALE_COPY`].
    fn sweep_engine_copies(&self, container_id: &str) {
        let tmp = self.plain.join("tmp");
        let Ok(entries) = std::fs::read_dir(&tmp) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("ctrd-checkpoint") && !name.starts_with("ctd-checkpoint") {
                continue;
            }
            let stale = name.starts_with("ctrd-checkpoint")
                && entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|at| at.elapsed().is_ok_and(|age| age > STALE_COPY));
            if (stale || holds_mark(&entry.path(), container_id, 3))
                && let Err(err) = remove_tree(&entry.path())
            {
                tracing::warn!(error = %err, "removing containerd's copy of a checkpoint failed");
            }
        }
    }
}

impl DockerBackend {
    fn settings(&self) -> Result<&SnapshotSettings, SnapshotUnavailable> {
        let settings = self
            .snapshots
            .as_ref()
            .ok_or(SnapshotUnavailable::NoPlainDir)?;
        match crate::snapshot::fs_type(&settings.plain) {
            Some(kind) if kind == "tmpfs" => Ok(settings),
            other => Err(SnapshotUnavailable::PlainDirNotTmpfs {
                path: settings.plain.clone(),
                fs_type: other.unwrap_or_else(|| {
                    if settings.plain.exists() {
                        "an unknown file system".into()
                    } else {
                        "nothing (it does not exist)".into()
                    }
                }),
            }),
        }
    }

    /// The engine's Unix socket, for the one request bollard cannot make.
    fn socket(&self) -> Result<String, SnapshotUnavailable> {
        let host = if self.host.is_empty() {
            std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into())
        } else {
            self.host.clone()
        };
        match host.strip_prefix("unix://") {
            Some(path) => Ok(path.to_owned()),
            None if host.starts_with('/') => Ok(host),
            None => Err(SnapshotUnavailable::NotLocal { host }),
        }
    }

    /// Checks what a snapshot of `runtime` needs; returns the route it takes on this engine.
    pub(super) async fn snapshot_route(&self, runtime: &str) -> Result<Route, SnapshotUnavailable> {
        let settings = self.settings()?;
        self.socket()?;
        let info = self
            .docker
            .info()
            .await
            .map_err(|e| SnapshotUnavailable::Info(Box::new(e)))?;
        let Some(registered) = info.runtimes.as_ref().and_then(|r| r.get(runtime)) else {
            return Err(SnapshotUnavailable::RuntimeMissing {
                runtime: runtime.to_owned(),
            });
        };
        if !CHECKPOINT_RUNTIMES.contains(&runtime) {
            return Err(SnapshotUnavailable::RuntimeCannotCheckpoint {
                runtime: runtime.to_owned(),
                can: CHECKPOINT_RUNTIMES.join(", "),
            });
        }
        // runsc driven directly needs neither the checkpoint API nor the data root.
        if let Some(wrapper) = Wrapper::recognise(
            registered.path.as_deref().unwrap_or_default(),
            registered.runtime_args.as_deref().unwrap_or_default(),
            &settings.images(),
        ) {
            return Ok(Route::Direct(wrapper));
        }
        if info.experimental_build != Some(true) {
            return Err(SnapshotUnavailable::NotExperimental);
        }
        let root = PathBuf::from(info.docker_root_dir.unwrap_or_default());
        if !root.join("containers").is_dir() {
            return Err(SnapshotUnavailable::DataRootUnreachable { path: root });
        }
        Ok(Route::Engine { data_root: root })
    }

    /// The runtime a container runs under, refusing one that does not run.
    async fn checkpointable(&self, container_id: &str) -> Result<String, SnapshotError> {
        let refuse = |reason: String| SnapshotError::NotCheckpointable {
            container_id: container_id.to_owned(),
            reason,
        };
        let details = self
            .docker
            .inspect_container(container_id, None::<InspectContainerOptions>)
            .await
            .map_err(|e| refuse(e.to_string()))?;
        if details.state.and_then(|s| s.running) != Some(true) {
            return Err(refuse("it is not running".into()));
        }
        Ok(details
            .host_config
            .and_then(|h| h.runtime)
            .unwrap_or_else(|| "runc".into()))
    }

    /// Waits until a container that a checkpoint stopped shows as stopped (the checkpoint call
    /// returns before Docker records the exit).
    pub(super) async fn wait_stopped(&self, container_id: &str) -> Result<(), SnapshotError> {
        let options = WaitContainerOptionsBuilder::new()
            .condition("not-running")
            .build();
        let mut waits = self.docker.wait_container(container_id, Some(options));
        match tokio::time::timeout(STOP_WAIT, waits.next()).await {
            // An answer, whatever its exit code, means it stopped.
            Ok(Some(_)) | Ok(None) => Ok(()),
            Err(_) => Err(SnapshotError::StopAfterCheckpoint {
                container_id: container_id.to_owned(),
            }),
        }
    }

    /// `POST /containers/{id}/start?checkpoint={name}` over the engine's socket.
    async fn start_from_checkpoint(
        &self,
        container_id: &str,
        name: &str,
    ) -> Result<(), SnapshotError> {
        let socket = self.socket()?;
        let failed = |source| SnapshotError::RestoreRequest {
            socket: socket.clone(),
            source,
        };
        let request = format!(
            "POST /v1.41/containers/{container_id}/start?checkpoint={name} HTTP/1.1\r\n\
             Host: docker\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let exchange = async {
            let mut stream = tokio::net::UnixStream::connect(&socket).await?;
            stream.write_all(request.as_bytes()).await?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await?;
            Ok::<_, io::Error>(answer)
        };
        let answer = tokio::time::timeout(RESTORE_WAIT, exchange)
            .await
            .map_err(|_| failed(io::ErrorKind::TimedOut.into()))?
            .map_err(failed)?;
        let text = String::from_utf8_lossy(&answer);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse::<u16>().ok())
            .unwrap_or(0);
        if matches!(status, 204 | 304) {
            return Ok(());
        }
        let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        Err(SnapshotError::Restore {
            container_id: container_id.to_owned(),
            status,
            message: body.trim().chars().take(1000).collect(),
        })
    }

    pub(super) async fn checkpoint_container(
        &self,
        container_id: &str,
        name: &str,
        leave_running: bool,
    ) -> Result<SnapshotImage, SnapshotError> {
        let runtime = self.checkpointable(container_id).await?;
        let settings = self.settings()?;
        let data_root = match self.snapshot_route(&runtime).await? {
            Route::Direct(wrapper) => {
                return self
                    .checkpoint_direct(&wrapper, settings, container_id, name, leave_running)
                    .await;
            }
            Route::Engine { data_root } => data_root,
        };
        let links = settings.link_checkpoints(&data_root, container_id)?;
        let written = links.join(name);
        let options = CreateCheckpointOptions {
            checkpoint_id: name.to_owned(),
            checkpoint_dir: None,
            exit: !leave_running,
        };
        let images = settings.images().join(name);
        let taken = async {
            self.fault_at(SnapshotStep::CheckpointLinked)?;
            self.docker
                .create_checkpoint(container_id, options)
                .await
                .map_err(|e| SnapshotError::Checkpoint {
                    container_id: container_id.to_owned(),
                    source: Box::new(e),
                })?;
            self.fault_at(SnapshotStep::CheckpointTaken)?;
            if !leave_running {
                self.wait_stopped(container_id).await?;
            }
            if !written.is_dir() {
                return Err(SnapshotError::NoImage {
                    container_id: container_id.to_owned(),
                    path: written.clone(),
                });
            }
            let parent = settings.images();
            std::fs::create_dir_all(&parent).map_err(files("creating", &parent))?;
            let dir = images.clone();
            std::fs::rename(&written, &dir).map_err(files("moving", &written))?;
            self.fault_at(SnapshotStep::CheckpointMoved)?;
            let size_bytes = tree_size(&dir).map_err(files("measuring", &dir))?;
            Ok(SnapshotImage {
                dir,
                size_bytes,
                name: name.to_owned(),
                agent: super::agent_fingerprint(),
            })
        };
        let result = taken.await;
        if result.is_err() {
            // No part of a failed checkpoint's image outlives it, wherever it got to.
            let _ = remove_tree(&written);
            let _ = remove_tree(&images);
        }
        // Empty now; made again by the next checkpoint (the link into it stays).
        let _ = std::fs::remove_dir(&links);
        result
    }

    pub(super) async fn restore_container(
        &self,
        spec: &LaunchSpec,
        image: &SnapshotImage,
    ) -> Result<Launched, SnapshotError> {
        let settings = self.settings()?;
        let data_root = match self.snapshot_route(spec.profile.runtime.as_str()).await? {
            Route::Direct(_) => return self.restore_direct(settings, spec, image).await,
            Route::Engine { data_root } => data_root,
        };
        let created = self
            .create_and_attach(spec, &[])
            .await
            .map_err(SnapshotError::Prepare)?;
        let container_id = created.container_id.clone();
        let placed = async {
            self.fault_at(SnapshotStep::RestoreCreated)?;
            let links = settings.link_checkpoints(&data_root, &container_id)?;
            let copy = links.join(&image.name);
            link_tree(&image.dir, &copy).map_err(files("placing", &copy))?;
            let mark = copy.join(CLONE_MARK);
            std::fs::write(&mark, &container_id).map_err(files("marking", &mark))?;
            self.fault_at(SnapshotStep::RestorePlaced)?;
            self.start_from_checkpoint(&container_id, &image.name)
                .await?;
            self.fault_at(SnapshotStep::RestoreStarted)
        };
        let result = placed.await;
        // The copy goes whatever happened: the image stays with its snapshot.
        let cleaned = remove_tree(&settings.links(&container_id));
        settings.sweep_engine_copies(&container_id);
        match result.and(cleaned) {
            Ok(()) => Ok(created),
            Err(err) => {
                if let Err(cleanup) = self.remove(&container_id).await {
                    tracing::warn!(error = %cleanup, "removing a container that failed to restore failed");
                }
                Err(err)
            }
        }
    }
}
