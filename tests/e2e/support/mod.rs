//! Helpers: a database per test, the real binary spawned on a free loopback port, and a TCP
//! proxy in front of Postgres so a test can make the database disappear.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sandgate_sandbox::lean::is_lean;
use sqlx::Connection;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

pub mod front;
pub mod node;
pub mod oauth;
pub mod own_postgres;
pub mod replicas;
pub mod scale_out;

/// The `sandgate` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_sandgate");

/// `SANDGATE_*` variables meant for the tests, not the binary: removed from its environment,
/// since the binary rejects unknown `SANDGATE_*` settings.
const TEST_ONLY_ENV: &[&str] = &[
    "SANDGATE_TEST_PYTHON",
    "SANDGATE_TEST_DOCKER2",
    "SANDGATE_TEST_DOCKER2_PIDFILE",
];

/// A command for the `sandgate` binary, with the test-only variables removed from the
/// environment it inherits.
pub fn sandgate_command() -> Command {
    let mut command = Command::new(BIN);
    for name in TEST_ONLY_ENV {
        command.env_remove(name);
    }
    command
}

/// The Postgres URL the stack provides (a superuser that may create databases).
pub fn admin_database_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set; run the tests through scripts/test.sh (it starts the stack)",
    )
}

/// Creates a fresh, empty database for one test and returns its URL.
pub async fn fresh_database() -> String {
    let admin = admin_database_url();
    let name = format!("sandgate_e2e_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .expect("the stack's Postgres accepts connections");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .expect("a test database can be created");
    let mut url = url_without_db(&admin);
    url.push('/');
    url.push_str(&name);
    url
}

fn url_without_db(url: &str) -> String {
    let base = url.split('?').next().unwrap_or(url);
    match base.rfind('/') {
        Some(i) if i > "postgres://".len() => base[..i].to_owned(),
        _ => base.to_owned(),
    }
}

/// Replaces host:port of a Postgres URL (to route it through a proxy).
pub fn with_addr(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let userinfo = authority
        .rsplit_once('@')
        .map(|(u, _)| format!("{u}@"))
        .unwrap_or_default();
    format!("{scheme}://{userinfo}{addr}/{path}")
}

/// The host:port a Postgres URL points at.
pub fn addr_of(url: &str) -> String {
    let rest = url.split_once("://").expect("a URL with a scheme").1;
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .rsplit_once('@')
        .map(|(_, a)| a)
        .unwrap_or(authority)
        .to_owned()
}

/// A running gateway process. Dropping it kills the process and removes every container of its
/// (test-unique) instance.
#[derive(Debug)]
pub struct Gateway {
    child: Option<Child>,
    /// `http://127.0.0.1:<port>`.
    pub base_url: String,
    /// The Postgres URL it uses.
    pub database_url: String,
    /// Its `instance` name (container label).
    pub instance: String,
    env: Vec<(String, String)>,
}

impl Gateway {
    /// Starts `sandgate serve` on a free loopback port against `database_url` and waits until it
    /// prints its MCP URL. `extra_env` adds or overrides `SANDGATE_*` settings.
    pub async fn start(database_url: &str, extra_env: &[(&str, &str)]) -> Gateway {
        let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        Self::start_instance(database_url, &instance, extra_env).await
    }

    /// Like [`Gateway::start`], with a given instance name (to restart "the same" deployment).
    /// Its node serves the node RPC on a loopback port (cleartext), so that gateway-only
    /// replicas ([`Gateway::start_gateway_only`]) can reach its sandboxes.
    pub async fn start_instance(
        database_url: &str,
        instance: &str,
        extra_env: &[(&str, &str)],
    ) -> Gateway {
        Self::launch(database_url, instance, extra_env, false, None).await
    }

    /// Like [`Gateway::start`], its log (at `RUST_LOG=debug` unless set) written to `log`: for
    /// the tests that search it.
    pub async fn start_logged(
        database_url: &str,
        extra_env: &[(&str, &str)],
        log: &std::path::Path,
    ) -> Gateway {
        let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        Self::launch(database_url, &instance, extra_env, false, Some(log)).await
    }

    /// `sandgate serve --gateway-only`: a replica of `instance`'s deployment without a node of
    /// its own, using the nodes registered in `database_url`.
    pub async fn start_gateway_only(
        database_url: &str,
        instance: &str,
        extra_env: &[(&str, &str)],
    ) -> Gateway {
        Self::launch(database_url, instance, extra_env, true, None).await
    }

    async fn launch(
        database_url: &str,
        instance: &str,
        extra_env: &[(&str, &str)],
        gateway_only: bool,
        log: Option<&std::path::Path>,
    ) -> Gateway {
        let mut env: Vec<(String, String)> = vec![
            ("SANDGATE_NODE__LISTEN".into(), "127.0.0.1:0".into()),
            ("SANDGATE_DATABASE__URL".into(), database_url.into()),
            ("SANDGATE_INSTANCE".into(), instance.into()),
            ("SANDGATE_LOG__FORMAT".into(), "json".into()),
            ("SANDGATE_POOL__MIN_READY".into(), "1".into()),
            // Test sandboxes stay far below their limits: more than the memory-derived default
            // (18 on 24 GiB), for the tests that hold many at once.
            ("SANDGATE_NODE__SLOTS".into(), "64".into()),
        ];
        // SANDGATE_TEST_RUNTIME=runsc runs the sandboxes under gVisor (scripts/test.sh does).
        if let Ok(runtime) = std::env::var("SANDGATE_TEST_RUNTIME") {
            env.push(("SANDGATE_SANDBOX__RUNTIME".into(), runtime));
        }
        for (k, v) in extra_env {
            env.retain(|(key, _)| key != k);
            env.push(((*k).into(), (*v).into()));
        }
        let mut command = sandgate_command();
        command.arg("serve");
        if gateway_only {
            command.arg("--gateway-only");
        }
        command
            .env("SANDGATE_LISTEN", "127.0.0.1:0")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("RUST_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        if let Some(log) = log {
            let file = std::fs::File::create(log).expect("the gateway's log file");
            command.stderr(file);
            if std::env::var_os("RUST_LOG").is_none() {
                command.env("RUST_LOG", "debug");
            }
        }
        let mut child = command.spawn().expect("the sandgate binary starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("sandgate prints its URL within 60 s")
            .expect("stdout is readable")
            .expect("sandgate printed a line before exiting (run with RUST_LOG=info to see why)");
        let mcp_url = line
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://") || u.starts_with("https://"))
            .unwrap_or_else(|| panic!("unexpected first line from sandgate serve: {line:?}"));
        // This process's own address (the MCP URL is a load balancer's when one is in front).
        let base_url = line
            .split(' ')
            .find(|w| w.starts_with("http://") && w.ends_with(','))
            .map_or_else(
                || mcp_url.trim_end_matches("/mcp").to_owned(),
                |w| w.trim_end_matches(',').to_owned(),
            );
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // The CLI issues tokens for the public URL: the one given (a load balancer in front of
        // replicas), else this process's own.
        if !env.iter().any(|(k, _)| k == "SANDGATE_PUBLIC_URL") {
            env.push(("SANDGATE_PUBLIC_URL".into(), base_url.clone()));
        }
        Gateway {
            child: Some(child),
            base_url,
            database_url: database_url.to_owned(),
            instance: instance.to_owned(),
            env,
        }
    }

    /// The gateway process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// The MCP endpoint.
    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base_url)
    }

    /// Runs `sandgate <args>` with this gateway's configuration; returns stdout, trimmed.
    /// Panics with stderr when it fails.
    pub async fn cli(&self, args: &[&str]) -> String {
        let output = self.run_cli(args).await;
        assert!(
            output.status.success(),
            "sandgate {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout)
            .expect("UTF-8 output")
            .trim()
            .to_owned()
    }

    async fn run_cli(&self, args: &[&str]) -> std::process::Output {
        sandgate_command()
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .await
            .expect("the sandgate binary runs")
    }

    /// Runs `sandgate <args>` that must fail; returns its stderr.
    pub async fn cli_fails(&self, args: &[&str]) -> String {
        let output = self.run_cli(args).await;
        assert!(
            !output.status.success(),
            "sandgate {args:?} failed as it should"
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    }

    /// Like [`Gateway::cli`], writing `input` to the command's standard input.
    pub async fn cli_stdin(&self, args: &[&str], input: &str) -> String {
        use tokio::io::AsyncWriteExt;
        let mut child = Command::new(BIN)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sandgate binary runs");
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin
            .write_all(input.as_bytes())
            .await
            .expect("stdin takes the input");
        drop(stdin);
        let output = child
            .wait_with_output()
            .await
            .expect("the command finishes");
        assert!(
            output.status.success(),
            "sandgate {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout)
            .expect("UTF-8 output")
            .trim()
            .to_owned()
    }

    /// Creates a tenant and returns its id.
    pub async fn create_tenant(&self) -> String {
        let name = format!("tenant-{}", uuid::Uuid::new_v4().simple());
        self.cli(&["admin", "tenant", "create", &name]).await
    }

    /// Issues an access token for a tenant with every scope.
    pub async fn token(&self, tenant: &str) -> String {
        self.cli(&["admin", "token", "issue", "--tenant", tenant, "--ttl", "1h"])
            .await
    }

    /// Sends SIGTERM and waits for the process to exit; returns whether it exited successfully.
    pub async fn terminate(&mut self) -> bool {
        let mut child = self.child.take().expect("the gateway is running");
        let pid = child.id().expect("the gateway is running");
        signal(pid, "-TERM");
        tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .expect("the gateway exits within 20 s of SIGTERM")
            .expect("wait works")
            .success()
    }

    /// Kills the process with SIGKILL (a crash) and waits for it to be gone.
    #[allow(dead_code)] // for the crash-recovery tests
    pub async fn kill(&mut self) {
        let mut child = self.child.take().expect("the gateway is running");
        child.kill().await.expect("SIGKILL");
    }
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "signal {sig} could be sent");
}

/// Ids of every container (running or not) labelled with `instance`, and of every lean sandbox
/// a node of `instance` recorded (`lean-…`).
pub fn containers_of(instance: &str) -> Vec<String> {
    containers_where("instance", instance)
}

/// Ids of the containers (running or not) labelled `sandgate.<key>=<value>`, and of the lean
/// sandboxes whose record's `key` is `value`.
fn containers_where(key: &str, value: &str) -> Vec<String> {
    let mut ids = docker_words(&[
        "ps",
        "-aq",
        "--no-trunc",
        "--filter",
        &format!("label=sandgate.{key}={value}"),
    ]);
    ids.extend(lean_records_where(key, value));
    ids
}

/// The lean engine's directory the gateways of the tests use (`lean.dir`).
fn lean_dir() -> std::path::PathBuf {
    std::env::var_os("SANDGATE_LEAN__DIR")
        .map(Into::into)
        .unwrap_or_else(|| "/var/lib/sandgate/lean".into())
}

/// Container ids of the lean sandboxes a node of `instance` recorded, from the node's records
/// (`<lean dir>/sandboxes/<id>.json`).
pub fn lean_sandboxes_of(instance: &str) -> Vec<String> {
    lean_records_where("instance", instance)
}

/// The record a node keeps of the lean sandbox `id` (`<lean dir>/sandboxes/<id>.json`).
fn lean_record(id: &str) -> Option<serde_json::Value> {
    let path = lean_dir().join("sandboxes").join(format!("{id}.json"));
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Container ids of the lean sandboxes whose record's `field` is `value`.
fn lean_records_where(field: &str, value: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(lean_dir().join("sandboxes")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let id = entry.path().file_stem()?.to_str()?.to_owned();
            (lean_record(&id)?[field] == value).then_some(id)
        })
        .collect()
}

/// Ids of the containers (running or not) and lean sandboxes of the sandbox `sandbox_id`.
pub fn containers_of_sandbox(sandbox_id: &str) -> Vec<String> {
    containers_where("sandbox_id", sandbox_id)
}

/// Whether the container or lean sandbox `id` exists.
pub fn container_exists(id: &str) -> bool {
    if is_lean(id) {
        return lean_record(id).is_some();
    }
    std::process::Command::new("docker")
        .args(["inspect", "--format", "{{.Id}}", id])
        .output()
        .expect("the docker CLI runs")
        .status
        .success()
}

/// Removes the container or lean sandbox `id` behind sandgate's back (`docker rm -f`; for a
/// lean one, the engine's own remove run from this process: its processes, cgroup and record).
pub fn remove_container(id: &str) {
    if is_lean(id) {
        let id = id.to_owned();
        with_lean_engine(move |lean| async move {
            use sandgate_sandbox::SandboxBackend as _;
            lean.remove(&id).await.map_err(|e| e.to_string())
        });
        return;
    }
    let removed = std::process::Command::new("docker")
        .args(["rm", "-f", id])
        .output()
        .expect("docker rm runs");
    assert!(removed.status.success(), "docker rm -f {id}");
}

/// Runs `work` on the lean engine of the tests' lean directory, on a thread and runtime of its
/// own (a drop may run inside the test's runtime); a failure is printed.
fn with_lean_engine<F, Fut>(work: F)
where
    F: FnOnce(sandgate_sandbox::LeanBackend) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let done = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let docker =
                bollard::Docker::connect_with_local_defaults().map_err(|e| e.to_string())?;
            let config = sandgate_sandbox::LeanConfig::beside_executable_in(lean_dir())?;
            let lean =
                sandgate_sandbox::LeanBackend::new(docker, config).map_err(|e| e.to_string())?;
            work(lean).await
        })
    })
    .join();
    match done {
        Ok(Ok(())) => {}
        Ok(Err(err)) => eprintln!("the lean engine's work failed: {err}"),
        Err(_) => eprintln!("the lean engine's work panicked"),
    }
}

/// Runs `command` inside the sandbox of `container` as root, as `docker exec` does: through
/// `docker exec` for a container, and for a lean sandbox (`lean-…`) by entering its namespaces
/// (`nsenter`, at the pid its node recorded). For what a test does behind the service's back
/// (opening a gate file a command waits on, listing its processes).
pub async fn sandbox_exec(container: &str, command: &[&str]) -> std::process::Output {
    let mut exec = if is_lean(container) {
        let record = lean_record(container).expect("the lean sandbox's record");
        let pid = record["pid"].as_i64().expect("the record names its pid");
        let mut nsenter = Command::new("nsenter");
        nsenter.args([
            "-t",
            &pid.to_string(),
            "-m",
            "-p",
            "-u",
            "-i",
            "-n",
            "-r",
            "-w",
            "--",
        ]);
        nsenter
    } else {
        let mut docker = Command::new("docker");
        docker.args(["exec", container]);
        docker
    };
    exec.args(command)
        .output()
        .await
        .expect("docker exec or nsenter runs")
}

/// Removes the lean sandboxes of `instance` through the engine's own `remove` (their processes
/// and cgroups, the keeper's copies, the records), as `docker rm -f` does for containers: a
/// gateway that is killed leaves its sandboxes running, by design, for its next start.
fn remove_lean_sandboxes_of(instance: &str) {
    use sandgate_sandbox::SandboxBackend as _;
    if lean_sandboxes_of(instance).is_empty() {
        return;
    }
    let instance = instance.to_owned();
    with_lean_engine(move |lean| async move {
        for sandbox in lean.list(&instance).await.map_err(|e| e.to_string())? {
            lean.remove(&sandbox.container_id)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    });
}

/// What `docker <args>` prints, split on white space (the ids of `ps -q`, `volume ls -q` …).
pub fn docker_words(args: &[&str]) -> Vec<String> {
    let output = std::process::Command::new("docker")
        .args(args)
        .output()
        .expect("the docker CLI runs");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Removes every container labelled with `instance` (a test's own), and its lean sandboxes.
pub fn remove_containers_of(instance: &str) {
    remove_lean_sandboxes_of(instance);
    let ids = containers_of(instance);
    if !ids.is_empty() {
        let _ = std::process::Command::new("docker")
            .args(["rm", "-f"])
            .args(&ids)
            .output();
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        remove_containers_of(&self.instance);
    }
}

/// A TCP proxy on a free loopback port that forwards to `upstream` (`host:port`, or
/// `unix:<path>` for a Unix socket) until stopped.
#[derive(Debug)]
pub struct TcpProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    tasks: JoinSet<()>,
}

impl TcpProxy {
    /// Starts forwarding, on a port below the kernel's ephemeral range: a test that stops the
    /// proxy and brings it back with [`TcpProxy::start_on`] must find its port free, and a port
    /// the kernel hands out (to an outgoing connection of any test running beside it) may be
    /// taken in between.
    pub async fn start(upstream: String) -> TcpProxy {
        let first = ephemeral_range_start();
        for _ in 0..200 {
            let port = rand::random_range(10_000..first);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            if let Ok(listener) = TcpListener::bind(addr).await {
                return Self::serve(listener, upstream);
            }
        }
        panic!("no free loopback port below {first} after 200 tries");
    }

    /// Starts forwarding from a given address (to bring a stopped proxy back on the same port).
    /// Connections of the stopped proxy may hold the port for a moment: retried until free.
    pub async fn start_on(addr: SocketAddr, upstream: String) -> TcpProxy {
        let listener = eventually(
            Duration::from_secs(30),
            "the proxy's port to be free",
            || async {
                match TcpListener::bind(addr).await {
                    Ok(listener) => Some(listener),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => None,
                    Err(e) => panic!("binding {addr}: {e}"),
                }
            },
        )
        .await;
        Self::serve(listener, upstream)
    }

    fn serve(listener: TcpListener, upstream: String) -> TcpProxy {
        let addr = listener.local_addr().expect("bound");
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    break;
                };
                let upstream = upstream.clone();
                connections.spawn(async move {
                    // `unix:<path>`: a Unix socket (the Docker engine's), else host:port.
                    if let Some(path) = upstream.strip_prefix("unix:") {
                        if let Ok(mut outbound) = tokio::net::UnixStream::connect(path).await {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    } else if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        TcpProxy { addr, tasks }
    }

    /// Closes the listening socket and every forwarded connection: to the gateway, the database
    /// is gone.
    pub async fn stop(mut self) {
        self.tasks.shutdown().await;
    }
}

/// The first port of the kernel's ephemeral range (`ip_local_port_range`; 32768 by default).
fn ephemeral_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .filter(|&p: &u16| p > 10_100)
        .unwrap_or(32_768)
}

/// A process's resident memory now and at its peak (`VmRSS`, `VmHWM` of `/proc/<pid>/status`),
/// bytes.
pub fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status is readable: {e}"));
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
