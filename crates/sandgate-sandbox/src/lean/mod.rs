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
use std::os::fd::OwnedFd;
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
    /// Where unpacked images live (`<dir>/images/<id>/rootfs`).
    pub dir: PathBuf,
    /// The lean library (`libsandgate_lean.so`) the zygotes load.
    pub library: PathBuf,
}

impl LeanConfig {
    /// The library next to the running executable (`target/<profile>/` in a build, or beside the
    /// installed binary), or one directory up (test binaries run from `deps/`).
    pub fn library_beside_executable() -> Option<PathBuf> {
        let exe = std::env::current_exe().ok()?;
        let dir = exe.parent()?;
        [
            dir.to_path_buf(),
            dir.join("deps"),
            dir.parent()?.to_path_buf(),
        ]
        .into_iter()
        .map(|d| d.join("libsandgate_lean.so"))
        .find(|p| p.exists())
    }
}

/// What the engine knows of one sandbox.
#[derive(Debug)]
struct Record {
    sandbox_id: String,
    profile: String,
    instance: String,
    pid: i32,
    cgroup: SandboxCgroup,
    created_unix: i64,
    image_id: String,
    exit: Option<i64>,
}

#[derive(Debug)]
struct Inner {
    docker: bollard::Docker,
    config: LeanConfig,
    layout: Layout,
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
        // SAFETY-free check: geteuid through std (no libc call needed).
        if !is_root() {
            return Err(io::Error::other("the lean engine needs root"));
        }
        let layout = Layout::detect()?;
        Ok(Self {
            inner: Arc::new(Inner {
                docker,
                config,
                layout,
                zygotes: tokio::sync::Mutex::default(),
                sandboxes: Arc::default(),
            }),
        })
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
        let zygote = self.zygote(&profile.image).await?;
        let container_id = format!(
            "{ID_PREFIX}{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        let cgroup = SandboxCgroup::new(self.inner.layout, &container_id);
        cgroup.create(profile)?;
        let (node_end, sandbox_end) = std::os::unix::net::UnixStream::pair()?;
        let (stderr_r, stderr_w) = std::io::pipe()?;
        let enter = EnterSpec {
            cgroup_procs: cgroup.procs_files(),
            cgroup_mounts: self.inner.layout.mounts(),
            hostname: "sandbox".into(),
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
            .spawn(
                &spec.sandbox_id,
                &enter,
                OwnedFd::from(sandbox_end),
                OwnedFd::from(stderr_w),
            )
            .await;
        let pid = match spawned {
            Ok(pid) => pid,
            Err(err) => {
                let _ = cgroup.destroy(KILL_DEADLINE).await;
                return Err(err);
            }
        };
        self.inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                container_id.clone(),
                Record {
                    sandbox_id: spec.sandbox_id.clone(),
                    profile: profile.name.clone(),
                    instance: spec.instance.clone(),
                    pid,
                    cgroup,
                    created_unix: chrono::Utc::now().timestamp(),
                    image_id: zygote.image_id.clone(),
                    exit: None,
                },
            );
        node_end.set_nonblocking(true)?;
        let stream = tokio::net::UnixStream::from_std(node_end)?;
        let (read, write) = stream.into_split();
        let stderr = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(stderr_r))?;
        let stdout = ReaderStream::new(read).map(|r| r.map(StreamChunk::Stdout));
        let stderr = ReaderStream::new(stderr).map(|r| r.map(StreamChunk::Stderr));
        Ok(Launched {
            container_id,
            streams: AgentStreams {
                output: futures::stream::select(stdout, stderr).boxed(),
                input: Box::pin(write),
            },
        })
    }

    fn describe(&self, container_id: &str, record: &Record) -> ManagedContainer {
        let fate = if record.cgroup.oom_kills() > 0 && record.exit.is_some() {
            ContainerFate::OomKilled {
                memory_limit_bytes: record.cgroup.memory_limit(),
            }
        } else if let Some(code) = record.exit {
            ContainerFate::Exited {
                code: if code < 0 { 128 - code } else { code },
            }
        } else if record.cgroup.pids().is_empty() {
            // Its zygote is gone (so no exit code came), and so are its processes.
            ContainerFate::Exited { code: 137 }
        } else {
            ContainerFate::Running
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

    /// The memory charged to a sandbox's cgroup now, in bytes (for the benchmark and metrics).
    pub fn memory_usage(&self, container_id: &str) -> Option<u64> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.get(container_id)?.cgroup.memory_usage()
    }

    /// The host pid of a sandbox's first process (its agent).
    pub fn pid(&self, container_id: &str) -> Option<i32> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.get(container_id).map(|r| r.pid)
    }

    /// The host pid of the zygote serving `image`, if one runs.
    pub async fn zygote_pid(&self, image: &str) -> Option<u32> {
        let zygotes = self.inner.zygotes.lock().await;
        zygotes.get(image).filter(|z| z.alive()).map(|z| z.pid)
    }
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
        // A lean sandbox's stdio is a socket its node holds from the launch; a node that lost it
        // (restarted) cannot re-attach yet.
        Err(BackendError::Attach {
            container_id: container_id.to_owned(),
            source: boxed(io::Error::other(
                "a lean sandbox cannot be re-attached after its node restarted",
            )),
        })
    }

    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        Ok(map
            .get(container_id)
            .map(|r| self.describe(container_id, r)))
    }

    #[tracing::instrument(skip_all, fields(container_id))]
    async fn remove(&self, container_id: &str) -> Result<(), BackendError> {
        let record = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(container_id);
        let cgroup = match record {
            Some(record) => record.cgroup,
            None => SandboxCgroup::new(self.inner.layout, container_id),
        };
        if !cgroup.exists() {
            return Ok(());
        }
        cgroup
            .destroy(KILL_DEADLINE)
            .await
            .map_err(|source| BackendError::Remove {
                container_id: container_id.to_owned(),
                source: boxed(source),
            })
    }

    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError> {
        let map = self
            .inner
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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
