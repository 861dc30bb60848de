//! The Docker backend: talks to the engine with bollard and runs sandboxes as hardened containers
//! (DESIGN §3), the agent as their main process.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig, ResourcesUlimits};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, InspectContainerOptions,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, StartContainerOptions,
};
use futures::{StreamExt, TryStreamExt};

use crate::backend::{
    AgentStreams, BackendError, ContainerFate, LaunchSpec, Launched, ManagedContainer,
    SandboxBackend, StreamChunk, labels,
};
use crate::config::SandboxProfile;
use crate::snapshot::{SnapshotError, SnapshotImage, SnapshotRoute, SnapshotUnavailable};

mod pull;
mod runsc;
mod snapshot;

pub use pull::ImageReady;
pub use runsc::RESTORE_ENV;
pub use snapshot::CHECKPOINT_RUNTIMES;

/// One file of the agent package: its path in the archive and its text, embedded in the binary.
macro_rules! agent_file {
    ($path:literal) => {
        ($path, include_str!(concat!("../agent/", $path)))
    };
}

/// The agent package (`agent/sandgate_agent/` and `agent/__main__.py`), embedded in the binary:
/// every file of the archive the container runs ([`agent_archive`]), by its path there. Any image
/// with python3 can be a profile (DESIGN §3): the image has no copy of the agent.
pub const AGENT_FILES: &[(&str, &str)] = &[
    agent_file!("__main__.py"),
    agent_file!("sandgate_agent/__init__.py"),
    agent_file!("sandgate_agent/cells.py"),
    agent_file!("sandgate_agent/commands.py"),
    agent_file!("sandgate_agent/config.py"),
    agent_file!("sandgate_agent/display.py"),
    agent_file!("sandgate_agent/egress.py"),
    agent_file!("sandgate_agent/files.py"),
    agent_file!("sandgate_agent/jobs.py"),
    agent_file!("sandgate_agent/kernels.py"),
    agent_file!("sandgate_agent/lean.py"),
    agent_file!("sandgate_agent/main.py"),
    agent_file!("sandgate_agent/output.py"),
    agent_file!("sandgate_agent/packages.py"),
    agent_file!("sandgate_agent/processes.py"),
    agent_file!("sandgate_agent/protocol.py"),
    agent_file!("sandgate_agent/reseed.py"),
    agent_file!("sandgate_agent/runtime.py"),
    agent_file!("sandgate_agent/shells.py"),
    agent_file!("sandgate_agent/supervisor.py"),
    agent_file!("sandgate_agent/zygote.py"),
];

/// The `-c` program that unpacks [`agent_argument`] (its first argument) and runs the agent from
/// the archive with zipimport. Running the agent as one `-c` source instead would keep its whole
/// parse tree alive in every sandbox's agent and kernel (~4.5 MB each; `agent/bootstrap.py` says
/// why).
pub const AGENT_BOOTSTRAP: &str = include_str!("../agent/bootstrap.py");

/// [`AGENT_FILES`] as a zip archive of stored (uncompressed) files, which Python's zipimport
/// reads (bootstrap.py puts it in a sealed memfd); [`agent_argument`] compresses it as a whole.
pub fn agent_archive() -> &'static [u8] {
    static ARCHIVE: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
        use std::io::Write as _;
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .last_modified_time(zip::DateTime::default())
            .unix_permissions(0o644);
        let mut archive = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        for (path, text) in AGENT_FILES {
            // Writing to a Vec cannot fail, nor can storing a few files with distinct names.
            archive
                .start_file(*path, options)
                .and_then(|()| archive.write_all(text.as_bytes()).map_err(Into::into))
                .expect("archiving into memory cannot fail");
        }
        archive
            .finish()
            .expect("archiving into memory cannot fail")
            .into_inner()
    });
    &ARCHIVE
}

/// [`agent_archive`] as it travels on the container's command line: zlib-compressed, then base64
/// (an argument cannot hold NUL bytes). Linux caps one argument at 128 KiB (`MAX_ARG_STRLEN`);
/// compressed, the archive takes about a third of what the agent's sources would.
pub fn agent_argument() -> &'static str {
    static ARGUMENT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        use base64::Engine as _;
        use std::io::Write as _;
        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        // Writing to a Vec cannot fail.
        zlib.write_all(agent_archive())
            .and_then(|()| zlib.finish())
            .map(|packed| base64::engine::general_purpose::STANDARD.encode(packed))
            .expect("compressing into memory cannot fail")
    });
    &ARGUMENT
}

/// A fingerprint of the embedded agent (SHA-256 of [`agent_archive`], hex): a snapshot records
/// the agent it was taken with.
pub fn agent_fingerprint() -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(agent_archive()))
}

/// The sandbox user's home; the only writable place besides /tmp.
pub(crate) const HOME: &str = "/home/user";
/// Where the sandbox user's pip installs packages (PYTHONUSERBASE in the image and the agent).
pub(crate) const PACKAGES: &str = "/opt/packages";

const MIB: u64 = 1024 * 1024;

/// How long a removal that finds another one in progress waits for that one to finish.
const REMOVAL_WAIT: Duration = Duration::from_secs(30);

/// The only capabilities a sandbox container has (all others dropped): the agent's.
pub const AGENT_CAPABILITIES: [&str; 3] = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL"];

/// What went wrong talking to the Docker engine.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// The engine could not be reached at the configured address.
    #[error("cannot connect to the Docker engine")]
    Connect(#[source] bollard::errors::Error),
    /// The engine did not answer a ping.
    #[error("the Docker engine does not answer")]
    Ping(#[source] bollard::errors::Error),
    /// The sandbox image is not present on the engine.
    #[error(
        "sandbox image {0} is not present on the engine: build it with deploy/sandbox/build.sh, \
         load it, or let the node pull it (sandbox.pull, README \"Images in a registry\")"
    )]
    ImageMissing(String),
    /// A `tcp://` (or `http://`) engine address off loopback: Docker's plain HTTP API has no
    /// authentication, so whoever reaches it is root on that host.
    #[error(
        "the Docker engine address {0} is plain, unauthenticated HTTP to another host (whoever \
         reaches it is root there); sandgate speaks to an engine in the clear only on loopback: \
         run `sandgate node` on that host (docs/scale-out.md) or reach its engine through a Unix \
         socket"
    )]
    PlainRemote(String),
    /// Pulling the sandbox image from its registry failed (`sandbox.pull`).
    #[error(
        "pulling sandbox image {image} failed: check that the registry is reachable from this \
         engine and holds it (README, \"Images in a registry\"), or load it by hand and set \
         sandbox.pull = \"never\""
    )]
    Pull {
        /// The image asked for.
        image: String,
        /// What the engine (or the registry through it) said.
        #[source]
        source: bollard::errors::Error,
    },
    /// Inspecting the image failed for another reason.
    #[error("inspecting image {image} failed")]
    InspectImage {
        /// The image asked about.
        image: String,
        /// What the engine said.
        #[source]
        source: bollard::errors::Error,
    },
}

/// Whether sandgate may speak to the engine at `address` (a `docker.host` or `DOCKER_HOST`):
/// a Unix socket, or plain HTTP (`tcp://`, `http://`) to a loopback address only.
fn plain_address_allowed(address: &str) -> bool {
    let Some(rest) = address
        .strip_prefix("tcp://")
        .or_else(|| address.strip_prefix("http://"))
    else {
        return true;
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Who a Docker engine is (see [`DockerBackend::engine`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The engine's id.
    pub id: String,
    /// Its host's name.
    pub name: String,
    /// Its host's memory.
    pub memory_bytes: u64,
}

/// A handle on one Docker engine.
#[derive(Debug, Clone)]
pub struct DockerBackend {
    docker: Docker,
    /// The address it was connected with (empty: the local default).
    host: String,
    /// Where checkpoint images go, when snapshots are wanted ([`Self::with_snapshots`]).
    snapshots: Option<snapshot::SnapshotSettings>,
    /// Faults a test armed at the steps of checkpoints and restores (never set in production).
    faults: Option<std::sync::Arc<crate::faults::SnapshotFaults>>,
}

impl DockerBackend {
    /// Connects to the engine at `host` (`unix:///…`, `tcp://…`), or to the local default
    /// (`DOCKER_HOST`, else `/var/run/docker.sock`) when `host` is empty. Connecting is lazy: an
    /// engine that is down shows up on the first call, not here.
    pub fn connect(host: &str) -> Result<Self, DockerError> {
        let named = if host.is_empty() {
            std::env::var("DOCKER_HOST").unwrap_or_default()
        } else {
            host.to_owned()
        };
        if !plain_address_allowed(&named) {
            return Err(DockerError::PlainRemote(named));
        }
        let docker = if host.is_empty() {
            Docker::connect_with_defaults()
        } else if host.starts_with("unix://") || host.starts_with('/') {
            Docker::connect_with_unix(host, 120, bollard::API_DEFAULT_VERSION)
        } else {
            Docker::connect_with_http(host, 120, bollard::API_DEFAULT_VERSION)
        }
        .map_err(DockerError::Connect)?;
        Ok(Self {
            docker,
            host: host.to_owned(),
            snapshots: None,
            faults: None,
        })
    }

    /// Enables snapshots (checkpoint and restore, docs/snapshots.md) with `plain` as the engine's
    /// plaintext tmpfs (scripts/stack.sh: `<cache>/docker/plain`, whose `tmp/` is the engine's
    /// `TMPDIR`). The manager keeps its images under `plain/sandgate/`. Whether the engine can
    /// then take them is [`SandboxBackend::snapshot_support`]'s answer.
    pub fn with_snapshots(mut self, plain: impl Into<std::path::PathBuf>) -> Self {
        self.snapshots = Some(snapshot::SnapshotSettings {
            plain: plain.into(),
        });
        self
    }

    /// Arms `faults` at the steps of this engine's checkpoints and restores: a test hook
    /// ([`crate::faults`]), which no configuration reaches.
    pub fn with_snapshot_faults(
        mut self,
        faults: std::sync::Arc<crate::faults::SnapshotFaults>,
    ) -> Self {
        self.faults = Some(faults);
        self
    }

    /// Fails when a test armed a fault at `step`.
    pub(crate) fn fault_at(&self, step: crate::faults::SnapshotStep) -> Result<(), SnapshotError> {
        self.faults
            .as_ref()
            .map_or(Ok(()), |faults| faults.at(step))
    }

    /// The route snapshots of `runtime` take on this engine, or why they cannot be taken.
    pub async fn snapshot_route_of(
        &self,
        runtime: &str,
    ) -> Result<SnapshotRoute, SnapshotUnavailable> {
        Ok(match self.snapshot_route(runtime).await? {
            snapshot::Route::Direct(_) => SnapshotRoute::Runsc,
            snapshot::Route::Engine { .. } => SnapshotRoute::DockerApi,
        })
    }

    /// The underlying client, for the rest of this crate and its tests.
    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// Who the engine is: its id (stable for its data root), host name and memory. A sandbox
    /// node is keyed by the id, so two nodes never serve one engine.
    #[tracing::instrument(skip_all)]
    pub async fn engine(&self) -> Result<EngineInfo, DockerError> {
        let info = self.docker.info().await.map_err(DockerError::Ping)?;
        Ok(EngineInfo {
            id: info.id.unwrap_or_default(),
            name: info.name.unwrap_or_default(),
            memory_bytes: info.mem_total.unwrap_or(0).max(0) as u64,
        })
    }

    /// Checks that the engine answers.
    #[tracing::instrument(skip_all)]
    pub async fn ping(&self) -> Result<(), DockerError> {
        self.docker.ping().await.map_err(DockerError::Ping)?;
        Ok(())
    }

    /// Checks that `image` is present on the engine (images are built locally, never pulled).
    #[tracing::instrument(skip_all, fields(image = %image))]
    pub async fn ensure_image(&self, image: &str) -> Result<(), DockerError> {
        match self.docker.inspect_image(image).await {
            Ok(_) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => Err(DockerError::ImageMissing(image.to_owned())),
            Err(source) => Err(DockerError::InspectImage {
                image: image.to_owned(),
                source,
            }),
        }
    }
}

/// The container configuration of a sandbox: the hardening baseline of DESIGN §3 with the
/// profile's limits.
pub fn container_config(spec: &LaunchSpec) -> ContainerCreateBody {
    let profile: &SandboxProfile = &spec.profile;
    let memory = i64::try_from(profile.container_memory_mb() * MIB).unwrap_or(i64::MAX);
    let nofile = i64::try_from(profile.nofile).unwrap_or(i64::MAX);
    let labels = HashMap::from([
        (labels::MANAGED.to_owned(), "true".to_owned()),
        (labels::INSTANCE.to_owned(), spec.instance.clone()),
        (labels::PROFILE.to_owned(), profile.name.clone()),
        (labels::SANDBOX_ID.to_owned(), spec.sandbox_id.clone()),
    ]);
    // The root is read-only; /tmp and /home/user are the only writable places, both tmpfs.
    // /home/user is a tmpfs rather than a volume because a tmpfs is bounded by its `size` on any
    // host (and under gVisor), while a size-limited volume needs overlay2 on xfs with project
    // quotas (`--storage-opt size`), which we cannot count on. tmpfs pages count toward the
    // container's memory cgroup, so the container's limit is the profile's memory *plus* both
    // tmpfs sizes (`container_memory_mb`): a full disk is ENOSPC in user code, never an OOM kill
    // of the sandbox.
    let tmpfs = HashMap::from([
        (
            "/tmp".to_owned(),
            format!("rw,nosuid,nodev,size={}m,mode=1777", profile.tmp_size_mb),
        ),
        (
            HOME.to_owned(),
            format!(
                "rw,nosuid,nodev,size={}m,uid=1000,gid=1000,mode=0700",
                profile.home_size_mb
            ),
        ),
        // Packages the user installs with pip (the image's pip.conf: user scheme, PYTHONUSERBASE).
        (
            PACKAGES.to_owned(),
            format!(
                "rw,nosuid,nodev,size={}m,uid=1000,gid=1000,mode=0755",
                profile.packages_size_mb
            ),
        ),
    ]);
    let host_config = HostConfig {
        network_mode: Some("none".into()),
        // The agent (root in the container, never uid 1000) needs these three and nothing else:
        // SETUID/SETGID to start the kernel and commands as uid 1000 (which clears all their
        // capabilities) and to act as uid 1000 for file operations, KILL to end what user code
        // leaves behind. no-new-privileges stops anything from gaining them back.
        cap_drop: Some(vec!["ALL".into()]),
        cap_add: Some(AGENT_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect()),
        security_opt: Some(vec!["no-new-privileges".into()]),
        readonly_rootfs: Some(true),
        tmpfs: Some(tmpfs),
        memory: Some(memory),
        // Equal to memory: no swap on top of the limit.
        memory_swap: Some(memory),
        nano_cpus: Some((profile.cpus * 1e9) as i64),
        pids_limit: Some(profile.pids_limit),
        ulimits: Some(vec![ResourcesUlimits {
            name: Some("nofile".into()),
            soft: Some(nofile),
            hard: Some(nofile),
        }]),
        // tini reaps the zombies of user code (orphans are reparented to it); the agent is its
        // child.
        init: Some(true),
        binds: Some(Vec::new()),
        mounts: Some(Vec::new()),
        // The protocol runs over attach, not over logs; a chatty sandbox fills no disk.
        log_config: Some(HostConfigLogConfig {
            typ: Some("none".into()),
            config: Some(HashMap::new()),
        }),
        runtime: Some(profile.runtime.as_str().to_owned()),
        auto_remove: Some(false),
        ..HostConfig::default()
    };
    ContainerCreateBody {
        image: Some(profile.image.clone()),
        cmd: Some(vec![
            "python3".into(),
            "-u".into(),
            "-c".into(),
            AGENT_BOOTSTRAP.into(),
            agent_argument().to_owned(),
        ]),
        entrypoint: Some(Vec::new()),
        // Root with the three capabilities above: PID 1 (docker-init) and the agent hold the
        // attach stream, and user code (uid 1000) can neither open their descriptors in /proc nor
        // signal them.
        user: Some("0:0".into()),
        working_dir: Some(HOME.into()),
        env: Some(vec![format!("HOME={HOME}")]),
        labels: Some(labels),
        tty: Some(false),
        open_stdin: Some(true),
        // Keep stdin open when the gateway detaches: the agent exits on EOF, and a restarted
        // gateway must find it running (`adopt`).
        stdin_once: Some(false),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        host_config: Some(host_config),
        ..ContainerCreateBody::default()
    }
}

fn boxed(err: bollard::errors::Error) -> crate::backend::BoxError {
    Box::new(err)
}

fn is_not_found(err: &bollard::errors::Error) -> bool {
    matches!(
        err,
        bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

fn managed_container(
    container_id: String,
    labels: Option<&HashMap<String, String>>,
    fate: ContainerFate,
) -> ManagedContainer {
    let label = |key: &str| labels.and_then(|l| l.get(key)).cloned().unwrap_or_default();
    ManagedContainer {
        container_id,
        sandbox_id: label(labels::SANDBOX_ID),
        profile: label(labels::PROFILE),
        instance: label(labels::INSTANCE),
        managed: label(labels::MANAGED) == "true",
        fate,
        created_unix: None,
        image_id: None,
    }
}

impl DockerBackend {
    /// Creates `spec`'s container and attaches to it, not started yet; removes it again when the
    /// attach fails.
    /// Creates the sandbox's container (with `extra_env` added to its environment) and attaches
    /// to it.
    async fn create_and_attach(
        &self,
        spec: &LaunchSpec,
        extra_env: &[String],
    ) -> Result<Launched, BackendError> {
        let name = format!("sandgate-{}", spec.sandbox_id);
        let mut config = container_config(spec);
        if let Some(env) = config.env.as_mut() {
            env.extend(extra_env.iter().cloned());
        }
        let create = |config| {
            self.docker.create_container(
                Some(CreateContainerOptionsBuilder::new().name(&name).build()),
                config,
            )
        };
        let created = match create(config.clone()).await {
            // The name is taken by an earlier container of this same sandbox (a resume under
            // its id, while the pause's removal of the checkpointed container has not finished):
            // that container is done with (its state is in the snapshot), so it goes and the
            // create is tried once more. Any other holder of the name is left alone.
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409, ..
            }) if self.is_earlier_container_of(&name, spec).await => {
                tracing::info!(sandbox_id = %spec.sandbox_id, "removing the earlier container of a sandbox started again under its id");
                self.remove(&name).await?;
                create(config).await
            }
            other => other,
        }
        .map_err(|e| BackendError::Create {
            sandbox_id: spec.sandbox_id.clone(),
            source: boxed(e),
        })?;
        match self.attach_streams(&created.id).await {
            Ok(streams) => Ok(Launched {
                container_id: created.id,
                streams,
            }),
            Err(err) => {
                if let Err(cleanup) = self.remove(&created.id).await {
                    tracing::warn!(error = %cleanup, "removing a container that failed to attach failed");
                }
                Err(err)
            }
        }
    }

    /// Whether the container named `name` is a sandbox container of `spec`'s instance and
    /// sandbox id (labels), i.e. an earlier container of the same sandbox.
    async fn is_earlier_container_of(&self, name: &str, spec: &LaunchSpec) -> bool {
        matches!(
            self.inspect(name).await,
            Ok(Some(found)) if found.managed
                && found.instance == spec.instance
                && found.sandbox_id == spec.sandbox_id
        )
    }

    async fn attach_streams(&self, container_id: &str) -> Result<AgentStreams, BackendError> {
        let options = AttachContainerOptionsBuilder::new()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .logs(false)
            .build();
        let attached = self
            .docker
            .attach_container(container_id, Some(options))
            .await
            .map_err(|e| BackendError::Attach {
                container_id: container_id.to_owned(),
                source: boxed(e),
            })?;
        let output = attached
            .output
            .map_err(std::io::Error::other)
            .try_filter_map(|frame| async move {
                Ok(match frame {
                    LogOutput::StdOut { message } => Some(StreamChunk::Stdout(message)),
                    LogOutput::StdErr { message } => Some(StreamChunk::Stderr(message)),
                    // tty is off, so everything is multiplexed; anything else is not ours.
                    LogOutput::StdIn { .. } | LogOutput::Console { .. } => None,
                })
            })
            .boxed();
        Ok(AgentStreams {
            output,
            input: attached.input,
        })
    }
}

#[async_trait]
impl SandboxBackend for DockerBackend {
    #[tracing::instrument(skip_all, fields(sandbox_id = %spec.sandbox_id, container_id))]
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, BackendError> {
        // Attached before start, so that the agent's ready frame cannot be missed.
        let launched = self.create_and_attach(spec, &[]).await?;
        tracing::Span::current().record("container_id", &launched.container_id);
        match self
            .docker
            .start_container(&launched.container_id, None::<StartContainerOptions>)
            .await
        {
            Ok(()) => Ok(launched),
            Err(e) => {
                if let Err(cleanup) = self.remove(&launched.container_id).await {
                    tracing::warn!(error = %cleanup, "removing a container that failed to start failed");
                }
                Err(BackendError::Start {
                    container_id: launched.container_id,
                    source: boxed(e),
                })
            }
        }
    }

    #[tracing::instrument(skip_all, fields(container_id = %container_id))]
    async fn attach(&self, container_id: &str) -> Result<AgentStreams, BackendError> {
        self.attach_streams(container_id).await
    }

    #[tracing::instrument(skip_all, fields(container_id = %container_id))]
    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError> {
        let details = match self
            .docker
            .inspect_container(container_id, None::<InspectContainerOptions>)
            .await
        {
            Ok(details) => details,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => {
                return Err(BackendError::Inspect {
                    container_id: container_id.to_owned(),
                    source: boxed(e),
                });
            }
        };
        let state = details.state.unwrap_or_default();
        let memory_limit_bytes = details
            .host_config
            .as_ref()
            .and_then(|h| h.memory)
            .and_then(|m| u64::try_from(m).ok())
            .filter(|m| *m > 0);
        let fate = if state.running == Some(true) {
            ContainerFate::Running
        } else if state.oom_killed == Some(true) {
            ContainerFate::OomKilled { memory_limit_bytes }
        } else {
            ContainerFate::Exited {
                code: state.exit_code.unwrap_or(-1),
            }
        };
        let labels = details.config.as_ref().and_then(|c| c.labels.as_ref());
        let mut found = managed_container(
            details.id.unwrap_or_else(|| container_id.to_owned()),
            labels,
            fate,
        );
        found.image_id = details.image;
        Ok(Some(found))
    }

    #[tracing::instrument(skip_all, fields(container_id = %container_id))]
    async fn remove(&self, container_id: &str) -> Result<(), BackendError> {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        match self
            .docker
            .remove_container(container_id, Some(options))
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            // 409 "removal already in progress": someone else is removing it (reconciliation
            // and a purge, say). Done means gone: wait for theirs to finish.
            Err(
                e @ bollard::errors::Error::DockerResponseServerError {
                    status_code: 409, ..
                },
            ) => {
                let deadline = tokio::time::Instant::now() + REMOVAL_WAIT;
                while tokio::time::Instant::now() < deadline {
                    match self
                        .docker
                        .inspect_container(container_id, None::<InspectContainerOptions>)
                        .await
                    {
                        Err(gone) if is_not_found(&gone) => return Ok(()),
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                Err(BackendError::Remove {
                    container_id: container_id.to_owned(),
                    source: boxed(e),
                })
            }
            Err(e) => Err(BackendError::Remove {
                container_id: container_id.to_owned(),
                source: boxed(e),
            }),
        }
    }

    #[tracing::instrument(skip_all, fields(instance = %instance))]
    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError> {
        let filters = HashMap::from([(
            "label",
            vec![
                format!("{}=true", labels::MANAGED),
                format!("{}={instance}", labels::INSTANCE),
            ],
        )]);
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let found = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|e| BackendError::List(boxed(e)))?;
        Ok(found
            .into_iter()
            .filter_map(|c| {
                let id = c.id?;
                let running = matches!(
                    c.state,
                    Some(bollard::models::ContainerSummaryStateEnum::RUNNING)
                );
                // The summary carries no exit details; inspect says more when it matters.
                let fate = if running {
                    ContainerFate::Running
                } else {
                    ContainerFate::Exited { code: -1 }
                };
                let mut found = managed_container(id, c.labels.as_ref(), fate);
                found.created_unix = c.created;
                found.image_id = c.image_id;
                Some(found)
            })
            .collect())
    }

    async fn image_id(&self, image: &str) -> Option<String> {
        match self.docker.inspect_image(image).await {
            Ok(found) => found.id,
            Err(err) => {
                tracing::debug!(error = %err, image, "inspecting the sandbox image failed");
                None
            }
        }
    }

    async fn snapshot_support(&self, runtime: &str) -> Result<(), SnapshotUnavailable> {
        self.snapshot_route(runtime).await.map(|_| ())
    }

    fn snapshot_images_dir(&self) -> Option<std::path::PathBuf> {
        // Where checkpoints are moved to (docker/snapshot.rs): opened images sit beside them.
        self.snapshots
            .as_ref()
            .map(|settings| settings.plain.join("sandgate/images"))
    }

    #[tracing::instrument(skip_all, fields(container_id = %container_id, name = %name))]
    async fn checkpoint(
        &self,
        container_id: &str,
        name: &str,
        leave_running: bool,
    ) -> Result<SnapshotImage, SnapshotError> {
        self.checkpoint_container(container_id, name, leave_running)
            .await
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %spec.sandbox_id, snapshot = %image.name))]
    async fn restore(
        &self,
        spec: &LaunchSpec,
        image: &SnapshotImage,
    ) -> Result<Launched, SnapshotError> {
        self.restore_container(spec, image).await
    }

    fn snapshot_fault(&self, step: crate::faults::SnapshotStep) -> Result<(), SnapshotError> {
        self.fault_at(step)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use base64::Engine as _;

    use super::{
        AGENT_BOOTSTRAP, AGENT_FILES, DockerBackend, DockerError, agent_archive, agent_argument,
        plain_address_allowed,
    };

    #[test]
    fn plain_http_to_an_engine_is_refused_off_loopback() {
        for ok in [
            "",
            "unix:///var/run/docker.sock",
            "/run/sandgate-docker2.sock",
            "tcp://127.0.0.1:2375",
            "tcp://127.8.9.10:2375",
            "tcp://localhost:2375",
            "http://[::1]:2375",
        ] {
            assert!(plain_address_allowed(ok), "allowed: {ok}");
        }
        for refused in [
            "tcp://10.0.0.5:2375",
            "tcp://docker-host:2375",
            "http://192.168.1.2:2375",
            "tcp://[2001:db8::1]:2375",
            "tcp://127.0.0.1.example:2375",
        ] {
            assert!(!plain_address_allowed(refused), "refused: {refused}");
            let err = DockerBackend::connect(refused).expect_err("refused at connect");
            assert!(
                matches!(&err, DockerError::PlainRemote(a) if a == refused),
                "{err:?}"
            );
            assert!(err.to_string().contains("sandgate node"), "{err}");
        }
    }

    /// Linux caps one argument of `execve` at 32 pages (`MAX_ARG_STRLEN`, 128 KiB, the final NUL
    /// included): the agent travels as one argument (`python3 -u -c <bootstrap> <compressed
    /// archive>`), so a sandbox whose agent outgrew it would not start at all. Fail here first,
    /// with what to do.
    #[test]
    fn the_agent_fits_in_one_command_line_argument() {
        const MAX_ARG_STRLEN: usize = 32 * 4096;
        for (name, text) in [
            ("the compressed agent archive", agent_argument()),
            ("bootstrap.py", AGENT_BOOTSTRAP),
        ] {
            assert!(
                text.len() < MAX_ARG_STRLEN,
                "{name} is {} bytes, over the kernel's {MAX_ARG_STRLEN}-byte limit for one argument \
                 (the archive itself is {} bytes): ship part of the agent in the image, or copy \
                 the archive into the container before it starts",
                text.len(),
                agent_archive().len()
            );
        }
    }

    /// What bootstrap.py does with the argument (base64, then zlib) gives back the archive, and
    /// the archive holds every file of the package exactly, stored (zipimport reads it as is).
    #[test]
    fn the_compressed_agent_unpacks_to_its_package() {
        let packed = base64::engine::general_purpose::STANDARD
            .decode(agent_argument())
            .expect("the argument is base64");
        let mut archive = Vec::new();
        flate2::read::ZlibDecoder::new(packed.as_slice())
            .read_to_end(&mut archive)
            .expect("the argument is zlib data");
        assert!(
            archive == agent_archive(),
            "the round trip changed the archive"
        );
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(archive)).expect("a zip archive");
        assert_eq!(
            zip.len(),
            AGENT_FILES.len(),
            "one entry per file of the package"
        );
        for (path, text) in AGENT_FILES {
            let mut entry = zip.by_name(path).expect("every file is in the archive");
            assert_eq!(
                entry.compression(),
                zip::CompressionMethod::Stored,
                "{path} is stored"
            );
            let mut got = String::new();
            entry
                .read_to_string(&mut got)
                .expect("the entry reads back");
            assert!(got == *text, "{path} changed in the archive");
        }
        assert!(
            agent_argument().bytes().all(|b| b.is_ascii_graphic()),
            "one argument, no NUL, no white space"
        );
    }

    /// Every Python file of the package is embedded: a module added to `agent/sandgate_agent/`
    /// but not to [`AGENT_FILES`] would be missing in every sandbox (and the import fail there).
    #[test]
    fn every_file_of_the_agent_package_is_embedded() {
        let package = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("agent/sandgate_agent");
        let mut on_disk: Vec<String> = std::fs::read_dir(&package)
            .expect("the package directory")
            .map(|entry| {
                entry
                    .expect("a directory entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| name.ends_with(".py"))
            .map(|name| format!("sandgate_agent/{name}"))
            .collect();
        on_disk.push("__main__.py".to_owned());
        on_disk.sort();
        let mut embedded: Vec<String> = AGENT_FILES.iter().map(|(p, _)| (*p).to_owned()).collect();
        embedded.sort();
        assert_eq!(embedded, on_disk, "AGENT_FILES lists the package's files");
    }
}
