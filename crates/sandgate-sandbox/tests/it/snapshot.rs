//! Checkpoint and restore of sandboxes (issue 26, docs/snapshots.md) on an engine that can:
//! experimental mode and the runtime `runsc2024` (scripts/stack.sh sets both up).
//!
//! The engine: `SANDGATE_TEST_SNAPSHOT_DOCKER` (e.g. `unix:///run/sandgate-snap.sock`; default:
//! the engine the other tests use), its plaintext tmpfs `SANDGATE_TEST_SNAPSHOT_PLAIN` (default:
//! stack.sh's `/var/cache/sandgate/docker/plain`). An engine that cannot take snapshots fails these
//! tests, saying what it lacks, unless `SANDGATE_TEST_SNAPSHOTS=unavailable` says so on purpose.
//! The route the engine offers (runsc driven directly through `scripts/sandgate-runsc`, or
//! Docker's checkpoint API) is printed; `SANDGATE_TEST_SNAPSHOT_ROUTE` (`runsc`, `docker-api`)
//! makes the tests fail when it is another.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, ExecOptions, ExecOutcome, ManagerConfig, OciRuntime, PoolConfig, Sandbox,
    SandboxBackend as _, SandboxError, SandboxManager, SandboxProfile, SnapshotError,
    SnapshotFaults, SnapshotRoute, SnapshotUnavailable,
};

use crate::support;

pub(crate) const LIMIT: Duration = Duration::from_secs(180);

/// One snapshot test at a time: each checks that no image is left in the engine's TMPDIR, where
/// another test's checkpoint in progress would have one.
pub(crate) static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A manager on the snapshot engine with two profiles: `snap` (runsc2024) and `runc`.
pub(crate) struct SnapEnv {
    pub(crate) manager: SandboxManager,
    pub(crate) backend: Arc<DockerBackend>,
    host: String,
    pub(crate) instance: String,
    pub(crate) plain: PathBuf,
    data_root: PathBuf,
    /// Faults a test arms at the steps of this engine's checkpoints and restores.
    pub(crate) faults: Arc<SnapshotFaults>,
    route: SnapshotRoute,
}

impl SnapEnv {
    /// `None` when snapshots are declared unavailable on purpose; panics when the engine lacks
    /// what they need, saying what.
    pub(crate) async fn new(name: &str) -> Option<Self> {
        support::init_tracing();
        let unavailable =
            std::env::var("SANDGATE_TEST_SNAPSHOTS").is_ok_and(|v| v == "unavailable");
        let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
        let plain = PathBuf::from(
            std::env::var("SANDGATE_TEST_SNAPSHOT_PLAIN")
                .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into()),
        );
        let faults = Arc::new(SnapshotFaults::default());
        let backend = DockerBackend::connect(&host)
            .expect("a Docker client")
            .with_snapshots(&plain)
            .with_snapshot_faults(faults.clone());
        if let Err(reason) = backend.snapshot_support("runsc2024").await {
            if unavailable {
                eprintln!(
                    "snapshot test {name} not run: SANDGATE_TEST_SNAPSHOTS=unavailable ({reason})"
                );
                return None;
            }
            panic!(
                "snapshots are not available on the engine at {host:?} with plaintext tmpfs {}: \
                 {reason} (scripts/stack.sh up sets them up; SANDGATE_TEST_SNAPSHOT_DOCKER and \
                 SANDGATE_TEST_SNAPSHOT_PLAIN name another engine; SANDGATE_TEST_SNAPSHOTS=unavailable \
                 skips these tests on purpose)",
                plain.display()
            );
        }
        let route = backend
            .snapshot_route_of("runsc2024")
            .await
            .expect("snapshots are available");
        eprintln!("snapshot test {name}: route {route}");
        if let Ok(want) = std::env::var("SANDGATE_TEST_SNAPSHOT_ROUTE") {
            assert_eq!(
                route.to_string(),
                want,
                "the snapshot engine's route (SANDGATE_TEST_SNAPSHOT_ROUTE)"
            );
        }
        let data_root = PathBuf::from(
            backend
                .client()
                .info()
                .await
                .expect("docker info")
                .docker_root_dir
                .expect("DockerRootDir"),
        );
        let instance = format!(
            "sandgate-test-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut config = ManagerConfig::new(&instance);
        config.pool = PoolConfig {
            min_ready: 0,
            max_ready: 0,
            max_concurrent_starts: 2,
        };
        // Restores beyond the manager's places wait for one; on two busy cores fifty of them
        // take minutes, and the tests here show that none fails, not how fast they go.
        config.start_wait = LIMIT * 3;
        // These tests checkpoint and restore by hand; no template of their own (template.rs
        // tests those).
        config.templates.enabled = false;
        let snap = SandboxProfile {
            name: "snap".into(),
            runtime: OciRuntime::Runsc2024,
            ..support::profile()
        };
        let runc = SandboxProfile {
            name: "runc".into(),
            runtime: OciRuntime::Runc,
            ..support::profile()
        };
        let backend = Arc::new(backend);
        let manager = SandboxManager::start(backend.clone(), vec![snap, runc], config)
            .expect("valid configuration");
        Some(Self {
            manager,
            backend,
            host,
            instance,
            plain,
            data_root,
            faults,
            route,
        })
    }

    pub(crate) async fn lease(&self) -> Sandbox {
        support::within(LIMIT, "a lease", self.manager.lease("snap"))
            .await
            .expect("a lease")
    }

    /// A checkpoint of `sandbox` within [`LIMIT`].
    pub(crate) async fn checkpoint(
        &self,
        sandbox: &Sandbox,
        leave_running: bool,
    ) -> Result<sandgate_sandbox::Snapshot, SandboxError> {
        support::within(
            LIMIT,
            "a checkpoint",
            self.manager.checkpoint(sandbox, leave_running),
        )
        .await
    }

    /// A restore of `snapshot` within [`LIMIT`].
    pub(crate) async fn restore(
        &self,
        snapshot: &sandgate_sandbox::Snapshot,
    ) -> Result<Sandbox, SandboxError> {
        support::within(LIMIT, "a restore", self.manager.restore(snapshot)).await
    }

    pub(crate) async fn cleanup(self) {
        self.manager.shutdown().await;
        remove_instance(&self.backend, &self.instance).await;
    }

    /// Files of checkpoint images anywhere but under the manager's images directory: in the
    /// engine's data root (a real directory, not the link into the tmpfs), the links' tmpfs
    /// side, or containerd's copies in the engine's TMPDIR.
    pub(crate) fn stray_images(&self, container_ids: &[&str]) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for id in container_ids {
            let dir = self
                .data_root
                .join("containers")
                .join(id)
                .join("checkpoints");
            if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) && files_under(&dir) > 0 {
                found.push(dir);
            }
            let link = self.plain.join("sandgate/links").join(id);
            if files_under(&link) > 0 {
                found.push(link);
            }
        }
        for entry in std::fs::read_dir(self.plain.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains("checkpoint") {
                found.push(entry.path());
            }
        }
        found
    }
}

async fn remove_instance(backend: &DockerBackend, instance: &str) {
    if let Ok(found) = backend.list(instance).await {
        for c in found {
            let _ = backend.remove(&c.container_id).await;
        }
    }
}

impl Drop for SnapEnv {
    fn drop(&mut self) {
        // After `cleanup` there is nothing left; after a panic this is the cleanup.
        // A fresh connection: the test's runtime (and its client's connections) may be gone.
        let (host, instance) = (self.host.clone(), self.instance.clone());
        let _ = std::thread::spawn(move || {
            if let (Ok(rt), Ok(backend)) = (
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build(),
                DockerBackend::connect(&host),
            ) {
                rt.block_on(remove_instance(&backend, &instance));
            }
        })
        .join();
    }
}

pub(crate) fn files_under(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|e| {
                if e.path().is_dir() {
                    files_under(&e.path())
                } else {
                    1
                }
            })
            .sum()
    })
}

pub(crate) async fn run(sandbox: &Sandbox, code: &str) -> ExecOutcome {
    let outcome = support::within(
        LIMIT,
        "a cell",
        sandbox.exec(code, ExecOptions::default(), None),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell failed: {outcome:?}");
    outcome
}

pub(crate) fn value(outcome: &ExecOutcome) -> String {
    outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_else(|| panic!("the cell returned a value: {outcome:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_checkpointed_mid_life_and_restored_keeps_its_state() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-keep").await else {
        return;
    };
    let refused = env
        .manager
        .snapshots_available("runc")
        .await
        .expect_err("runc cannot");
    assert!(
        matches!(
            &refused,
            SandboxError::SnapshotsUnavailable {
                reason: SnapshotUnavailable::RuntimeCannotCheckpoint { .. },
                ..
            }
        ),
        "{refused:?}"
    );
    env.manager
        .snapshots_available("snap")
        .await
        .expect("runsc2024 can");
    let plain = support::within(LIMIT, "a lease", env.manager.lease("runc"))
        .await
        .expect("a runc sandbox");
    let refused = env
        .manager
        .checkpoint(&plain, false)
        .await
        .expect_err("runc cannot");
    assert!(
        matches!(
            &refused,
            SandboxError::Checkpoint { source, .. }
                if matches!(
                    **source,
                    SnapshotError::Unavailable(SnapshotUnavailable::RuntimeCannotCheckpoint { .. })
                )
        ),
        "{refused:?}"
    );
    plain
        .ping()
        .await
        .expect("a refused checkpoint leaves the sandbox serving");
    let sandbox = env.lease().await;
    run(
        &sandbox,
        "import os\nx = 41\nopen('/home/user/f.txt', 'w').write('home')\n\
         open('/tmp/t.txt', 'w').write('tmp')\nos.makedirs('/home/user/work', exist_ok=True)\n\
         os.chdir('/home/user/work')",
    )
    .await;
    let snapshot = support::within(
        LIMIT,
        "a checkpoint",
        env.manager.checkpoint(&sandbox, false),
    )
    .await
    .expect("the checkpoint is taken");
    assert!(
        snapshot.size_bytes() > 1_000_000,
        "an image of {} bytes",
        snapshot.size_bytes()
    );
    assert_eq!(snapshot.profile.name, "snap");
    assert_eq!(snapshot.source_sandbox, sandbox.id());
    assert!(
        snapshot.image.dir.starts_with(&env.plain),
        "the image is on the tmpfs"
    );
    let after = sandbox
        .ping()
        .await
        .expect_err("a stopped sandbox serves no calls");
    assert!(
        matches!(after, SandboxError::Checkpointed { .. }),
        "not a dead agent: {after:?}"
    );
    assert_eq!(
        env.stray_images(&[sandbox.container_id()]),
        Vec::<PathBuf>::new()
    );

    let restored = support::within(LIMIT, "a restore", env.manager.restore(&snapshot))
        .await
        .expect("the snapshot is restored");
    assert_ne!(restored.id(), sandbox.id());
    assert_ne!(restored.container_id(), sandbox.container_id());
    let state = run(
        &restored,
        "(x + 1, open('/home/user/f.txt').read(), open('/tmp/t.txt').read(), os.getcwd())",
    )
    .await;
    assert_eq!(value(&state), "(42, 'home', 'tmp', '/home/user/work')");
    assert_eq!(
        env.stray_images(&[sandbox.container_id(), restored.container_id()]),
        Vec::<PathBuf>::new()
    );
    let dir = snapshot.image.dir.clone();
    drop(snapshot);
    assert!(!dir.exists(), "dropping the snapshot deletes its image");
    env.cleanup().await;
}

/// What a clone must not share with its template or its siblings, as one line.
const DRAWS: &str = "import random, numpy, ssl, tempfile, multiprocessing, os\n\
    def draws():\n    with tempfile.NamedTemporaryFile() as f:\n        name = os.path.basename(f.name)\n\
    \x20   return '|'.join([repr(random.random()), repr(float(numpy.random.rand())),\n\
    \x20       ssl.RAND_bytes(16).hex(), name, multiprocessing.current_process().authkey.hex()])\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_checkpoint_draw_different_randomness() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-clones").await else {
        return;
    };
    let template = env.lease().await;
    run(&template, DRAWS).await;
    run(&template, "draws()").await; // every generator in use before the checkpoint
    let snapshot = support::within(
        LIMIT,
        "a checkpoint",
        env.manager.checkpoint(&template, true),
    )
    .await
    .expect("the checkpoint is taken");
    // Left running: the template draws from the state the clones resume with.
    let original = value(&run(&template, "draws()").await);
    let (a, b) = tokio::join!(
        env.manager.restore(&snapshot),
        env.manager.restore(&snapshot)
    );
    let (a, b) = (a.expect("clone a"), b.expect("clone b"));
    let clones = [
        value(&run(&a, "draws()").await),
        value(&run(&b, "draws()").await),
    ];
    let split = |line: &str| {
        line.trim_matches('\'')
            .split('|')
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let (o, ca, cb) = (split(&original), split(&clones[0]), split(&clones[1]));
    assert_eq!(o.len(), 5, "{original}");
    for (i, what) in [
        "random.random()",
        "numpy.random.rand()",
        "ssl.RAND_bytes(16)",
        "a tempfile name",
        "multiprocessing's authkey",
    ]
    .iter()
    .enumerate()
    {
        assert!(
            o[i] != ca[i] && o[i] != cb[i] && ca[i] != cb[i],
            "{what}: template {}, clones {} and {}",
            o[i],
            ca[i],
            cb[i]
        );
    }
    assert_eq!(
        env.stray_images(&[template.container_id(), a.container_id(), b.container_id()]),
        Vec::<PathBuf>::new()
    );
    env.cleanup().await;
}

/// Asks the engine's runtime to restore a new container from `from`; returns the engine's answer
/// to its start (the container is removed).
async fn start_restoring_from(env: &SnapEnv, from: &str) -> Result<(), String> {
    use bollard::models::{ContainerCreateBody, HostConfig};
    use bollard::query_parameters::{CreateContainerOptionsBuilder, StartContainerOptions};
    let docker = env.backend.client();
    let name = format!(
        "{}-{}",
        env.instance,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    use sandgate_sandbox::backend::labels;
    let labels = [
        (labels::MANAGED, "true"),
        (labels::INSTANCE, env.instance.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let config = ContainerCreateBody {
        image: Some(support::profile().image),
        cmd: Some(vec!["python3".into(), "-c".into(), "print('fresh')".into()]),
        env: Some(vec![format!("SANDGATE_RESTORE_FROM={from}")]),
        labels: Some(labels),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            cap_drop: Some(vec!["ALL".into()]),
            runtime: Some("runsc2024".into()),
            ..HostConfig::default()
        }),
        ..ContainerCreateBody::default()
    };
    let created = docker
        .create_container(
            Some(CreateContainerOptionsBuilder::new().name(&name).build()),
            config,
        )
        .await
        .expect("the container is created");
    let started = docker
        .start_container(&created.id, None::<StartContainerOptions>)
        .await
        .map_err(|e| e.to_string());
    let _ = env.backend.remove(&created.id).await;
    started
}

/// The runtime restores only from a directory directly under the manager's images directory on
/// the plaintext tmpfs: a container whose environment names anything else (another place on the
/// host, a way out of the directory, a directory without an image) never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restoring_runtime_refuses_images_outside_its_directory() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-refuse").await else {
        return;
    };
    if env.route != SnapshotRoute::Runsc {
        eprintln!("not run: the engine restores through Docker's API, not sandgate-runsc");
        env.cleanup().await;
        return;
    }
    let images = env.plain.join("sandgate/images");
    std::fs::create_dir_all(images.join("not-an-image")).expect("a directory");
    let outside = images.join("../../../../../../etc");
    for from in [
        "/etc".to_owned(),
        "/var/cache/sandgate".to_owned(),
        outside.display().to_string(),
        format!("{}/../links", images.display()),
        images.join("not-an-image").display().to_string(),
        images.join("no-such-image").display().to_string(),
        format!("{}/", images.display()),
        String::new(),
    ] {
        let answer = start_restoring_from(&env, &from).await;
        let refused = answer.expect_err(&format!("a restore from {from:?} is refused"));
        assert!(
            refused.contains("refusing to restore"),
            "refused by the wrapper's check, not by chance: {refused}"
        );
    }
    let _ = std::fs::remove_dir(images.join("not-an-image"));
    env.cleanup().await;
}

/// What user code sees of its confinement, as one line.
const PROBES: &str = "import os, socket\n\
    def probes():\n    status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n\
    \x20   try:\n        open('/etc/probe', 'w')\n        root = 'writable'\n    except OSError as e:\n        root = e.__class__.__name__\n\
    \x20   try:\n        socket.create_connection(('10.255.255.1', 80), timeout=2)\n        net = 'connected'\n    except OSError as e:\n        net = e.__class__.__name__\n\
    \x20   nics = sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else []\n\
    \x20   return '|'.join([str(os.getuid()), status['CapEff'].strip(), status['CapBnd'].strip(), status.get('NoNewPrivs', '?').strip(), root, net, ','.join(nics)])\n";

/// The engine's view of a container's confinement.
async fn host_confinement(env: &SnapEnv, container_id: &str) -> String {
    use bollard::query_parameters::InspectContainerOptions;
    let host = env
        .backend
        .client()
        .inspect_container(container_id, None::<InspectContainerOptions>)
        .await
        .expect("inspect")
        .host_config
        .expect("host config");
    format!(
        "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
        host.network_mode,
        host.cap_drop,
        host.cap_add,
        host.security_opt,
        host.readonly_rootfs,
        host.memory,
        host.pids_limit,
        host.nano_cpus,
        host.tmpfs
            .map(|t| t.into_iter().collect::<std::collections::BTreeMap<_, _>>()),
        host.runtime
    )
}

/// A clone restored from a template is confined exactly as a fresh sandbox of its profile: same
/// engine configuration, and from inside the same uid, capabilities, no-new-privileges,
/// read-only root and no network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_clone_is_as_confined_as_a_fresh_sandbox() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-confined").await else {
        return;
    };
    let fresh = env.lease().await;
    run(&fresh, PROBES).await;
    let snapshot = support::within(LIMIT, "a checkpoint", env.manager.checkpoint(&fresh, true))
        .await
        .expect("the checkpoint is taken");
    let clone = support::within(LIMIT, "a restore", env.manager.restore(&snapshot))
        .await
        .expect("the snapshot is restored");
    let inside = [
        value(&run(&fresh, "probes()").await),
        value(&run(&clone, "probes()").await),
    ];
    assert!(
        inside[0].starts_with("'1000|0000000000000000|"),
        "user code runs as uid 1000 with no capabilities: {}",
        inside[0]
    );
    assert_eq!(
        inside[0], inside[1],
        "fresh (left) and restored (right), from inside"
    );
    assert_eq!(
        host_confinement(&env, fresh.container_id()).await,
        host_confinement(&env, clone.container_id()).await,
        "fresh (left) and restored (right), as the engine has them"
    );
    env.cleanup().await;
}
