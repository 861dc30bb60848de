//! What a snapshot leaves behind when it goes wrong, and what a restored clone is (issue 26's
//! "Done when"): a fault injected at each step of a checkpoint or a restore leaves the sandbox
//! running or cleanly gone, never both, never half, and no plaintext image; a clone carries the
//! same hardening as a fresh sandbox, seen by the engine and by hostile probes from inside; a
//! sandbox's installed packages survive; many restores at once all succeed while another sandbox
//! serves. On the engine `snapshot.rs` describes (same environment variables).

use std::path::PathBuf;

use bollard::query_parameters::InspectContainerOptions;
use sandgate_sandbox::{
    CommandOptions, ContainerFate, Sandbox, SandboxBackend as _, SandboxError, SnapshotError,
    SnapshotStep,
};

use crate::snapshot::{LIMIT, ONE_AT_A_TIME, SnapEnv, files_under, run, value};
use crate::support;

/// Whether `err` is the fault a test injected.
fn injected(err: &SandboxError) -> Option<SnapshotStep> {
    let source = match err {
        SandboxError::Checkpoint { source, .. } | SandboxError::Restore { source, .. } => source,
        _ => return None,
    };
    match **source {
        SnapshotError::Injected { step } => Some(step),
        _ => None,
    }
}

/// What a sandbox is after a failed operation: serving with its state, or gone with its
/// container. Anything else (a container left without a sandbox that serves, a sandbox that
/// answers from a container the engine says is stopped) fails the test.
#[derive(Debug, PartialEq, Eq)]
enum After {
    Running,
    Gone,
}

async fn after_failure(env: &SnapEnv, sandbox: &Sandbox, step: SnapshotStep) -> After {
    let container = env
        .backend
        .inspect(sandbox.container_id())
        .await
        .expect("the engine answers");
    let answer = support::within(LIMIT, "a cell", sandbox.exec("x", Default::default(), None))
        .await
        .map(|outcome| value(&outcome));
    match (container.map(|c| c.fate), answer) {
        (Some(ContainerFate::Running), Ok(x)) => {
            assert_eq!(x, "1", "{step}: the sandbox kept its state");
            After::Running
        }
        (None, Err(err)) => {
            assert!(
                !matches!(err, SandboxError::Checkpointed { .. }),
                "{step}: a sandbox whose checkpoint failed and whose container is gone must not \
                 claim a snapshot holds its state: {err:?}"
            );
            After::Gone
        }
        (fate, answer) => panic!(
            "{step}: half a sandbox: its container is {fate:?} and a call on it gives {answer:?}"
        ),
    }
}

/// The snapshot ids whose images are under the manager's images directory.
fn images(env: &SnapEnv) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(env.plain.join("sandgate/images"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| files_under(&e.path()) > 0)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_fails_at_any_step_leaves_the_sandbox_running_or_cleanly_gone() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-fault-cp").await else {
        return;
    };
    let before = images(&env);
    for leave_running in [true, false] {
        for step in SnapshotStep::CHECKPOINT {
            let sandbox = env.lease().await;
            run(&sandbox, "x = 1").await;
            env.faults.arm(step);
            let err = env
                .checkpoint(&sandbox, leave_running)
                .await
                .expect_err("the injected fault fails the checkpoint");
            assert_eq!(injected(&err), Some(step), "{step}: {err:?}");
            assert!(!env.faults.pending(), "{step}: the fault fired");
            let after = after_failure(&env, &sandbox, step).await;
            // Before the engine's call, or a checkpoint that leaves it running: it still runs.
            // After a stopping call, the container stopped with the call: it is removed.
            let expected = if leave_running || step == SnapshotStep::CheckpointLinked {
                After::Running
            } else {
                After::Gone
            };
            assert_eq!(after, expected, "{step}, leave_running {leave_running}");
            assert_eq!(
                env.stray_images(&[sandbox.container_id()]),
                Vec::<PathBuf>::new(),
                "{step}: no copy of the image left"
            );
            assert_eq!(
                images(&env),
                before,
                "{step}: no image of the failed checkpoint"
            );
            if after == After::Running {
                sandbox.close().await.expect("closed");
            }
        }
    }
    assert_eq!(
        env.backend
            .list(&env.instance)
            .await
            .expect("the engine lists")
            .len(),
        0,
        "no container is left over"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_fails_at_any_step_leaves_no_container_and_no_copy_behind() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-fault-rs").await else {
        return;
    };
    let sandbox = env.lease().await;
    run(
        &sandbox,
        "x = 1\nopen('/home/user/kept.txt', 'w').write('kept')",
    )
    .await;
    let snapshot = env.checkpoint(&sandbox, false).await.expect("a checkpoint");
    let source = sandbox.container_id().to_owned();
    sandbox
        .close()
        .await
        .expect("the stopped source is removed");
    for step in SnapshotStep::RESTORE {
        env.faults.arm(step);
        let err = env
            .restore(&snapshot)
            .await
            .expect_err("the injected fault fails the restore");
        assert_eq!(injected(&err), Some(step), "{step}: {err:?}");
        let left = env
            .backend
            .list(&env.instance)
            .await
            .expect("the engine lists");
        assert!(
            left.is_empty(),
            "{step}: a failed restore leaves no container: {left:?}"
        );
        assert_eq!(
            env.stray_images(&[&source]),
            Vec::<PathBuf>::new(),
            "{step}: no copy of the image left in the engine's reach"
        );
        assert!(
            files_under(&snapshot.image.dir) > 0,
            "{step}: the snapshot's own image is untouched"
        );
    }
    let restored = env
        .restore(&snapshot)
        .await
        .expect("with no fault armed, the same snapshot restores");
    let state = run(&restored, "(x, open('/home/user/kept.txt').read())").await;
    assert_eq!(value(&state), "(1, 'kept')");
    assert_eq!(
        env.stray_images(&[&source, restored.container_id()]),
        Vec::<PathBuf>::new()
    );
    drop(snapshot);
    restored.close().await.expect("closed");
    env.cleanup().await;
}

/// Hostile probes from inside, as the sandbox user: who it is, its capabilities, its network
/// interfaces, its limits, and what it is refused (writing the root, raw sockets, becoming root).
const PROBE: &str = "import os, socket, errno, resource\n\
    def attempt(f):\n    try:\n        f()\n        return 'allowed'\n    except OSError as e:\n        return errno.errorcode.get(e.errno, str(e.errno))\n\
    status = open('/proc/self/status').read()\n\
    field = lambda k: ([l.split()[1] for l in status.splitlines() if l.startswith(k + ':')] or ['absent'])[0]\n\
    nets = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:])\n\
    def write_root(): open('/etc/sandgate-probe', 'w')\n\
    def raw(): socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\n\
    def root(): os.setuid(0)\n\
    (os.getuid(), os.getgid(), field('CapEff'), field('CapBnd'), field('NoNewPrivs'), nets,\n\
     resource.getrlimit(resource.RLIMIT_NOFILE), attempt(write_root), attempt(raw), attempt(root))";

/// What [`PROBE`] sees, on one line (IPython breaks a long tuple over lines).
async fn probe(sandbox: &Sandbox) -> String {
    value(&run(sandbox, PROBE).await)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The engine's view of a container's hardening: every host-config field the baseline sets.
async fn engine_hardening(env: &SnapEnv, container_id: &str) -> String {
    let inspect = env
        .backend
        .client()
        .inspect_container(container_id, None::<InspectContainerOptions>)
        .await
        .expect("the container can be inspected");
    let host = inspect.host_config.expect("host config");
    format!(
        "network {:?} cap_drop {:?} cap_add {:?} security {:?} readonly {:?} tmpfs {:?} \
         pids {:?} memory {:?} swap {:?} cpus {:?} ulimits {:?} init {:?} runtime {:?} \
         privileged {:?} binds {:?} log {:?}",
        host.network_mode,
        host.cap_drop,
        host.cap_add,
        host.security_opt,
        host.readonly_rootfs,
        host.tmpfs
            .map(|t| t.into_iter().collect::<std::collections::BTreeMap<_, _>>()),
        host.pids_limit,
        host.memory,
        host.memory_swap,
        host.nano_cpus,
        host.ulimits,
        host.init,
        host.runtime,
        host.privileged,
        host.binds,
        host.log_config.and_then(|l| l.typ),
    )
}

async fn root_mount(sandbox: &Sandbox) -> String {
    let root = sandbox
        .command(
            "awk '$2 == \"/\" {print $4}' /proc/mounts",
            CommandOptions::default(),
            None,
        )
        .await
        .expect("the command runs");
    root.stdout.trim().to_owned()
}

/// A wheel of one module, made in the sandbox and installed with pip as the sandbox user.
const INSTALL: &str = "import zipfile, base64, hashlib\n\
    files = {'sgprobe/__init__.py': b'VALUE = 7\\n',\n\
     'sgprobe-1.0.dist-info/METADATA': b'Metadata-Version: 2.1\\nName: sgprobe\\nVersion: 1.0\\n',\n\
     'sgprobe-1.0.dist-info/WHEEL': b'Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n'}\n\
    def digest(b): return 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()\n\
    record = ''.join(f'{n},{digest(b)},{len(b)}\\n' for n, b in files.items()) + 'sgprobe-1.0.dist-info/RECORD,,\\n'\n\
    with zipfile.ZipFile('/home/user/sgprobe-1.0-py3-none-any.whl', 'w') as z:\n\
    \x20   [z.writestr(n, b) for n, b in files.items()]\n\
    \x20   z.writestr('sgprobe-1.0.dist-info/RECORD', record)\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_clone_keeps_installed_packages_and_the_hardening_of_a_fresh_sandbox() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-harden").await else {
        return;
    };
    let fresh = env.lease().await;
    let fresh_probe = probe(&fresh).await;
    let fresh_engine = engine_hardening(&env, fresh.container_id()).await;
    let fresh_root = root_mount(&fresh).await;
    assert!(
        fresh_probe.starts_with("(1000, 1000, '0000000000000000'"),
        "user code runs as uid 1000 with no capability: {fresh_probe}"
    );
    assert!(
        !fresh_probe.contains("'allowed'"),
        "no probe is allowed: {fresh_probe}"
    );
    assert!(
        fresh_root.split(',').any(|o| o == "ro"),
        "a read-only root: {fresh_root}"
    );

    run(&fresh, INSTALL).await;
    let pip = fresh
        .command(
            "python3 -m pip install --user --no-index --no-deps \
             /home/user/sgprobe-1.0-py3-none-any.whl",
            CommandOptions::default(),
            None,
        )
        .await
        .expect("pip runs");
    assert_eq!(pip.exit_code, Some(0), "pip installs the wheel: {pip:?}");
    let snapshot = env.checkpoint(&fresh, false).await.expect("a checkpoint");
    fresh.close().await.expect("closed");

    let clone = env.restore(&snapshot).await.expect("a restore");
    // A new import in the clone: the installed files themselves came back, not just a module
    // object in memory.
    let installed = value(
        &run(
            &clone,
            "import importlib.metadata, sgprobe\n(sgprobe.VALUE, importlib.metadata.version('sgprobe'), sgprobe.__file__.startswith('/opt/packages/'))",
        )
        .await,
    );
    assert_eq!(installed, "(7, '1.0', True)");
    assert_eq!(
        probe(&clone).await,
        fresh_probe,
        "the clone's hostile probes see what a fresh sandbox's see"
    );
    assert_eq!(
        engine_hardening(&env, clone.container_id()).await,
        fresh_engine,
        "the engine gives the clone the fresh sandbox's hardening"
    );
    assert_eq!(root_mount(&clone).await, fresh_root);
    drop(snapshot);
    clone.close().await.expect("closed");
    env.cleanup().await;
}

/// An error with its causes, on one line.
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

/// Restores asked for at once in the many-restores test (the number).
const AT_ONCE: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_restores_at_once_all_succeed_while_another_sandbox_runs_cells() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(env) = SnapEnv::new("snap-crowd").await else {
        return;
    };
    let template = env.lease().await;
    run(&template, "x = 41").await;
    let snapshot = env
        .checkpoint(&template, false)
        .await
        .expect("a checkpoint");
    template.close().await.expect("closed");
    let other = support::within(LIMIT, "a lease", env.manager.lease("runc"))
        .await
        .expect("another sandbox");

    let stop = tokio_util::sync::CancellationToken::new();
    let cells = {
        let (other, stop) = (other.clone(), stop.clone());
        tokio::spawn(async move {
            let mut answered = 0u32;
            while !stop.is_cancelled() {
                let outcome = support::within(
                    LIMIT,
                    "a cell",
                    other.exec("1 + 1", Default::default(), None),
                )
                .await
                .expect("the other sandbox answers while restores run");
                assert_eq!(value(&outcome), "2");
                answered += 1;
            }
            answered
        })
    };
    let restores = futures::future::join_all((0..AT_ONCE).map(|_| env.manager.restore(&snapshot)));
    let restored = support::within(LIMIT * 4, "the restores", restores).await;
    stop.cancel();
    let answered = cells.await.expect("the cell loop");
    assert!(answered > 0, "the other sandbox ran cells meanwhile");

    let mut failures = Vec::new();
    let mut clones = Vec::new();
    for result in restored {
        match result {
            Ok(clone) => clones.push(clone),
            Err(err) => failures.push(chain(&err)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {AT_ONCE} restores failed: {failures:?}",
        failures.len()
    );
    let answers = futures::future::join_all(clones.iter().map(|c| run(c, "x + 1"))).await;
    assert!(
        answers.iter().all(|a| value(a) == "42"),
        "every clone has the template's state"
    );
    let mut ids: Vec<&str> = clones.iter().map(|c| c.id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), AT_ONCE, "every clone is its own sandbox");
    for clone in clones {
        clone.close().await.expect("closed");
    }
    other.close().await.expect("closed");
    drop(snapshot);
    env.cleanup().await;
}
