//! The lean engine: sandboxes forked from a warmed zygote into lean containers the child builds
//! itself (SOCK's design; docs/architecture.md, "The lean engine"; docs/sandbox-security.md).
//!
//! - [`rootfs`]: the image's root filesystem, unpacked once per image version;
//! - [`cgroup`]: each sandbox's own cgroup with the profile's limits (v1, v2, hybrid);
//! - [`zygote`]: the node's handle on a zygote (one per image), asked for each child;
//! - this module: [`LeanBackend`], the [`SandboxBackend`] over them.
//!
//! A lean sandbox's "container id" is `lean-<hex>`; [`is_lean`] tells the engines apart.

pub mod cgroup;
pub mod rootfs;
pub mod zygote;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt as _;
use tokio_util::io::ReaderStream;

use sandgate_lean::spec::EnterSpec;

use crate::backend::{
    AgentStreams, BackendError, ContainerFate, LaunchSpec, Launched, ManagedContainer,
    SandboxBackend, StreamChunk,
};
use cgroup::{Layout, SandboxCgroup};
use zygote::Zygote;

/// The prefix of every lean sandbox's container id.
pub const ID_PREFIX: &str = "lean-";

/// Whether `container_id` names a lean sandbox.
pub fn is_lean(container_id: &str) -> bool {
    container_id.starts_with(ID_PREFIX)
}

/// How long removing a sandbox may wait for its processes to die.
const KILL_DEADLINE: Duration = Duration::from_secs(10);

/// The lean engine's settings.
#[derive(Debug, Clone)]
pub struct LeanConfig {
    /// Where unpacked images (`<dir>/images/<id>/rootfs`), the records of live sandboxes
    /// (`<dir>/sandboxes/`) and the keeper's socket live; only root may enter it.
    pub dir: PathBuf,
    /// The lean library (`libsandgate_lean.so`) the zygotes load.
    pub library: PathBuf,
    /// The keeper (`sandgate-lean-keeper`), started once per node directory.
    pub keeper: PathBuf,
}

/// The lean library's file name.
pub const LIBRARY: &str = "libsandgate_lean.so";
/// The keeper's file name.
pub const KEEPER: &str = "sandgate-lean-keeper";

impl LeanConfig {
    /// `name` next to the running executable (`target/<profile>/` in a build, or beside the
    /// installed binary), or one directory up (test binaries run from `deps/`).
    pub fn beside_executable(name: &str) -> Option<PathBuf> {
        let exe = std::env::current_exe().ok()?;
        let dir = exe.parent()?;
        [
            dir.to_path_buf(),
            dir.join("deps"),
            dir.parent()?.to_path_buf(),
        ]
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
    }

    /// Settings for `dir` with the library and the keeper found next to the running executable.
    pub fn beside_executable_in(dir: PathBuf) -> Result<Self, String> {
        let find = |name: &str| {
            Self::beside_executable(name).ok_or_else(|| {
                format!("{name} is not next to the running binary (cargo build -p sandgate-lean)")
            })
        };
        Ok(Self {
            dir,
            library: find(LIBRARY)?,
            keeper: find(KEEPER)?,
        })
    }
}

/// What the engine knows of one sandbox; all but `exit` is also on disk
/// (`<dir>/sandboxes/<container id>.json`), so a restarted node knows its sandboxes again.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Record {
    sandbox_id: String,
    profile: String,
    instance: String,
    pid: i32,
    created_unix: i64,
    image_id: String,
    #[serde(skip)]
    exit: Option<i64>,
    /// The zygote that forked it, while this node knows it: its exit code is still to come
    /// when its processes are gone but the zygote has not told yet.
    #[serde(skip)]
    zygote: Option<std::sync::Weak<Zygote>>,
}

#[derive(Debug)]
struct Inner {
    docker: bollard::Docker,
    config: LeanConfig,
    layout: Layout,
    keeper: sandgate_lean::keeper::Keeper,
    zygotes: tokio::sync::Mutex<HashMap<String, Arc<Zygote>>>,
    sandboxes: Arc<Mutex<HashMap<String, Record>>>,
}

/// The lean engine (see the module's docs).
#[derive(Debug, Clone)]
pub struct LeanBackend {
    inner: Arc<Inner>,
}

fn boxed(err: impl std::error::Error + Send + Sync + 'static) -> crate::backend::BoxError {
    Box::new(err)
}

impl LeanBackend {
    /// The engine on this host: `docker` is where images come from (unpacked once per version).
    /// Fails when the host cannot run it (no cgroup controllers, not root).
    pub fn new(docker: bollard::Docker, config: LeanConfig) -> io::Result<Self> {
        if !is_root() {
            return Err(io::Error::other("the lean engine needs root"));
        }
        let layout = Layout::detect()?;
        std::fs::create_dir_all(config.dir.join("sandboxes"))?;
        std::fs::set_permissions(
            &config.dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )?;
        let keeper = sandgate_lean::keeper::Keeper::connect_or_start(
            &config.keeper,
            &config.dir.join("keeper.sock"),
        )?;
        let sandboxes = load_records(&config.dir, layout, &keeper);
        Ok(Self {
            inner: Arc::new(Inner {
                docker,
                config,
                layout,
                keeper,
                zygotes: tokio::sync::Mutex::default(),
                sandboxes: Arc::new(Mutex::new(sandboxes)),
            }),
        })
    }

    /// What this node knows of its sandboxes.
    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<String, Record>> {
        self.inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn record_path(&self, container_id: &str) -> PathBuf {
        self.inner
            .config
            .dir
            .join("sandboxes")
            .join(format!("{container_id}.json"))
    }

    /// The zygote serving `image`, started (and the image unpacked) if there is none alive.
    async fn zygote(&self, image: &str) -> io::Result<Arc<Zygote>> {
        let mut zygotes = self.inner.zygotes.lock().await;
        if let Some(z) = zygotes.get(image).filter(|z| z.alive()) {
            return Ok(z.clone());
        }
        let rootfs = rootfs::ensure(&self.inner.docker, &self.inner.config.dir, image).await?;
        let sandboxes = self.inner.sandboxes.clone();
        let on_exit: zygote::ExitSink = Arc::new(move |pid, code| {
            let mut map = sandboxes.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(record) = map.values_mut().find(|r| r.pid == pid) {
                record.exit = Some(code);
            }
        });
        let zygote = Arc::new(Zygote::start(&rootfs, &self.inner.config.library, on_exit).await?);
        zygotes.insert(image.to_owned(), zygote.clone());
        Ok(zygote)
    }

    /// Starts the zygote of `image` now (a node does at start-up, so the first sandbox does not
    /// wait for the imports); returns its pid.
    pub async fn warm(&self, image: &str) -> io::Result<u32> {
        Ok(self.zygote(image).await?.pid)
    }

    async fn launch_inner(&self, spec: &LaunchSpec) -> io::Result<Launched> {
        let profile = &spec.profile;
        let container_id = format!(
            "{ID_PREFIX}{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        let cgroup = SandboxCgroup::new(self.inner.layout, &container_id);
        cgroup.create(profile)?;
        // A zygote that died (killed, say) is replaced; a launch it was asked for just as it
        // died is asked of its replacement, once.
        let mut attempt = 0;
        let launched = loop {
            attempt += 1;
            let zygote = match self.zygote(&profile.image).await {
                Ok(zygote) => zygote,
                Err(err) => break Err(err),
            };
            match self.spawn(spec, &zygote, &container_id, &cgroup).await {
                Err(_) if attempt == 1 && !zygote.alive() => continue,
                other => break other,
            }
        };
        if launched.is_err() {
            let _ = cgroup.destroy(KILL_DEADLINE).await;
        }
        launched
    }

    async fn spawn(
        &self,
        spec: &LaunchSpec,
        zygote: &Arc<Zygote>,
        container_id: &str,
        cgroup: &SandboxCgroup,
    ) -> io::Result<Launched> {
        let profile = &spec.profile;
        let (node_end, sandbox_end) = std::os::unix::net::UnixStream::pair()?;
        let (stderr_r, stderr_w) = std::io::pipe()?;
        let enter = EnterSpec {
            cgroup_procs: cgroup.procs_files(),
            cgroup_mounts: self.inner.layout.mounts(),
            // As Docker names a container's host: the first 12 characters of its id.
            hostname: container_id
                .trim_start_matches(ID_PREFIX)
                .chars()
                .take(12)
                .collect(),
            tmp_size_mb: profile.tmp_size_mb,
            home_size_mb: profile.home_size_mb,
            packages_size_mb: profile.packages_size_mb,
            home: crate::docker::HOME.into(),
            packages: crate::docker::PACKAGES.into(),
            uid: 1000,
            gid: 1000,
            nofile: profile.nofile,
            keep_fds: Vec::new(),
        };
        let spawned = zygote
            // The container id, not the sandbox's: nothing a tenant knows reaches the zygote's
            // memory, which every later sandbox copies.
            .spawn(
                container_id,
                &enter,
                OwnedFd::from(sandbox_end),
                OwnedFd::from(stderr_w),
            )
            .await;
        let pid = spawned?;
        let stdio = OwnedFd::from(node_end);
        let stderr = OwnedFd::from(stderr_r);
        let record = Record {
            sandbox_id: spec.sandbox_id.clone(),
            profile: profile.name.clone(),
            instance: spec.instance.clone(),
            pid,
            created_unix: chrono::Utc::now().timestamp(),
            image_id: zygote.image_id.clone(),
            exit: None,
            zygote: Some(Arc::downgrade(zygote)),
        };
        // The record first, then the keeper's copies (from then on a node restart does not end
        // the sandbox): a node that stops between the two leaves a record whose sandbox ends
        // (nothing holds its input), never a sandbox kept alive that no record names.
        let json = serde_json::to_vec(&record).map_err(io::Error::other)?;
        let path = self.record_path(container_id);
        tokio::fs::write(&path, json).await?;
        if let Err(err) = self
            .inner
            .keeper
            .put(container_id, &[stdio.as_fd(), stderr.as_fd()])
        {
            let _ = self.inner.keeper.forget(container_id);
            let _ = tokio::fs::remove_file(&path).await;
            return Err(err);
        }
        self.records().insert(container_id.to_owned(), record);
        Ok(Launched {
            container_id: container_id.to_owned(),
            streams: streams(stdio, stderr)?,
        })
    }

    fn describe(&self, container_id: &str, record: &Record) -> ManagedContainer {
        let cgroup = SandboxCgroup::new(self.inner.layout, container_id);
        let zygote_alive = || {
            record
                .zygote
                .as_ref()
                .and_then(std::sync::Weak::upgrade)
                .is_some_and(|z| z.alive())
        };
        let fate = if cgroup.oom_kills() > 0 && record.exit.is_some() {
            ContainerFate::OomKilled {
                memory_limit_bytes: cgroup.memory_limit(),
            }
        } else if let Some(code) = record.exit {
            ContainerFate::Exited {
                code: if code < 0 { 128 - code } else { code },
            }
        } else if !cgroup.pids().is_empty() || zygote_alive() {
            // Running, or gone with its zygote about to say how: until then, as a container
            // that is stopping.
            ContainerFate::Running
        } else {
            // Its processes are gone, and no zygote will say how they ended (it died, or this
            // node restarted since).
            ContainerFate::Exited { code: 137 }
        };
        ManagedContainer {
            container_id: container_id.to_owned(),
            sandbox_id: record.sandbox_id.clone(),
            profile: record.profile.clone(),
            instance: record.instance.clone(),
            managed: true,
            fate,
            created_unix: Some(record.created_unix),
            image_id: Some(record.image_id.clone()),
        }
    }

    /// The host pid of the zygote serving `image`, if one runs.
    pub async fn zygote_pid(&self, image: &str) -> Option<u32> {
        let zygotes = self.inner.zygotes.lock().await;
        zygotes.get(image).filter(|z| z.alive()).map(|z| z.pid)
    }
}

/// The agent streams over a sandbox's protocol socket and stderr pipe (the node's ends).
fn streams(stdio: OwnedFd, stderr: OwnedFd) -> io::Result<AgentStreams> {
    let stdio = std::os::unix::net::UnixStream::from(stdio);
    stdio.set_nonblocking(true)?;
    // tokio::io::split, not UnixStream::into_split: the latter's write half shuts the socket
    // down when dropped, which the agent would read as the end of its input (and exit) even
    // while the keeper holds a copy for the next node.
    let (read, write) = tokio::io::split(tokio::net::UnixStream::from_std(stdio)?);
    let stderr = tokio::net::unix::pipe::Receiver::from_owned_fd(stderr)?;
    let stdout = ReaderStream::new(read).map(|r| r.map(StreamChunk::Stdout));
    let stderr = ReaderStream::new(stderr).map(|r| r.map(StreamChunk::Stderr));
    Ok(AgentStreams {
        output: futures::stream::select(stdout, stderr).boxed(),
        input: Box::pin(write),
    })
}

/// The records a previous node left (`<dir>/sandboxes/`) of sandboxes whose cgroup still exists;
/// the others' records and kept descriptors go.
fn load_records(
    dir: &std::path::Path,
    layout: Layout,
    keeper: &sandgate_lean::keeper::Keeper,
) -> HashMap<String, Record> {
    let mut found = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir.join("sandboxes")) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .map(str::to_owned)
        else {
            continue;
        };
        let record = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Record>(&b).ok());
        match record {
            Some(record) if SandboxCgroup::new(layout, &id).exists() => {
                found.insert(id, record);
            }
            _ => {
                let _ = keeper.forget(&id);
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    found
}

fn is_root() -> bool {
    // The effective uid from /proc: no unsafe call needed here.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

#[async_trait]
impl SandboxBackend for LeanBackend {
    #[tracing::instrument(skip_all, fields(sandbox_id = %spec.sandbox_id))]
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, BackendError> {
        self.launch_inner(spec)
            .await
            .map_err(|source| BackendError::Create {
                sandbox_id: spec.sandbox_id.clone(),
                source: boxed(source),
            })
    }

    async fn attach(&self, container_id: &str) -> Result<AgentStreams, BackendError> {
        let err = |source: io::Error| BackendError::Attach {
            container_id: container_id.to_owned(),
            source: boxed(source),
        };
        let fds = self.inner.keeper.get(container_id).map_err(err)?;
        let mut fds = fds
            .ok_or_else(|| io::Error::other("the keeper holds nothing of this sandbox"))
            .map_err(err)?
            .into_iter();
        match (fds.next(), fds.next()) {
            (Some(stdio), Some(stderr)) => streams(stdio, stderr).map_err(err),
            _ => Err(err(io::Error::other("the keeper's copies are incomplete"))),
        }
    }

    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError> {
        let map = self.records();
        Ok(map
            .get(container_id)
            .map(|r| self.describe(container_id, r)))
    }

    #[tracing::instrument(skip_all, fields(container_id))]
    async fn remove(&self, container_id: &str) -> Result<(), BackendError> {
        if !is_lean(container_id) || container_id.contains(['/', '.']) {
            return Ok(()); // not a name this engine ever gave
        }
        self.records().remove(container_id);
        let cgroup = SandboxCgroup::new(self.inner.layout, container_id);
        if cgroup.exists() {
            cgroup
                .destroy(KILL_DEADLINE)
                .await
                .map_err(|source| BackendError::Remove {
                    container_id: container_id.to_owned(),
                    source: boxed(source),
                })?;
        }
        let _ = self.inner.keeper.forget(container_id);
        let _ = tokio::fs::remove_file(self.record_path(container_id)).await;
        Ok(())
    }

    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError> {
        let map = self.records();
        Ok(map
            .iter()
            .filter(|(_, r)| r.instance == instance)
            .map(|(id, r)| self.describe(id, r))
            .collect())
    }

    async fn image_id(&self, image: &str) -> Option<String> {
        self.inner.docker.inspect_image(image).await.ok()?.id
    }
}
