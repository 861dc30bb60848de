//! Every container of `deploy/kubernetes/` run as the kubelet would run it (issue 25): the real
//! binary with the container's args, only the environment its `env` declares (from the
//! ConfigMap and the Secret templates filled with test values), its volumes, on its declared
//! ports (translated to loopback: see `pod.rs`), against a Postgres of the test's own that
//! serves only TLS with the deployment's roles (`deploy/postgres/roles.sql`) and the stack's
//! Docker engine. The migrate Job must finish; every startup, liveness and readiness probe of
//! the nodes and gateways must answer on the port it names; every `SANDGATE_*` variable must be
//! a configuration key (the binary refuses an unknown one: a misspelt copy shows it); and the
//! NetworkPolicies must let through every connection the processes make or serve, and nothing
//! from a peer that has no business there.
//!
//! Not reproduced here: the user and group the pods run as, the read-only root filesystem and
//! the dropped capabilities (the process runs as the test's user).

mod manifests;
mod pod;
mod policy;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sandgate_node::test_pki::{Leaf, Pki};
use serde_json::{Value, json};

use super::repo_root;
use crate::support::own_postgres::{GATEWAY, MIGRATOR, NODE, OwnPostgres};
use crate::support::{node::sandbox_image, remove_containers_of};
use manifests::{Manifests, Workload, ports};
use pod::{Container, Kubelet, POD_IP};
use policy::{NAMESPACE, Peer, connects};

/// A release's migrations, a node's start (its engine, its warm pool) on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(180);
/// The Postgres port of the Secret templates' URLs (`postgres://…@HOST:5432/…`).
const POSTGRES_PORT: u16 = 5432;
/// Where the CA bundle of the database is in every pod (the Secret templates' `sslrootcert`).
const DB_CA: &str = "/etc/sandgate/db-ca/ca.crt";

/// The test's value for every key of every Secret template.
fn secret_values(
    server: &OwnPostgres,
    db_ca: &Pki,
    pki: &Pki,
) -> BTreeMap<(String, String), String> {
    let url = |(user, password): (&str, &str)| {
        server.verify_full_url(user, password, "sandgate", std::path::Path::new(DB_CA))
    };
    let (gateway_cert, gateway_key) = pki.leaf_pem_of(Leaf::Gateway, &["sandgate-gateway"]);
    let (node_cert, node_key) = pki.leaf_pem_of(Leaf::Node, &[POD_IP]);
    let values = [
        ("sandgate-secrets", "gateway-database-url", url(GATEWAY)),
        ("sandgate-secrets", "node-database-url", url(NODE)),
        ("sandgate-secrets", "migrator-database-url", url(MIGRATOR)),
        (
            "sandgate-secrets",
            "keys-secret",
            "a keys secret of the kubelet test, 32+ chars".into(),
        ),
        (
            "sandgate-secrets",
            "cookie-secret",
            "a cookie secret of the kubelet test, 32+ chars".into(),
        ),
        (
            "sandgate-secrets",
            "egress-secrets-key",
            "an egress secrets key of the kubelet test, 32+ chars".into(),
        ),
        ("sandgate-db-ca", "ca.crt", db_ca.ca_pem()),
        ("sandgate-gateway-tls", "tls.crt", gateway_cert),
        ("sandgate-gateway-tls", "tls.key", gateway_key),
        ("sandgate-gateway-tls", "ca.crt", pki.ca_pem()),
        ("sandgate-node-tls", "tls.crt", node_cert),
        ("sandgate-node-tls", "tls.key", node_key),
        ("sandgate-node-tls", "ca.crt", pki.ca_pem()),
    ];
    values
        .into_iter()
        .map(|(s, k, v)| ((s.to_owned(), k.to_owned()), v))
        .collect()
}

/// The ConfigMap's lines an operator fills in: the sandbox image, and the instance (a name of
/// the test's own: the stack's engine is shared).
fn config_edits(manifests: &Manifests, instance: &str) -> Vec<(String, String)> {
    let config = manifests.config_map("sandgate-config");
    let file = config
        .get("config.toml")
        .expect("the ConfigMap has config.toml");
    let edits: Vec<(String, String)> = file
        .lines()
        .map(str::trim)
        .filter_map(|line| {
            if line.starts_with("instance = ") {
                Some((line.to_owned(), format!("instance = \"{instance}\"")))
            } else if line.starts_with("image = ") && line.contains("REPLACE") {
                Some((line.to_owned(), format!("image = \"{}\"", sandbox_image())))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        edits.len(),
        2,
        "config.toml has an instance and a sandbox image placeholder: {edits:?}"
    );
    edits
}

fn docker_socket() -> PathBuf {
    let host = std::env::var("DOCKER_HOST").unwrap_or_default();
    PathBuf::from(
        host.strip_prefix("unix://")
            .unwrap_or("/var/run/docker.sock"),
    )
}

/// Waits for a Job's container to exit; returns whether it succeeded.
async fn finishes(container: &mut Container) -> bool {
    tokio::time::timeout(DEADLINE, container.child.wait())
        .await
        .unwrap_or_else(|_| panic!("{} finished within {DEADLINE:?}", container.what))
        .expect("its status")
        .success()
}

/// Polls `probe` (an httpGet probe) of `container` until it answers 2xx/3xx, as the kubelet
/// counts success; panics if the process exits first.
async fn answers(container: &mut Container, kind: &str) {
    let probe = container.spec[kind].clone();
    let get = probe["httpGet"].as_object().unwrap_or_else(|| {
        panic!(
            "{}: its {kind} is an httpGet probe: {probe}",
            container.what
        )
    });
    let port = container.probe_port(&get["port"]);
    let path = get["path"].as_str().unwrap_or("/");
    let timeout = Duration::from_secs(probe["timeoutSeconds"].as_u64().unwrap_or(1));
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("a client");
    let url = format!("http://127.0.0.1:{port}{path}");
    let start = Instant::now();
    loop {
        if let Some(status) = container.child.try_wait().expect("its status") {
            panic!(
                "{} exited ({status}) before its {kind} answered:\n{}",
                container.what,
                container.log()
            );
        }
        let last = match client.get(&url).send().await {
            Ok(r) if (200..400).contains(&r.status().as_u16()) => return,
            Ok(r) => format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
            Err(e) => e.to_string(),
        };
        assert!(
            start.elapsed() < DEADLINE,
            "{}: its {kind} ({path} on {}) answered within {DEADLINE:?}; last: {last}\n{}",
            container.what,
            get["port"],
            container.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The migrate Job runs to completion, and a misspelt variable in its environment is refused.
async fn migrate(kubelet: &Kubelet<'_>, job: &Workload) {
    let container = job.containers().remove(0);
    let mut run = kubelet.start(job, &container);
    assert!(
        finishes(&mut run).await,
        "{} succeeds:\n{}",
        run.what,
        run.log()
    );

    let mut misspelt = container.clone();
    misspelt["env"]
        .as_array_mut()
        .expect("the Job has env")
        .push(json!({"name": "SANDGATE_DATABASE__AUTO_MIGRATEE", "value": "false"}));
    let mut run = kubelet.start(job, &misspelt);
    assert!(
        !finishes(&mut run).await,
        "an unknown SANDGATE_ variable is refused"
    );
    assert!(
        run.log().contains("auto_migratee"),
        "the refusal names the unknown key:\n{}",
        run.log()
    );
}

/// Who connects to a port the process binds, by the configuration key that binds it.
fn clients_of(key: &str, gateways: &[Peer]) -> Vec<Peer> {
    match key {
        "SANDGATE_LISTEN" => vec![Peer::pod(
            "ingress-nginx",
            &[("app.kubernetes.io/name", "ingress-nginx")],
        )],
        "SANDGATE_METRICS__LISTEN" => vec![Peer::pod(
            "monitoring",
            &[("app.kubernetes.io/name", "prometheus")],
        )],
        "SANDGATE_NODE__LISTEN" => gateways.to_vec(),
        other => panic!("a listening key the test knows: {other}"),
    }
}

fn peer_of(workload: &Workload, container: &Value) -> Peer {
    Peer::Pod {
        namespace: NAMESPACE.to_owned(),
        labels: workload.labels.clone(),
        ports: ports(container),
    }
}

/// The NetworkPolicies let through every connection to a declared port from who uses it, and
/// from no other peer; and every process's connections out (Postgres, the package index).
fn check_policies(manifests: &Manifests, running: &[(Workload, Container)], jobs: &[Workload]) {
    let policies = manifests.network_policies();
    let gateways: Vec<Peer> = running
        .iter()
        .filter(|(_, c)| {
            c.spec["args"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v == "serve"))
        })
        .map(|(w, c)| peer_of(w, &c.spec))
        .collect();
    assert!(!gateways.is_empty(), "a gateway runs");
    let mut used: Vec<(Peer, Peer, u16, String)> = Vec::new();
    for (workload, container) in running {
        let server = peer_of(workload, &container.spec);
        for (name, port, here) in &container.ports {
            let bound = format!("127.0.0.1:{here}");
            let (key, _) = container
                .env
                .iter()
                .find(|(k, v)| k.ends_with("LISTEN") && *v == bound)
                .unwrap_or_else(|| {
                    panic!(
                        "{}: the declared port {name} ({port}) is bound by a *LISTEN variable",
                        container.what
                    )
                });
            for client in clients_of(key, &gateways) {
                used.push((
                    client,
                    server.clone(),
                    *port,
                    format!("{key} of {}", container.what),
                ));
            }
        }
    }
    let postgres = Peer::Pod {
        namespace: NAMESPACE.to_owned(),
        labels: [("app.kubernetes.io/name".to_owned(), "postgres".to_owned())].into(),
        ports: vec![("postgres".into(), POSTGRES_PORT)],
    };
    let mut outgoing: Vec<(Workload, Value)> = running
        .iter()
        .map(|(w, c)| (w.clone(), c.spec.clone()))
        .collect();
    outgoing.extend(
        jobs.iter()
            .flat_map(|j| j.containers().into_iter().map(|c| (j.clone(), c))),
    );
    for (workload, container) in &outgoing {
        let me = peer_of(workload, container);
        used.push((
            me.clone(),
            postgres.clone(),
            POSTGRES_PORT,
            format!("{} to Postgres", workload.what),
        ));
    }
    for gateway in &gateways {
        // The package index the gateway's relay downloads from (packages.index_url, HTTPS).
        let index = Peer::External(Ipv4Addr::new(198, 51, 100, 7));
        used.push((
            gateway.clone(),
            index,
            443,
            "a gateway to the package index".into(),
        ));
    }
    check_https_out(&policies, &gateways, &outgoing);
    for (client, server, port, what) in &used {
        assert!(
            connects(&policies, client, server, *port),
            "the NetworkPolicies let through {what} (port {port}) from {client:?}"
        );
    }
    // The attacker: a pod of another namespace wearing a gateway's labels, and every user of
    // one port trying the others.
    let intruder = Peer::pod(
        "elsewhere",
        &[("app.kubernetes.io/name", "sandgate-gateway")],
    );
    for (_, server, port, what) in &used {
        if matches!(server, Peer::Pod { .. }) {
            assert!(
                !connects(&policies, &intruder, server, *port),
                "{what}: a pod of another namespace is refused"
            );
        }
        for (other, _, _, _) in &used {
            let allowed = used.iter().any(|(c, s, p, _)| {
                p == port
                    && format!("{c:?}") == format!("{other:?}")
                    && format!("{s:?}") == format!("{server:?}")
            });
            if !allowed
                && !matches!(other, Peer::External(_))
                && !matches!(server, Peer::External(_))
            {
                assert!(
                    !connects(&policies, other, server, *port),
                    "{what} (port {port}): {other:?}, which has no use for it, is refused"
                );
            }
        }
    }
}

/// HTTPS out is as narrow as the design allows: only the gateways (they download the wheels;
/// nodes relay, the Job needs nothing outside) reach the package index, on 443 only, and never a
/// private or metadata address.
fn check_https_out(policies: &[Value], gateways: &[Peer], outgoing: &[(Workload, Value)]) {
    let index = Peer::External(Ipv4Addr::new(198, 51, 100, 7));
    for (workload, container) in outgoing {
        let me = peer_of(workload, container);
        if gateways
            .iter()
            .any(|g| format!("{g:?}") == format!("{me:?}"))
        {
            continue;
        }
        assert!(
            !connects(policies, &me, &index, 443),
            "{} has no business outside the cluster: the https-out policy leaves it out",
            workload.what
        );
    }
    for gateway in gateways {
        for port in [80, 8443, 22] {
            assert!(
                !connects(policies, gateway, &index, port),
                "a gateway reaches the index on 443 only, not {port}"
            );
        }
        for private in [
            Ipv4Addr::new(10, 1, 2, 3),
            Ipv4Addr::new(172, 20, 0, 1),
            Ipv4Addr::new(192, 168, 1, 1),
            Ipv4Addr::new(169, 254, 169, 254),
            Ipv4Addr::new(100, 64, 0, 1),
        ] {
            assert!(
                !connects(policies, gateway, &Peer::External(private), 443),
                "a gateway's https-out excludes {private} (private or metadata)"
            );
        }
    }
}

/// The ConfigMap names the package index, and every gateway container has a writable volume at
/// `packages.cache_dir` (its root filesystem is read-only).
fn check_packages(manifests: &Manifests, workloads: &[Workload]) {
    let config = manifests.config_map("sandgate-config");
    let file = config.get("config.toml").expect("config.toml");
    // The `[packages]` table's `key = "value"` lines (the test has no TOML parser; the
    // ConfigMap writes plain strings).
    let value = |key: &str| {
        file.lines()
            .map(str::trim)
            .skip_while(|l| *l != "[packages]")
            .skip(1)
            .take_while(|l| !l.starts_with('['))
            .find_map(|l| l.strip_prefix(key)?.trim().strip_prefix('=').map(str::trim))
            .map(|v| v.trim_matches('"').to_owned())
    };
    let index = value("index_url").unwrap_or_default();
    assert!(
        index.starts_with("https://") && index.len() > "https://".len(),
        "the ConfigMap sets packages.index_url to an https URL: {index:?}"
    );
    let cache_dir = value("cache_dir").expect("the ConfigMap sets packages.cache_dir");
    let mut gateways = 0;
    for workload in workloads {
        for container in workload.containers() {
            let serves = container["args"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v == "serve"));
            if !serves {
                continue;
            }
            gateways += 1;
            let mount = container["volumeMounts"]
                .as_array()
                .and_then(|m| m.iter().find(|m| m["mountPath"] == cache_dir.as_str()))
                .unwrap_or_else(|| panic!("{}: a volume is mounted at {cache_dir}", workload.what));
            assert_ne!(
                mount["readOnly"],
                Value::Bool(true),
                "{}: the package cache is writable",
                workload.what
            );
            let volume = workload.volume(mount["name"].as_str().expect("a mount name"));
            assert!(
                volume.get("emptyDir").is_some() || volume.get("persistentVolumeClaim").is_some(),
                "{}: the package cache is a writable volume: {volume}",
                workload.what
            );
        }
    }
    assert!(gateways > 0, "a gateway container was checked");
}

#[tokio::test]
async fn every_kubernetes_container_runs_as_the_kubelet_would_and_answers_its_probes() {
    let manifests = Manifests::load(&repo_root().join("deploy/kubernetes"));
    let db_ca = Pki::new("kubelet test Postgres CA");
    let server = OwnPostgres::with_roles(&db_ca).await;
    let pki = Pki::new("kubelet test deployment CA");
    let secrets = secret_values(&server, &db_ca, &pki);
    let mut template_keys = manifests.all_secret_keys();
    template_keys.sort();
    assert_eq!(
        template_keys,
        secrets.keys().cloned().collect::<Vec<_>>(),
        "the test has a value for every key of the Secret templates, and no other"
    );
    let instance = format!(
        "e2e-kubelet-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let root = std::env::temp_dir().join(&instance);
    let _cleanup = Cleanup {
        instance: instance.clone(),
        root: root.clone(),
    };
    let kubelet = Kubelet {
        manifests: &manifests,
        secrets,
        config_edits: config_edits(&manifests, &instance),
        host_paths: vec![("/var/run/docker.sock".into(), docker_socket())],
        root: root.clone(),
    };

    let (jobs, workloads): (Vec<Workload>, Vec<Workload>) = manifests
        .workloads()
        .into_iter()
        .partition(|w| w.what.starts_with("Job/"));
    assert!(
        !jobs.is_empty() && workloads.len() >= 2,
        "a migrate Job, nodes and gateways"
    );
    check_packages(&manifests, &workloads);
    for job in &jobs {
        migrate(&kubelet, job).await;
    }
    let mut running: Vec<(Workload, Container)> = Vec::new();
    for workload in &workloads {
        for spec in workload.containers() {
            let mut container = kubelet.start(workload, &spec);
            for (key, value) in &container.env {
                assert!(
                    !value.contains("0.0.0.0:"),
                    "{}: {key}={value} binds a port the container does not declare",
                    container.what
                );
            }
            for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
                answers(&mut container, kind).await;
            }
            running.push((workload.clone(), container));
        }
    }
    check_policies(&manifests, &running, &jobs);
    // The processes stop (kill_on_drop) before _cleanup removes their containers and files.
    drop(running);
}

/// Removes the test's sandbox containers and pod files, whether it passed or failed.
#[derive(Debug)]
struct Cleanup {
    instance: String,
    root: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_containers_of(&self.instance);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
