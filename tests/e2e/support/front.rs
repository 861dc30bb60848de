//! What stands in front of a deployment in `tests/e2e/front.rs`: Debian's nginx running
//! `deploy/nginx/sandgate.conf` and Debian's Prometheus running `deploy/prometheus/`, each as
//! written but for addresses, ports, paths (and nginx's read timeouts), in a directory of the
//! test's own, on loopback.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use super::eventually;

/// The repository's file `path` (relative to its root), read.
pub fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// `text` with `from` replaced by `to`, which must occur in it (a template that no longer holds
/// the line this test changes fails here, not later with a confusing error).
pub fn replaced(text: &str, from: &str, to: &str) -> String {
    assert!(
        text.contains(from),
        "the shipped file still holds {from:?} (the test templates it)"
    );
    text.replace(from, to)
}

/// A loopback address with a port nobody listens on now.
pub fn free_loopback_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    probe.local_addr().expect("bound").to_string()
}

/// A directory of the test's own under the temporary directory, `name` in its name.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "sandgate-{name}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// Debian's `name` binary (scripts/stack.sh installs nginx and prometheus): a hard failure when
/// missing, since a skipped proxy test looks like a passing one.
fn debian_binary(name: &str, package: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin"] {
        let path = Path::new(dir).join(name);
        if path.is_file() {
            return path;
        }
    }
    panic!("{name} is not installed: run scripts/stack.sh (it installs Debian's {package})")
}

/// nginx serving `deploy/nginx/sandgate.conf` with TLS for `localhost` on a loopback port.
pub struct Nginx {
    child: Child,
    /// `https://localhost:<port>`.
    pub base_url: String,
    /// The certificate it presents (self-signed, for `localhost`): the clients' CA file.
    pub ca_file: PathBuf,
    dir: PathBuf,
}

impl Nginx {
    /// Starts nginx in front of `upstreams` (`host:port` of each gateway) at `addr`, with
    /// `read_timeout` in place of the shipped read and send timeouts.
    pub async fn start(addr: &str, upstreams: &[&str], read_timeout: &str) -> Nginx {
        let nginx = debian_binary("nginx", "nginx");
        let dir = scratch("nginx");
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let made = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
            .args(["-subj", "/CN=localhost"])
            .args(["-addext", "subjectAltName=DNS:localhost"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl runs");
        assert!(
            made.status.success(),
            "openssl made the proxy's certificate: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        let servers: String = upstreams
            .iter()
            .map(|u| format!("    server {u};\n"))
            .collect();
        let mut site = repo_file("deploy/nginx/sandgate.conf");
        site = replaced(&site, "    server gateway:8080;\n", &servers);
        site = replaced(&site, "listen 8443 ", &format!("listen {addr} "));
        site = replaced(
            &site,
            "/etc/sandgate/proxy/tls.crt",
            cert.to_str().expect("utf-8"),
        );
        site = replaced(
            &site,
            "/etc/sandgate/proxy/tls.key",
            key.to_str().expect("utf-8"),
        );
        site = replaced(
            &site,
            "proxy_read_timeout 610s",
            &format!("proxy_read_timeout {read_timeout}"),
        );
        site = replaced(
            &site,
            "proxy_send_timeout 610s",
            &format!("proxy_send_timeout {read_timeout}"),
        );
        std::fs::write(dir.join("sandgate.conf"), site).expect("the site file");
        // What Debian's /etc/nginx/nginx.conf would be around the include, in the test's own
        // directory (pid, logs, temporary files).
        let d = dir.display();
        let main = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/body;\n  \
             proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  \
             uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  \
             include {d}/sandgate.conf;\n}}\n"
        );
        std::fs::write(dir.join("nginx.conf"), main).expect("nginx.conf");
        let check = Command::new(&nginx)
            .arg("-t")
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .output()
            .await
            .expect("nginx -t runs");
        assert!(
            check.status.success(),
            "nginx -t accepts deploy/nginx/sandgate.conf: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let child = Command::new(&nginx)
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("nginx starts");
        let port = addr.rsplit(':').next().expect("a port");
        let proxy = Nginx {
            child,
            base_url: format!("https://localhost:{port}"),
            ca_file: cert,
            dir,
        };
        eventually(Duration::from_secs(30), "nginx to answer", || async {
            (proxy.status("/healthz").await == "200").then_some(())
        })
        .await;
        proxy
    }

    /// The MCP endpoint through the proxy.
    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base_url)
    }

    /// The HTTP status of GET `path` through the proxy (curl, checking the proxy's certificate
    /// against [`Nginx::ca_file`]; `000` when it does not answer).
    pub async fn status(&self, path: &str) -> String {
        let output = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--path-as-is",
            ])
            .arg("--cacert")
            .arg(&self.ca_file)
            .arg(format!("{}{path}", self.base_url))
            .output()
            .await
            .expect("curl runs");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// nginx's error log so far (for a failure's message).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: nginx's fast shutdown, in which the master stops its workers before it
        // exits (SIGKILL to the master alone left its worker running, orphaned, on its port;
        // SIGQUIT would wait for open streams, and the test is done with them).
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline
                && !matches!(self.child.try_wait(), Ok(Some(_)))
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Prometheus running `deploy/prometheus/prometheus.yml` and its alert rules.
pub struct Prometheus {
    child: Child,
    /// `http://<addr>`.
    pub base_url: String,
    /// The rendered configuration file.
    pub config: PathBuf,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts Prometheus at `addr` scraping `gateways` and `nodes` (`host:port` of each one's
    /// private listener).
    pub async fn start(addr: &str, gateways: &[&str], nodes: &[&str]) -> Prometheus {
        let prometheus = debian_binary("prometheus", "prometheus");
        let dir = scratch("prometheus");
        let rules = dir.join("sandgate-alerts.yml");
        std::fs::write(&rules, repo_file("deploy/prometheus/sandgate-alerts.yml")).expect("rules");
        let targets = |addrs: &[&str]| -> String {
            addrs.iter().map(|a| format!("          - {a}\n")).collect()
        };
        let mut config = repo_file("deploy/prometheus/prometheus.yml");
        config = replaced(
            &config,
            "/etc/prometheus/sandgate-alerts.yml",
            rules.to_str().expect("utf-8"),
        );
        config = replaced(
            &config,
            "          - 127.0.0.1:9464\n          - 127.0.0.1:9465\n",
            &targets(gateways),
        );
        config = replaced(
            &config,
            "          - 127.0.0.1:9474\n          - 127.0.0.1:9475\n",
            &targets(nodes),
        );
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config).expect("prometheus.yml");
        let child = Command::new(&prometheus)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("prometheus starts");
        Prometheus {
            child,
            base_url: format!("http://{addr}"),
            config: config_file,
            dir,
        }
    }

    /// GET `path` of its HTTP API, as JSON, when it answers.
    pub async fn api(&self, path: &str) -> Option<serde_json::Value> {
        let response = reqwest::get(format!("{}{path}", self.base_url))
            .await
            .ok()?;
        response.json().await.ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs Debian's `promtool` with `args`; its status and output.
pub async fn promtool(args: &[&str]) -> (bool, String) {
    let promtool = debian_binary("promtool", "prometheus");
    let output = Command::new(promtool)
        .args(args)
        .output()
        .await
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}
