//! A Postgres server of a test's own, from the PostgreSQL 15 binaries on PATH (`initdb`,
//! `postgres`): in a temporary directory, on a loopback port of its own, optionally serving TLS
//! with a certificate the test made. Never the stack's shared server (127.0.0.1:55432), which
//! other tests run on and which must not be reconfigured.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sqlx::Connection;
use tokio::process::{Child, Command};

use super::eventually;

/// The superuser's name and password in every own server.
pub const SUPERUSER: &str = "sgroot";
/// See [`SUPERUSER`].
pub const PASSWORD: &str = "own-postgres-test-password";

/// The deployment's database roles (deploy/postgres/roles.sql) with the tests' passwords.
pub const MIGRATOR: (&str, &str) = ("sandgate_migrator", "migrator-password-for-tests");
/// See [`MIGRATOR`].
pub const GATEWAY: (&str, &str) = ("sandgate_gateway", "gateway-password-for-tests");
/// See [`MIGRATOR`].
pub const NODE: (&str, &str) = ("sandgate_node", "node-password-for-tests");

/// Runs deploy/postgres/roles.sql with psql as the superuser (`url`), as an operator would.
pub fn make_roles(url: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/postgres/roles.sql");
    let output = std::process::Command::new("psql")
        .arg(url)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .arg("-v")
        .arg(format!("migrator_password={}", MIGRATOR.1))
        .arg("-v")
        .arg(format!("gateway_password={}", GATEWAY.1))
        .arg("-v")
        .arg(format!("node_password={}", NODE.1))
        .arg("-f")
        .arg(&script)
        .output()
        .expect("psql runs");
    assert!(
        output.status.success(),
        "roles.sql: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A running server; stopped (and its directory removed) when dropped.
#[allow(missing_debug_implementations)] // holds a child process
pub struct OwnPostgres {
    dir: PathBuf,
    port: u16,
    child: Child,
}

/// The server's certificate and key in PEM (TLS on, and only TLS: plain connections refused).
pub struct ServerTls {
    /// The certificate (chain) the server presents.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

impl OwnPostgres {
    /// Makes a cluster in a fresh directory and starts it on a free loopback port; with `tls`,
    /// every TCP connection must use TLS (`hostssl` only). Returns once it accepts connections.
    pub async fn start(tls: Option<ServerTls>) -> Self {
        let dir = std::env::temp_dir().join(format!("sandgate-own-pg-{}", uuid::Uuid::new_v4()));
        let data = dir.join("data");
        std::fs::create_dir_all(&dir).expect("a temp dir for the cluster");
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, PASSWORD).expect("the password file");
        let owner = postgres_user();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown the temp dir");
            std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).expect("chown the password");
        }
        let status = as_postgres("initdb", owner)
            .arg("-D")
            .arg(&data)
            .args(["-U", SUPERUSER, "--auth=scram-sha-256", "--encoding=UTF8"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .expect("initdb (PostgreSQL 15) is on PATH");
        assert!(status.success(), "initdb failed");
        let hba = if tls.is_some() {
            "local all all scram-sha-256\n\
             hostssl all all 127.0.0.1/32 scram-sha-256\n\
             hostnossl all all 0.0.0.0/0 reject\n"
        } else {
            "local all all scram-sha-256\nhost all all 127.0.0.1/32 scram-sha-256\n"
        };
        std::fs::write(data.join("pg_hba.conf"), hba).expect("pg_hba.conf");
        let mut conf = String::from("listen_addresses = '127.0.0.1'\nfsync = off\n");
        if let Some(tls) = &tls {
            write_private(&data.join("server.crt"), &tls.cert_pem, owner);
            write_private(&data.join("server.key"), &tls.key_pem, owner);
            conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        }
        let mut existing = std::fs::read_to_string(data.join("postgresql.conf")).expect("conf");
        existing.push_str(&conf);
        std::fs::write(data.join("postgresql.conf"), existing).expect("postgresql.conf");
        let port = free_port();
        let child = Command::from(as_postgres("postgres", owner))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("postgres (PostgreSQL 15) is on PATH");
        let server = Self { dir, port, child };
        let probe = server.socket_url("postgres");
        eventually(
            Duration::from_secs(60),
            "the own Postgres accepts connections",
            || {
                let probe = probe.clone();
                async move { sqlx::PgConnection::connect(&probe).await.ok() }
            },
        )
        .await;
        server
    }

    /// A URL of the superuser over the server's Unix socket (no TLS there), for set-up steps.
    pub fn socket_url(&self, db: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{PASSWORD}@localhost/{db}?sslmode=disable&host={}&port={}",
            self.dir.display(),
            self.port
        )
    }

    /// The superuser's URL over TCP to `host` (e.g. `localhost`, `127.0.0.1`), with `query`
    /// appended (`sslmode=…&sslrootcert=…`).
    pub fn tcp_url(&self, host: &str, db: &str, query: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{PASSWORD}@{host}:{}/{db}?{query}",
            self.port
        )
    }

    /// The URL of `user` with `password` over TCP to `localhost`, database `db`, verified as
    /// every example of the deployment connects: `sslmode=verify-full` with `ca_bundle`.
    pub fn verify_full_url(
        &self,
        user: &str,
        password: &str,
        db: &str,
        ca_bundle: &Path,
    ) -> String {
        format!(
            "postgres://{user}:{password}@localhost:{}/{db}?sslmode=verify-full&sslrootcert={}",
            self.port,
            ca_bundle.display()
        )
    }

    /// A server serving only TLS (a certificate for `localhost` from `ca`), with the database
    /// `sandgate`, `ca`'s bundle in its directory ([`Self::role_url`]) and the deployment's
    /// roles made by deploy/postgres/roles.sql.
    pub async fn with_roles(ca: &sandgate_node::test_pki::Pki) -> Self {
        let (cert_pem, key_pem) = ca.leaf_pem_for(&["localhost"]);
        let server = Self::start(Some(ServerTls { cert_pem, key_pem })).await;
        std::fs::write(server.ca_bundle(), ca.ca_pem()).expect("the CA bundle");
        let mut admin = sqlx::PgConnection::connect(&server.socket_url("postgres"))
            .await
            .expect("the superuser connects");
        sqlx::query("CREATE DATABASE sandgate")
            .execute(&mut admin)
            .await
            .expect("the database");
        make_roles(&server.role_url((SUPERUSER, PASSWORD)));
        server
    }

    /// Where [`Self::with_roles`] put its CA's bundle.
    pub fn ca_bundle(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The `verify-full` URL of `role` (user, password) on the database `sandgate`, trusting
    /// [`Self::ca_bundle`].
    pub fn role_url(&self, (user, password): (&str, &str)) -> String {
        self.verify_full_url(user, password, "sandgate", &self.ca_bundle())
    }

    /// The directory of the server's files (a test may put a CA bundle there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Postgres refuses a key file others may read.
fn write_private(path: &Path, contents: &str, owner: Option<(u32, u32)>) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents).expect("a TLS file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown a TLS file");
    }
}

/// Postgres refuses to run as root: as root, the server runs as Debian's `postgres` user (as
/// scripts/stack.sh runs the shared one); its uid and gid, or `None` when not root.
fn postgres_user() -> Option<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .expect("an effective uid");
    if euid != "0" {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = std::process::Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("id runs");
        assert!(
            out.status.success(),
            "as root, a `postgres` user must exist"
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a numeric id")
    };
    Some((id("-u"), id("-g")))
}

/// `program` as the server's user (see [`postgres_user`]), from `/`.
fn as_postgres(program: &str, owner: Option<(u32, u32)>) -> std::process::Command {
    let mut command = if owner.is_some() {
        let mut c = std::process::Command::new("runuser");
        c.args(["-u", "postgres", "--", program]);
        c
    } else {
        std::process::Command::new(program)
    };
    command.current_dir("/");
    command
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}
