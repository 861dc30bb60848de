//! One container of a workload started as the kubelet would start it, but as a process on
//! loopback: its `args` to the image's entrypoint (the `sandgate` binary), only the environment
//! its `env` declares (`value` with `$(VAR)` expansion, `fieldRef`, `secretKeyRef`,
//! `configMapKeyRef`), and its volumes materialized under a directory of its own.
//!
//! Two translations stand in for what a pod has and a process on a shared host has not, and
//! they are applied the same way to every string the pod sees (environment, ConfigMap files,
//! Secret values): a mount path `/etc/sandgate/tls` becomes `<root>/etc/sandgate/tls` (a path
//! no volume mounts stays as written, so it fails as it would in the pod), and a declared
//! container port bound on the pod's addresses (`0.0.0.0:P`, `$(POD_IP):P`) becomes a free
//! loopback port. A port the manifest binds but does not declare is left as written, and the
//! test refuses it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::Value;
use tokio::process::{Child, Command};

use super::manifests::{Manifests, Workload, ports, text};
use crate::support::BIN;

/// The pod's IP: the test's loopback.
pub const POD_IP: &str = "127.0.0.1";

/// What the test gives the pods: Secret values, ConfigMap edits, the engine's socket.
#[derive(Debug)]
pub struct Kubelet<'a> {
    pub manifests: &'a Manifests,
    /// (Secret, key) → the test's value for that template key.
    pub secrets: BTreeMap<(String, String), String>,
    /// (whole line of a ConfigMap file, its replacement): the placeholders an operator fills.
    pub config_edits: Vec<(String, String)>,
    /// Where hostPath mounts point: (host path in the manifest, path on this host).
    pub host_paths: Vec<(String, PathBuf)>,
    /// The directory every pod's files go under.
    pub root: PathBuf,
}

/// A started container.
#[allow(missing_debug_implementations)] // holds a child process
pub struct Container {
    pub what: String,
    pub child: Child,
    /// Its environment as the process got it.
    pub env: Vec<(String, String)>,
    /// Declared ports: (name, container port, loopback port it is on here).
    pub ports: Vec<(String, u16, u16)>,
    /// The container spec.
    pub spec: Value,
    log: PathBuf,
}

impl Container {
    /// What the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The loopback port a probe's `port` (a name or a number) names.
    pub fn probe_port(&self, port: &Value) -> u16 {
        let found = self.ports.iter().find(|(name, number, _)| match port {
            Value::String(s) => name == s,
            Value::Number(n) => n.as_u64() == Some(u64::from(*number)),
            _ => false,
        });
        found
            .unwrap_or_else(|| {
                panic!(
                    "{}: a probe names the port {port}, which the container does not declare",
                    self.what
                )
            })
            .2
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Replaces every mount path in `value` that stands as a path (not inside a longer word) by
/// the same path under `root`, in one pass (so a rewritten path is not rewritten again).
fn rebase(value: &str, mounts: &[String], root: &Path) -> String {
    let mut out = String::new();
    let mut rest = value;
    let mut prev: Option<char> = None;
    'outer: while !rest.is_empty() {
        if prev.is_none_or(|c| !c.is_alphanumeric() && c != '.' && c != '_' && c != '-') {
            for mount in mounts {
                if let Some(after) = rest.strip_prefix(mount.as_str())
                    && after
                        .chars()
                        .next()
                        .is_none_or(|c| !c.is_alphanumeric() && c != '.' && c != '_' && c != '-')
                {
                    out.push_str(&format!("{}{mount}", root.display()));
                    prev = mount.chars().last();
                    rest = after;
                    continue 'outer;
                }
            }
        }
        let c = rest.chars().next().expect("not empty");
        out.push(c);
        prev = Some(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `$(NAME)` replaced by the value of a variable declared before it, as the kubelet does.
fn expand(value: &str, earlier: &[(String, String)]) -> String {
    let mut out = value.to_owned();
    for (name, v) in earlier {
        out = out.replace(&format!("$({name})"), v);
    }
    out
}

impl Kubelet<'_> {
    fn secret(&self, name: &str, key: &str) -> String {
        self.secrets
            .get(&(name.to_owned(), key.to_owned()))
            .unwrap_or_else(|| {
                panic!("the Secret template {name} has the key {key} that a pod reads")
            })
            .clone()
    }

    fn config_file(&self, content: &str) -> String {
        content
            .lines()
            .map(|line| {
                self.config_edits
                    .iter()
                    .find(|(from, _)| from == line.trim())
                    .map_or(line.to_owned(), |(_, to)| to.clone())
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Makes the files of `mount` (a volumeMount of `workload`) under `root`.
    fn materialize(&self, workload: &Workload, mount: &Value, root: &Path, mounts: &[String]) {
        let path = text(&mount["mountPath"], "a mountPath");
        let target = root.join(path.trim_start_matches('/'));
        let volume = workload.volume(text(&mount["name"], "a mount's name"));
        let files: Vec<(String, String)> = if let Some(cm) = volume.get("configMap") {
            self.manifests
                .config_map(text(&cm["name"], "a ConfigMap name"))
                .into_iter()
                .map(|(k, v)| (k, rebase(&self.config_file(&v), mounts, root)))
                .collect()
        } else if let Some(secret) = volume.get("secret") {
            let name = text(&secret["secretName"], "a secretName");
            self.manifests
                .secret_keys(name)
                .into_iter()
                .map(|k| {
                    let value = rebase(&self.secret(name, &k), mounts, root);
                    (k, value)
                })
                .collect()
        } else if volume.get("emptyDir").is_some() {
            std::fs::create_dir_all(&target).expect("an emptyDir");
            return;
        } else if let Some(host) = volume.get("hostPath") {
            let host = text(&host["path"], "a hostPath");
            let (_, here) = self
                .host_paths
                .iter()
                .find(|(p, _)| p == host)
                .unwrap_or_else(|| panic!("the test knows what the hostPath {host} is here"));
            std::fs::create_dir_all(target.parent().expect("a parent")).expect("its parent");
            std::os::unix::fs::symlink(here, &target).expect("the hostPath link");
            return;
        } else {
            panic!("{}: a volume kind the test knows: {volume}", workload.what);
        };
        match mount["subPath"].as_str() {
            Some(sub) => {
                let (_, content) = files.iter().find(|(k, _)| k == sub).unwrap_or_else(|| {
                    panic!("{}: the volume has the subPath {sub}", workload.what)
                });
                std::fs::create_dir_all(target.parent().expect("a parent")).expect("its parent");
                std::fs::write(&target, content).expect("the subPath file");
            }
            None => {
                std::fs::create_dir_all(&target).expect("the volume's directory");
                for (k, content) in files {
                    std::fs::write(target.join(k), content).expect("a volume file");
                }
            }
        }
    }

    /// The container's environment, translated (see the module).
    fn env(
        &self,
        workload: &Workload,
        container: &Value,
        mounts: &[String],
        root: &Path,
        ports: &[(String, u16, u16)],
    ) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = Vec::new();
        for var in container["env"].as_array().cloned().unwrap_or_default() {
            let name = text(&var["name"], "an env name").to_owned();
            let from = &var["valueFrom"];
            let value = if let Some(v) = var["value"].as_str() {
                expand(v, &env)
            } else if let Some(field) = from["fieldRef"]["fieldPath"].as_str() {
                assert_eq!(
                    field, "status.podIP",
                    "{}: a fieldRef the test knows",
                    workload.what
                );
                POD_IP.to_owned()
            } else if let Some(r) = from.get("secretKeyRef") {
                self.secret(text(&r["name"], "a Secret"), text(&r["key"], "a key"))
            } else if let Some(r) = from.get("configMapKeyRef") {
                let data = self.manifests.config_map(text(&r["name"], "a ConfigMap"));
                data.get(text(&r["key"], "a key"))
                    .expect("the ConfigMap key")
                    .clone()
            } else {
                panic!("{}: {name} has a value the test knows", workload.what);
            };
            let mut value = rebase(&value, mounts, root);
            for (_, port, here) in ports {
                for host in ["0.0.0.0", POD_IP] {
                    value = value.replace(&format!("{host}:{port}"), &format!("127.0.0.1:{here}"));
                }
            }
            env.push((name, value));
        }
        env
    }

    /// Starts `container` of `workload`.
    pub fn start(&self, workload: &Workload, container: &Value) -> Container {
        let what = format!(
            "{}/{}",
            workload.what,
            text(&container["name"], "a container name")
        );
        let root = self.root.join(what.replace('/', "_"));
        std::fs::create_dir_all(&root).expect("the pod's directory");
        let mount_list = container["volumeMounts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut mounts: Vec<String> = mount_list
            .iter()
            .map(|m| text(&m["mountPath"], "a mountPath").to_owned())
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mount in &mount_list {
            self.materialize(workload, mount, &root, &mounts);
        }
        let ports: Vec<(String, u16, u16)> = ports(container)
            .into_iter()
            .map(|(name, port)| (name, port, free_port()))
            .collect();
        let env = self.env(workload, container, &mounts, &root, &ports);
        let args: Vec<String> = container["args"]
            .as_array()
            .map(|a| a.iter().map(|v| text(v, "an arg").to_owned()).collect())
            .unwrap_or_default();
        let log = root.join("stderr.log");
        let child = Command::new(BIN)
            .args(&args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the log file"))
            .kill_on_drop(true)
            .spawn()
            .expect("the binary starts");
        Container {
            what,
            child,
            env,
            ports,
            spec: container.clone(),
            log,
        }
    }
}
