//! The lean engine: sandboxes forked from a zygote into lean containers, checked from inside as
//! a hostile tenant would probe them.

use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    CommandOptions, DockerBackend, Engines, ExecOptions, LeanBackend, LeanConfig, ManagerConfig,
    OciRuntime, PoolConfig, Sandbox, SandboxBackend, SandboxManager, SandboxProfile,
};

use crate::support;

/// A manager over a node's engines with one lean profile, `default`, and no pool.
struct LeanEnv {
    manager: SandboxManager,
    engines: Arc<Engines>,
    instance: String,
}

fn lean_config() -> LeanConfig {
    let cache = std::env::var("SANDGATE_CACHE").unwrap_or_else(|_| "/var/cache/sandgate".into());
    LeanConfig::beside_executable_in(std::path::PathBuf::from(cache).join("lean"))
        .expect("the lean library and keeper are built (cargo build -p sandgate-lean)")
}

impl LeanEnv {
    async fn new(name: &str) -> Self {
        let instance = format!(
            "sandgate-test-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Self::of(instance).await
    }

    /// A node of `instance` (a new one each call: a restarted node).
    async fn of(instance: String) -> Self {
        support::init_tracing();
        let docker = DockerBackend::connect("").expect("a Docker client");
        let lean = LeanBackend::new(docker.client().clone(), lean_config())
            .expect("this host runs the lean engine (root, cgroups)");
        let engines = Arc::new(Engines::new(docker, Ok(lean)));
        let mut config = ManagerConfig::new(&instance);
        config.pool = PoolConfig {
            min_ready: 0,
            max_ready: 0,
            max_concurrent_starts: 2,
        };
        let profile = SandboxProfile {
            image: support::image(),
            runtime: OciRuntime::Lean,
            ..SandboxProfile::default()
        };
        let manager = SandboxManager::start(engines.clone(), vec![profile], config)
            .expect("valid configuration");
        Self {
            manager,
            engines,
            instance,
        }
    }

    async fn lease(&self) -> Sandbox {
        support::within(
            Duration::from_secs(180),
            "a lean lease",
            self.manager.lease("default"),
        )
        .await
        .expect("a lean sandbox can be leased")
    }

    async fn cleanup(self) {
        self.manager.shutdown().await;
        for c in self.engines.list(&self.instance).await.unwrap_or_default() {
            let _ = self.engines.remove(&c.container_id).await;
        }
    }
}

async fn value(sandbox: &Sandbox, code: &str) -> String {
    let out = sandbox
        .exec(code, ExecOptions::default(), None)
        .await
        .expect("the cell ran");
    assert!(out.error.is_none(), "the cell raised: {out:?}");
    out.result
        .as_ref()
        .unwrap_or_else(|| panic!("the cell returned a value: {out:?}"))["text/plain"]
        .clone()
}

async fn shell(sandbox: &Sandbox, command: &str) -> (Option<i32>, String, String) {
    let out = sandbox
        .command(command, CommandOptions::default(), None)
        .await
        .expect("the command ran");
    (out.exit_code, out.stdout, out.stderr)
}

#[tokio::test]
async fn a_lean_sandbox_is_pandas_ready_stateful_and_isolated() {
    let env = LeanEnv::new("lean").await;
    let sandbox = env.lease().await;
    assert!(
        sandbox.container_id().starts_with("lean-"),
        "the lean engine served it: {}",
        sandbox.container_id()
    );

    // Pandas-ready: the data stack came imported from the zygote; state persists across cells.
    assert_eq!(
        value(
            &sandbox,
            "import sys\nsorted(m for m in ('numpy', 'pandas', 'matplotlib') if m in sys.modules)"
        )
        .await,
        "['matplotlib', 'numpy', 'pandas']"
    );
    value(
        &sandbox,
        "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\nlen(df)",
    )
    .await;
    assert_eq!(value(&sandbox, "int(df.a.sum())").await, "6");

    // Who user code is: uid 1000, no capabilities, no_new_privs, a seccomp filter.
    let seen = value(
        &sandbox,
        "import os\n\
         st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n\
         (os.getuid(), os.getgid(), os.getgroups(), st['CapEff'].strip(), st['CapBnd'].strip(), st['NoNewPrivs'].strip(), st['Seccomp'].strip())",
    )
    .await;
    assert_eq!(
        seen, "(1000, 1000, [], '0000000000000000', '00000000000000e0', '1', '2')",
        "uid/gid 1000, no groups, no effective capabilities, a bounding set of the agent's three, no_new_privs, seccomp filter"
    );

    // Blocked calls return EPERM; the root is read-only; /proc/kcore is masked.
    let probes = value(
        &sandbox,
        r#"import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def err(ret):
    return 0 if ret == 0 else ctypes.get_errno()
out = {}
out['unshare'] = err(libc.unshare(0x40000000))
out['mount'] = err(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))
out['keyctl'] = err(libc.syscall(250, 0, 0, 0, 0, 0))
out['bpf'] = err(libc.syscall(321, 0, 0, 0))
out['ptrace_parent'] = err(libc.syscall(101, 16, os.getppid(), 0, 0))
try:
    open('/usr/sandgate-probe', 'w')
    out['rootfs'] = 'writable'
except OSError as e:
    out['rootfs'] = errno.errorcode[e.errno]
def shows(path):
    try:
        return len(open(path, 'rb').read(16)) > 0
    except OSError:
        return False
out['masked_but_shown'] = [p for p in ('/proc/kcore', '/proc/keys', '/proc/timer_list', '/proc/sched_debug') if shows(p)]
# Masked files are binds of the sandbox's own /dev/null (the host's would be changeable by root
# in the sandbox), and read-only.
null = os.stat('/dev/null')
masked = [p for p in ('/proc/keys', '/proc/timer_list', '/proc/sched_debug', '/proc/kcore') if os.path.exists(p)]
out['masks_own_null'] = bool(masked) and all((os.stat(p).st_dev, os.stat(p).st_ino) == (null.st_dev, null.st_ino) for p in masked)
try:
    open('/proc/sys/kernel/hostname', 'w').write('x')
    out['proc_sys'] = 'writable'
except OSError as e:
    out['proc_sys'] = errno.errorcode[e.errno]
out['ifaces'] = sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else sorted(n for _, n in __import__('socket').if_nameindex())
out"#,
    )
    .await;
    assert_eq!(
        probes.replace("\n ", " "),
        "{'unshare': 1, 'mount': 1, 'keyctl': 1, 'bpf': 1, 'ptrace_parent': 1, 'rootfs': 'EROFS', 'masked_but_shown': [], 'masks_own_null': True, 'proc_sys': 'EROFS', 'ifaces': ['lo']}",
        "blocked calls EPERM (1), the root read-only, Docker's masked /proc paths empty, /proc/sys read-only, only lo"
    );

    // The kernel holds nothing of the agent's: its stdin is /dev/null (not the node's socket,
    // whose requests it could take and in whose name it could answer), it has no socket at all,
    // and, as a Docker kernel started by execve as the user, its own /proc files are its own.
    let kernel = value(
        &sandbox,
        "import os\n\
         links = [os.readlink(f'/proc/self/fd/{n}') for n in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{n}')]\n\
         with open('/proc/self/mem', 'rb', 0) as mem: readable = mem is not None\n\
         (os.readlink('/proc/self/fd/0'), [l for l in links if l.startswith('socket:')], readable)",
    )
    .await;
    assert_eq!(
        kernel, "('/dev/null', [], True)",
        "the kernel's stdin is /dev/null, it holds no socket, and its /proc/self/mem opens"
    );

    // Only the sandbox's own processes are visible: the agent is pid 1.
    let (code, stdout, stderr) = shell(
        &sandbox,
        "cat /proc/1/comm; ls /proc | grep -c '^[0-9]'; id -u; hostname",
    )
    .await;
    assert_eq!(code, Some(0), "the command ran: {stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some("python3"),
        "pid 1 is the agent: {stdout}"
    );
    let visible: usize = lines[1].parse().expect("a count");
    assert!(
        visible < 12,
        "only the sandbox's few processes are visible, not the host's: {stdout}"
    );
    assert_eq!(lines[2], "1000", "commands run as uid 1000");
    let short_id: String = sandbox.container_id()["lean-".len()..]
        .chars()
        .take(12)
        .collect();
    assert_eq!(
        lines[3], short_id,
        "its own host name: its id's first 12 characters, as Docker's"
    );

    // Files land in a home of its own.
    let (code, _, stderr) = shell(
        &sandbox,
        "echo hi > ~/note.txt && test -f /home/user/note.txt",
    )
    .await;
    assert_eq!(code, Some(0), "the home is writable: {stderr}");

    env.cleanup().await;
}

#[tokio::test]
async fn two_lean_sandboxes_draw_different_random_numbers_and_cannot_see_each_other() {
    let env = LeanEnv::new("lean-two").await;
    let a = env.lease().await;
    let b = env.lease().await;
    let draw = "import random, numpy\n(random.random(), float(numpy.random.random()))";
    let (ra, rb) = (value(&a, draw).await, value(&b, draw).await);
    assert_ne!(
        ra, rb,
        "two forks of one zygote must not share their generators"
    );
    value(&a, "open('/home/user/secret.txt', 'w').write('a')").await; // 1 (characters written)
    let (_, stdout, _) = shell(&b, "ls /home/user; ls /proc | grep -c '^[0-9]'").await;
    assert!(
        !stdout.contains("secret.txt"),
        "b does not see a's files: {stdout}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_fork_bomb_and_an_allocation_loop_stay_inside_their_lean_sandbox() {
    let env = LeanEnv::new("lean-limits").await;
    let sandbox = env.lease().await;
    let bystander = env.lease().await;
    let (_, _, _) = shell(
        &sandbox,
        "bomb() { bomb | bomb & }; (bomb) 2>/dev/null & sleep 3; echo done",
    )
    .await;
    let out = sandbox
        .exec(
            "x = []\nwhile True:\n    x.append(bytearray(64 << 20))",
            ExecOptions::default(),
            None,
        )
        .await
        .expect("the allocation cell ended");
    assert!(
        out.state_lost || out.error.is_some(),
        "the allocation loop ended by the memory limit: {out:?}"
    );
    assert_eq!(
        value(&bystander, "1 + 1").await,
        "2",
        "the other sandbox is unharmed"
    );
    assert_eq!(
        value(&sandbox, "2 + 2").await,
        "4",
        "a fresh kernel serves the sandbox again"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_killed_zygote_is_replaced_and_its_sandboxes_keep_running() {
    let env = LeanEnv::new("lean-zygote").await;
    let before = env.lease().await;
    value(&before, "kept = 41\nkept").await;
    let lean = env.engines.lean().expect("the lean engine");
    let zygote = lean
        .zygote_pid(&support::image())
        .await
        .expect("a zygote serves the image");
    std::process::Command::new("kill")
        .args(["-9", &zygote.to_string()])
        .status()
        .expect("kill runs");
    // The sandbox it forked does not depend on it.
    assert_eq!(
        value(&before, "kept + 1").await,
        "42",
        "a live sandbox keeps its state"
    );
    // The next sandbox comes from a new zygote.
    let after = env.lease().await;
    assert_eq!(value(&after, "import pandas\n1").await, "1");
    let replacement = lean
        .zygote_pid(&support::image())
        .await
        .expect("a zygote serves the image again");
    assert_ne!(replacement, zygote, "a new zygote replaced the killed one");
    env.cleanup().await;
}

#[tokio::test]
async fn a_child_whose_setup_fails_never_becomes_a_sandbox_and_leaves_nothing_behind() {
    use futures::StreamExt as _;
    let env = LeanEnv::new("lean-setup-fails").await;
    // More open files than the kernel allows (fs.nr_open): the child fails at its rlimits, after
    // it made its namespaces and mounts.
    let profile = SandboxProfile {
        image: support::image(),
        runtime: OciRuntime::Lean,
        nofile: 1 << 30,
        ..SandboxProfile::default()
    };
    let spec = sandgate_sandbox::backend::LaunchSpec {
        profile,
        instance: env.instance.clone(),
        sandbox_id: "sbx_setupfails".into(),
    };
    let mut launched = env
        .engines
        .launch(&spec)
        .await
        .expect("the zygote forked a child");
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    while let Some(chunk) = launched.streams.output.next().await {
        match chunk {
            Ok(sandgate_sandbox::backend::StreamChunk::Stdout(b)) => stdout.extend_from_slice(&b),
            Ok(sandgate_sandbox::backend::StreamChunk::Stderr(b)) => stderr.extend_from_slice(&b),
            Err(_) => break,
        }
    }
    let stderr = String::from_utf8_lossy(&stderr);
    assert!(
        stdout.is_empty(),
        "the agent never started: {}",
        String::from_utf8_lossy(&stdout)
    );
    assert!(
        stderr.contains("limiting open files"),
        "the child said which step failed: {stderr}"
    );
    let id = launched.container_id.clone();
    let fate = support::within(Duration::from_secs(10), "the child's exit", async {
        loop {
            let found = env.engines.inspect(&id).await.expect("inspect");
            match found.map(|c| c.fate) {
                Some(sandgate_sandbox::ContainerFate::Running) => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                other => break other,
            }
        }
    })
    .await;
    assert_eq!(
        fate,
        Some(sandgate_sandbox::ContainerFate::Exited { code: 70 }),
        "the child exited before any sandbox code"
    );
    env.engines.remove(&id).await.expect("removed");
    for hierarchy in ["memory", "pids", "cpu", ""] {
        let dir = std::path::Path::new("/sys/fs/cgroup")
            .join(hierarchy)
            .join("sandgate-lean")
            .join(&id);
        assert!(!dir.exists(), "no cgroup left behind: {}", dir.display());
    }
    // Its mounts were made in its own mount namespace, private: none reached the host's.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mounts.contains(".sandgate-lean"),
        "no mount of a sandbox's root on the host:\n{mounts}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_lean_sandbox_outlives_its_node_and_is_adopted_with_its_variables() {
    let first = LeanEnv::new("lean-restart").await;
    let instance = first.instance.clone();
    let sandbox = first.lease().await;
    value(&sandbox, "kept = 'before the restart'\nkept").await;
    let id = sandbox.container_id().to_owned();
    // The node goes away: its manager, engines, zygote and every descriptor it held (the
    // keeper holds copies).
    drop(sandbox);
    let LeanEnv {
        manager, engines, ..
    } = first;
    drop(manager);
    drop(engines);

    let second = LeanEnv::of(instance).await;
    let adopted = support::within(
        Duration::from_secs(60),
        "the adoption",
        second.manager.adopt(&id),
    )
    .await
    .expect("the restarted node adopts its lean sandbox");
    assert_eq!(
        value(&adopted, "kept").await,
        "'before the restart'",
        "the kernel's state survived the node's restart"
    );
    let (code, stdout, _) = shell(&adopted, "echo still here").await;
    assert_eq!(
        (code, stdout.trim()),
        (Some(0), "still here"),
        "commands run after the adoption"
    );
    second.cleanup().await;
}

/// Many whole-file reads of one lean sandbox at once, through its handle and ones adopted
/// concurrently, while another sandbox starts, each get the file byte for byte: the agent's
/// frames reach the node whole over the sandbox's socket.
#[tokio::test]
async fn concurrent_whole_file_reads_of_a_lean_sandbox_arrive_byte_for_byte() {
    let env = LeanEnv::new("lean-reads").await;
    let sandbox = env.lease().await;
    let (code, _, stderr) = shell(&sandbox, "head -c 20000000 /dev/urandom > big.bin").await;
    assert_eq!(code, Some(0), "the file is written: {stderr}");
    let (_, digest, _) = shell(&sandbox, "sha256sum big.bin | cut -d' ' -f1").await;
    let expected = digest.trim().to_owned();
    // Callers that find no handle of their own adopt the container, several at once (a node's
    // first calls on a sandbox another process leased): they share one channel, since two on
    // one lean sandbox's socket would each read part of its output.
    let container = sandbox.container_id().to_owned();
    let adopted = futures::future::join_all((0..4).map(|_| env.manager.adopt(&container))).await;
    let handles: Vec<Sandbox> = std::iter::once(Ok(sandbox.clone()))
        .chain(adopted)
        .collect::<Result<_, _>>()
        .expect("the container is adopted");
    let reads = (0..32).map(|i| handles[i % handles.len()].read_file("big.bin", 40_000_000));
    // Another sandbox starts meanwhile (a lease and the pool's refill): its launch must not
    // touch the reads' stream.
    let (results, other) = tokio::join!(futures::future::join_all(reads), async {
        let other = env.lease().await;
        assert_eq!(value(&other, "1 + 1").await, "2");
        other
    });
    drop(other);
    for (i, read) in results.into_iter().enumerate() {
        let (bytes, info) = read.unwrap_or_else(|e| panic!("read {i} failed: {e}"));
        assert_eq!(bytes.len(), 20_000_000, "read {i} has every byte");
        assert_eq!(info.sha256, expected, "read {i} is the file");
    }
    env.cleanup().await;
}
