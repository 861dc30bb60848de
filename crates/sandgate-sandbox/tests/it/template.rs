//! Warm pools restored from a template (issue 26, manager/templates.rs) on an engine that can take
//! snapshots (the engine and tmpfs of snapshot.rs: `SANDGATE_TEST_SNAPSHOT_DOCKER`,
//! `SANDGATE_TEST_SNAPSHOT_PLAIN`; `SANDGATE_TEST_SNAPSHOTS=unavailable` skips them on purpose).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, ExecOptions, ManagerConfig, OciRuntime, PoolConfig, Sandbox,
    SandboxBackend as _, SandboxManager, SandboxProfile, TemplateInfo,
};

use crate::snapshot::ONE_AT_A_TIME;
use crate::support;

const LIMIT: Duration = Duration::from_secs(300);

/// A manager on the snapshot engine with a `tpl` (runsc2024) pool and a `runc` one.
struct TplEnv {
    manager: SandboxManager,
    backend: Arc<DockerBackend>,
    host: String,
    instance: String,
}

impl TplEnv {
    /// `None` when snapshots are declared unavailable on purpose; panics when the engine lacks
    /// what they need.
    async fn new(name: &str, ready: usize, retry: Duration) -> Option<Self> {
        support::init_tracing();
        let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
        let plain = std::env::var("SANDGATE_TEST_SNAPSHOT_PLAIN")
            .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into());
        let backend = DockerBackend::connect(&host)
            .expect("a Docker client")
            .with_snapshots(&plain);
        if let Err(reason) = backend.snapshot_support("runsc2024").await {
            if std::env::var("SANDGATE_TEST_SNAPSHOTS").is_ok_and(|v| v == "unavailable") {
                eprintln!(
                    "template test {name} not run: SANDGATE_TEST_SNAPSHOTS=unavailable ({reason})"
                );
                return None;
            }
            panic!("snapshots are not available on the engine at {host:?} ({plain}): {reason}");
        }
        let instance = format!(
            "sandgate-test-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut config = ManagerConfig::new(&instance);
        config.pool = PoolConfig {
            min_ready: ready,
            max_ready: ready,
            max_concurrent_starts: 2,
        };
        config.templates.retry = retry;
        config.templates.max_retry = retry;
        let tpl = SandboxProfile {
            name: "tpl".into(),
            runtime: OciRuntime::Runsc2024,
            ..support::profile()
        };
        let runc = SandboxProfile {
            name: "runc".into(),
            runtime: OciRuntime::Runc,
            ..support::profile()
        };
        let backend = Arc::new(backend);
        let manager = SandboxManager::start(backend.clone(), vec![tpl, runc], config)
            .expect("valid configuration");
        Some(Self {
            manager,
            backend,
            host,
            instance,
        })
    }

    /// The `tpl` pool's template, once it is in use.
    async fn template(&self) -> TemplateInfo {
        support::eventually(LIMIT, "the tpl pool's template", || async {
            let status = self.manager.template_status("tpl").expect("a tpl pool");
            status.template
        })
        .await
    }

    async fn lease(&self, profile: &str) -> Sandbox {
        support::within(LIMIT, "a lease", self.manager.lease(profile))
            .await
            .expect("a lease")
    }

    async fn cleanup(self) {
        self.manager.shutdown().await;
        if let Ok(found) = self.backend.list(&self.instance).await {
            for c in found {
                let _ = self.backend.remove(&c.container_id).await;
            }
        }
    }
}

impl Drop for TplEnv {
    fn drop(&mut self) {
        // After `cleanup` nothing is left; after a panic this is the cleanup, on a fresh
        // connection (the test's runtime may be gone).
        let (host, instance) = (self.host.clone(), self.instance.clone());
        let _ = std::thread::spawn(move || {
            if let (Ok(rt), Ok(backend)) = (
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build(),
                DockerBackend::connect(&host),
            ) {
                rt.block_on(async {
                    for c in backend.list(&instance).await.unwrap_or_default() {
                        let _ = backend.remove(&c.container_id).await;
                    }
                });
            }
        })
        .join();
    }
}

/// The first cell of a sandbox: its number, whether pandas was loaded before it, and a draw of
/// `random.random()`.
async fn first_cell(sandbox: &Sandbox) -> (Option<u64>, String) {
    let outcome = support::within(
        LIMIT,
        "a first cell",
        sandbox.exec(
            "import sys, random\n('pandas' in sys.modules, random.random())",
            ExecOptions::default(),
            None,
        ),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell failed: {outcome:?}");
    let value = outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_else(|| panic!("a value: {outcome:?}"));
    (outcome.execution_count, value)
}

/// The largest file under `dir` (a template image's memory file).
fn largest_file(dir: &Path) -> PathBuf {
    fn walk(dir: &Path, best: &mut Option<(u64, PathBuf)>) {
        for entry in std::fs::read_dir(dir)
            .expect("the image's directory")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, best);
            } else {
                let len = entry.metadata().map_or(0, |m| m.len());
                if best.as_ref().is_none_or(|(l, _)| len > *l) {
                    *best = Some((len, path));
                }
            }
        }
    }
    let mut best = None;
    walk(dir, &mut best);
    best.expect("the image has files").1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runsc2024_pool_fills_from_its_template_and_a_runc_pool_says_why_not() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = TplEnv::new("tpl-fill", 2, Duration::from_secs(30)).await else {
        return;
    };
    let template = env.template().await;
    assert!(template.size_bytes > 0, "{template:?}");
    // The pool may hold sandboxes started before the template was in use: those go.
    let mut clones = Vec::new();
    for _ in 0..8 {
        let sandbox = env.lease("tpl").await;
        if sandbox.restored_from() == Some(template.snapshot_id.as_str()) {
            clones.push(sandbox);
            if clones.len() == 2 {
                break;
            }
        } else {
            assert_eq!(
                sandbox.restored_from(),
                None,
                "only the template is restored"
            );
            sandbox.close().await.expect("close");
        }
    }
    assert_eq!(
        clones.len(),
        2,
        "two leased sandboxes were restored from the template"
    );
    let (a, b) = (first_cell(&clones[0]).await, first_cell(&clones[1]).await);
    for (count, value) in [&a, &b] {
        assert_eq!(
            *count,
            Some(1),
            "a clone's first cell is number 1, as a fresh sandbox's"
        );
        assert!(
            value.starts_with("(True, "),
            "pandas was imported already: {value}"
        );
    }
    assert_ne!(a.1, b.1, "two clones draw different random.random()");

    let status = env.manager.template_status("runc").expect("a runc pool");
    assert!(status.template.is_none(), "{status:?}");
    let why = support::eventually(LIMIT, "the runc pool's capability", || async {
        env.manager
            .template_status("runc")
            .and_then(|s| s.snapshots)
            .and_then(Result::err)
    })
    .await;
    assert!(why.contains("runc"), "the reason names the runtime: {why}");
    let plain = env.lease("runc").await;
    assert_eq!(plain.restored_from(), None, "a runc sandbox starts afresh");
    for sandbox in clones.into_iter().chain([plain]) {
        sandbox.close().await.expect("close");
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_template_is_refused_and_the_pool_starts_afresh() {
    let _serial = ONE_AT_A_TIME.lock().await;
    // No pool starts of its own (every start is this test's), and no rebuild during the test.
    let Some(env) = TplEnv::new("tpl-tamper", 0, Duration::from_secs(3600)).await else {
        return;
    };
    let template = env.template().await;
    let restored = env.lease("tpl").await;
    assert_eq!(
        restored.restored_from(),
        Some(template.snapshot_id.as_str()),
        "a cold start restores the template"
    );
    restored.close().await.expect("close");

    // One byte of the image's largest file, changed where it lies on the tmpfs.
    let victim = largest_file(&template.dir);
    let mut bytes = std::fs::read(&victim).expect("read the image file");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&victim, &bytes).expect("tamper with the image file");

    let fresh = env.lease("tpl").await;
    assert_eq!(
        fresh.restored_from(),
        None,
        "a changed template is not restored: the sandbox started afresh"
    );
    let (count, value) = first_cell(&fresh).await;
    assert_eq!(count, Some(1), "{value}");
    let status = env.manager.template_status("tpl").expect("a tpl pool");
    assert!(
        status.template.is_none(),
        "the changed template is discarded: {status:?}"
    );
    let error = status.last_error.unwrap_or_default();
    assert!(error.contains("changed"), "the status says why: {error}");
    assert!(
        !template.dir.exists(),
        "the discarded template's image is deleted"
    );
    fresh.close().await.expect("close");
    env.cleanup().await;
}

/// A process killed before it could delete its template leaves the plaintext image on the tmpfs:
/// the next start of the same instance deletes it, and leaves another instance's alone.
#[tokio::test]
async fn a_start_deletes_the_template_images_its_instance_left_and_no_others() {
    support::init_tracing();
    let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
    let plain = std::env::var("SANDGATE_TEST_SNAPSHOT_PLAIN")
        .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into());
    let backend = DockerBackend::connect(&host)
        .expect("a Docker client")
        .with_snapshots(&plain);
    let Some(images) = backend.snapshot_images_dir() else {
        panic!("a backend with snapshots names its images directory");
    };
    let ours = format!("sandgate-test-sweep-{}", uuid::Uuid::new_v4().simple());
    let theirs = format!("sandgate-test-sweep-{}", uuid::Uuid::new_v4().simple());
    let leftover = |instance: &str| {
        let dir = images.join(format!(
            "{}{}",
            SandboxManager::template_id_prefix(instance),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("a leftover image directory");
        std::fs::write(dir.join("checkpoint.img"), b"pages").expect("a leftover image file");
        dir
    };
    let (our_left, their_left) = (leftover(&ours), leftover(&theirs));
    let mut config = ManagerConfig::new(&ours);
    config.pool = PoolConfig {
        min_ready: 0,
        max_ready: 0,
        max_concurrent_starts: 1,
    };
    let runc = SandboxProfile {
        name: "runc".into(),
        runtime: OciRuntime::Runc,
        ..support::profile()
    };
    let manager =
        SandboxManager::start(Arc::new(backend), vec![runc], config).expect("valid configuration");
    let (swept, kept) = (!our_left.exists(), their_left.exists());
    let _ = std::fs::remove_dir_all(&their_left);
    let _ = std::fs::remove_dir_all(&our_left);
    assert!(
        swept,
        "the instance's leftover template image {} is still there after its start",
        our_left.display()
    );
    assert!(kept, "another instance's template image was deleted");
    drop(manager);
}

/// A host where snapshots cannot be taken (here: no plaintext tmpfs configured, as on an engine
/// that `scripts/stack.sh` did not set up) keeps ordinary starts for a `runsc2024` pool, and
/// its template status says why.
#[tokio::test]
async fn a_host_without_the_snapshot_tmpfs_starts_afresh_and_says_why() {
    support::init_tracing();
    let host = std::env::var("SANDGATE_TEST_SNAPSHOT_DOCKER").unwrap_or_default();
    let backend = Arc::new(DockerBackend::connect(&host).expect("a Docker client"));
    let info = backend.client().info().await.expect("docker info");
    if !info
        .runtimes
        .as_ref()
        .is_some_and(|r| r.contains_key("runsc2024"))
    {
        eprintln!("test not run: the engine has no runsc2024 runtime");
        return;
    }
    let instance = format!(
        "sandgate-test-no-tmpfs-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let mut config = ManagerConfig::new(&instance);
    config.pool = PoolConfig {
        min_ready: 0,
        max_ready: 0,
        max_concurrent_starts: 1,
    };
    let tpl = SandboxProfile {
        name: "tpl".into(),
        runtime: OciRuntime::Runsc2024,
        ..support::profile()
    };
    let manager =
        SandboxManager::start(backend.clone(), vec![tpl], config).expect("valid configuration");
    let why = support::eventually(LIMIT, "the template status to say why not", || async {
        match manager
            .template_status("tpl")
            .expect("a tpl pool")
            .snapshots
        {
            Some(Err(why)) => Some(why),
            _ => None,
        }
    })
    .await;
    let sandbox = support::within(LIMIT, "a lease", manager.lease("tpl"))
        .await
        .expect("an ordinary start");
    let restored = sandbox.restored_from().map(str::to_owned);
    let answer = support::within(
        LIMIT,
        "1+1",
        sandbox.exec("1+1", ExecOptions::default(), None),
    )
    .await
    .expect("the cell runs");
    manager.shutdown().await;
    for c in backend.list(&instance).await.unwrap_or_default() {
        let _ = backend.remove(&c.container_id).await;
    }
    assert!(
        why.contains("tmpfs"),
        "the status names the missing tmpfs: {why}"
    );
    assert_eq!(restored, None, "no template: the sandbox started afresh");
    assert_eq!(
        answer.result.and_then(|r| r.get("text/plain").cloned()),
        Some("2".to_owned()),
        "the ordinary start answers"
    );
}
