//! `deploy/kubernetes/` validated offline: every manifest against the Kubernetes schemas that
//! PyPI's `kubernetes-validate` ships (no API server can run here), strictly (unknown fields are
//! errors), for the oldest Kubernetes we claim and the newest the package knows. And the
//! validation can fail: broken copies of a manifest are rejected.
//!
//! The interpreter comes from `SANDGATE_TEST_PYTHON` (the venv `scripts/py-venv.sh` builds from
//! `tests/python-requirements.txt`, which lists `kubernetes-validate`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{repo_root, run};

/// The oldest Kubernetes release the manifests are written for (docs/scale-out.md).
const OLDEST: &str = "1.30.0";
const DEADLINE: Duration = Duration::from_secs(120);

fn python() -> String {
    std::env::var("SANDGATE_TEST_PYTHON").expect(
        "SANDGATE_TEST_PYTHON is not set: it must name a Python with kubernetes-validate \
         (scripts/test.sh sets it from scripts/py-venv.sh, which installs tests/python-requirements.txt)",
    )
}

fn manifests_dir() -> PathBuf {
    repo_root().join("deploy/kubernetes")
}

/// Every manifest: the `*.yaml` files of the directory but kustomization.yaml.
fn manifests(dir: &Path) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("deploy/kubernetes is there")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    files.sort();
    files
}

/// Runs kubernetes-validate --strict over `files` in `dir` for Kubernetes `version` (None: the
/// package's newest); returns (success, stdout + stderr).
async fn validate(dir: &Path, files: &[String], version: Option<&str>) -> (bool, String) {
    let python = python();
    let paths: Vec<String> = files
        .iter()
        .map(|f| dir.join(f).to_string_lossy().into_owned())
        .collect();
    let mut args = vec!["-m", "kubernetes_validate", "--strict"];
    if let Some(version) = version {
        args.extend(["--kubernetes-version", version]);
    }
    args.extend(paths.iter().map(String::as_str));
    let output = run(&python, &args, DEADLINE).await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !text.contains("No module named kubernetes_validate"),
        "{python} has kubernetes-validate (scripts/py-venv.sh installs it): {text}"
    );
    (output.status.success(), text)
}

#[tokio::test]
async fn every_kubernetes_manifest_passes_offline_validation() {
    let dir = manifests_dir();
    let files = manifests(&dir);
    assert!(
        files.len() >= 5,
        "manifests in deploy/kubernetes: {files:?}"
    );
    for version in [Some(OLDEST), None] {
        let (ok, output) = validate(&dir, &files, version).await;
        assert!(
            ok,
            "the manifests are valid for Kubernetes {version:?}:\n{output}"
        );
        for file in &files {
            assert!(
                output.contains(&format!("{file} passed")),
                "{file} was validated (Kubernetes {version:?}):\n{output}"
            );
        }
    }

    // kustomization.yaml applies exactly these files: none is forgotten, none is missing.
    let listed = run(
        &python(),
        &[
            "-c",
            "import json, sys, yaml; print(json.dumps(sorted(yaml.safe_load(open(sys.argv[1]))['resources'])))",
            dir.join("kustomization.yaml").to_str().expect("a UTF-8 path"),
        ],
        DEADLINE,
    )
    .await;
    assert!(
        listed.status.success(),
        "kustomization.yaml parses: {listed:?}"
    );
    let listed: Vec<String> =
        serde_json::from_slice(&listed.stdout).expect("a JSON list of resources");
    assert_eq!(listed, files, "kustomization.yaml lists every manifest");
}

/// No real secret is committed: every value of every Secret is a REPLACE_ME placeholder.
#[tokio::test]
async fn the_secrets_are_templates_without_a_value() {
    let script = "import sys, yaml\n\
                  for doc in yaml.safe_load_all(open(sys.argv[1])):\n\
                  \x20   if doc and doc.get('kind') == 'Secret':\n\
                  \x20       assert 'data' not in doc, doc['metadata']['name'] + ' has base64 data'\n\
                  \x20       for key, value in doc['stringData'].items():\n\
                  \x20           assert value.startswith('REPLACE_ME'), doc['metadata']['name'] + '/' + key\n\
                  \x20           print(doc['metadata']['name'] + '/' + key)\n";
    let dir = manifests_dir();
    let mut checked = Vec::new();
    for file in manifests(&dir) {
        let output = run(
            &python(),
            &[
                "-c",
                script,
                dir.join(&file).to_str().expect("a UTF-8 path"),
            ],
            DEADLINE,
        )
        .await;
        assert!(
            output.status.success(),
            "{file}: a Secret value is not a REPLACE_ME placeholder:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        checked.extend(
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .map(str::to_owned),
        );
    }
    assert!(
        checked.iter().any(|k| k == "sandgate-secrets/keys-secret")
            && checked.iter().any(|k| k == "sandgate-node-tls/tls.key"),
        "the key and TLS Secrets were checked: {checked:?}"
    );
}

/// The validation can fail: broken copies of the gateway's manifest, in a directory of their
/// own, are rejected and named.
#[tokio::test]
async fn a_broken_manifest_is_rejected() {
    let original = std::fs::read_to_string(manifests_dir().join("gateway.yaml"))
        .expect("gateway.yaml is there");
    let dir = std::env::temp_dir().join(format!("sgk8s-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let broken = [
        // A value of the wrong type.
        (
            "wrong-type.yaml",
            "spec.replicas: 'two' is not of type 'integer'",
            original.replacen("replicas: 2", "replicas: two", 1),
        ),
        // A field Kubernetes does not have (a typo the API server would drop silently).
        (
            "unknown-field.yaml",
            "'replica' was unexpected",
            original.replacen("  replicas: 2", "  replicas: 2\n  replica: 2", 1),
        ),
        // A required field missing: a container without a name.
        (
            "missing-field.yaml",
            "'name' is a required property",
            original.replacen("        - name: gateway\n", "        - \n", 1),
        ),
    ];
    for (file, _, text) in &broken {
        assert_ne!(text, &original, "{file} differs from gateway.yaml");
        std::fs::write(dir.join(file), text).expect("the broken copy is written");
    }
    for (file, reason, _) in &broken {
        let (ok, output) = validate(&dir, &[(*file).to_owned()], Some(OLDEST)).await;
        assert!(!ok, "{file} is rejected:\n{output}");
        assert!(
            output.contains(&format!("{file} did not validate")) && output.contains(reason),
            "the failure names {file} and says {reason:?}:\n{output}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `sandgate --config <config.toml of the ConfigMap, edited by `edit`> migrate` against a
/// database that is not there; returns stderr. The configuration is validated as a whole before
/// the command runs, so an accepted one fails only later, at the database.
async fn migrate_with_configmap(edit: impl Fn(String) -> String) -> String {
    let dir = std::env::temp_dir().join(format!("sgk8s-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let config = dir.join("config.toml");
    let extracted = run(
        &python(),
        &[
            "-c",
            "import sys, yaml; sys.stdout.write(yaml.safe_load(open(sys.argv[1]))['data']['config.toml'])",
            manifests_dir()
                .join("configmap.yaml")
                .to_str()
                .expect("a UTF-8 path"),
        ],
        DEADLINE,
    )
    .await;
    assert!(
        extracted.status.success(),
        "configmap.yaml has config.toml: {extracted:?}"
    );
    let toml = String::from_utf8(extracted.stdout).expect("UTF-8");
    std::fs::write(&config, edit(toml)).expect("the configuration is written");
    // What the Deployment and DaemonSet give as environment (the secrets), with a database
    // nobody listens on.
    let output = crate::support::sandgate_command()
        .args([
            "--config",
            config.to_str().expect("a UTF-8 path"),
            "migrate",
        ])
        .env_remove("SANDGATE_SANDBOX__IMAGE")
        .env("SANDGATE_LISTEN", "0.0.0.0:8080")
        .env(
            "SANDGATE_DATABASE__URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .env("SANDGATE_DATABASE__ACQUIRE_TIMEOUT_MS", "100")
        .env("SANDGATE_KEYS__SECRET", "k".repeat(48))
        .env("SANDGATE_OAUTH__COOKIE_SECRET", "c".repeat(48))
        .output()
        .await
        .expect("the sandgate binary runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!output.status.success(), "there is no database to migrate");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The ConfigMap's config.toml is a configuration sandgate accepts (it refuses unknown keys and
/// bad values at start-up, which on Kubernetes would be a crash loop), and the check can fail.
#[tokio::test]
async fn the_configmap_is_a_configuration_sandgate_accepts() {
    let accepted = migrate_with_configmap(|toml| toml).await;
    assert!(
        accepted.contains("migrating") && !accepted.contains("invalid configuration"),
        "the ConfigMap's configuration passes validation (and only the database is missing):\n{accepted}"
    );
    let typo = migrate_with_configmap(|toml| toml.replace("min_ready = 2", "min_readdy = 2")).await;
    assert!(
        typo.contains("invalid configuration") && typo.contains("min_readdy"),
        "a typo in the ConfigMap is refused naming the key:\n{typo}"
    );
}

/// Every document of the YAML file `path`, as JSON values.
fn yaml_docs(path: &Path) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{} is there: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            serde_json::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is YAML: {e}", path.display()))
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

/// The one document of `kind` in `path`.
fn doc_of_kind(path: &Path, kind: &str) -> serde_json::Value {
    let mut of_kind: Vec<serde_json::Value> = yaml_docs(path)
        .into_iter()
        .filter(|d| d["kind"] == kind)
        .collect();
    assert_eq!(of_kind.len(), 1, "one {kind} in {}", path.display());
    of_kind.remove(0)
}

/// The Ingress (validated with the other manifests above) says to ingress-nginx what a proxy in
/// front of the gateways must do: no buffering, reads at least as long as a call may last
/// (limits.max_call_timeout_seconds), TLS from a Secret, and only the gateways' public port
/// (their /metrics is on another one).
#[tokio::test]
async fn the_ingress_streams_waits_for_long_calls_and_exposes_only_the_public_port() {
    let ingress = doc_of_kind(&manifests_dir().join("ingress.yaml"), "Ingress");
    let annotation = |key: &str| {
        ingress["metadata"]["annotations"][format!("nginx.ingress.kubernetes.io/{key}")]
            .as_str()
            .unwrap_or_else(|| panic!("the Ingress sets nginx.ingress.kubernetes.io/{key}"))
            .to_owned()
    };
    assert_eq!(annotation("proxy-buffering"), "off", "SSE is not buffered");
    let max_call: u64 = crate::support::front::repo_file("config/default.toml")
        .lines()
        .find_map(|l| l.strip_prefix("max_call_timeout_seconds = "))
        .and_then(|v| v.trim().parse().ok())
        .expect("config/default.toml has limits.max_call_timeout_seconds");
    for key in ["proxy-read-timeout", "proxy-send-timeout"] {
        let seconds: u64 = annotation(key).parse().expect("seconds");
        assert!(
            seconds >= max_call,
            "{key} {seconds} s is at least limits.max_call_timeout_seconds ({max_call} s)"
        );
    }
    assert_eq!(ingress["spec"]["ingressClassName"], "nginx");
    let tls = &ingress["spec"]["tls"][0];
    assert!(
        tls["secretName"].as_str().is_some_and(|s| !s.is_empty()),
        "TLS from a Secret: {tls}"
    );
    // The host is public_url's (the gateways accept no other Host).
    let configmap = doc_of_kind(&manifests_dir().join("configmap.yaml"), "ConfigMap");
    let host = &ingress["spec"]["rules"][0]["host"];
    assert!(
        configmap["data"]["config.toml"]
            .as_str()
            .is_some_and(|c| c.contains(&format!(
                "public_url = \"https://{}\"",
                host.as_str().unwrap_or("?")
            ))),
        "the Ingress's host {host} is the ConfigMap's public_url host"
    );
    assert_eq!(
        tls["hosts"][0], *host,
        "the TLS certificate is for the rule's host"
    );
    let backend = &ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"];
    assert_eq!(backend["name"], "sandgate-gateway");
    let service = doc_of_kind(&manifests_dir().join("gateway.yaml"), "Service");
    let ports = service["spec"]["ports"].as_array().expect("ports");
    assert_eq!(
        ports.len(),
        1,
        "the gateways' Service has one port: {ports:?}"
    );
    assert_eq!(ports[0]["name"], backend["port"]["name"]);
    assert_eq!(
        ports[0]["targetPort"], "http",
        "the Ingress reaches the gateways' public port, never metrics"
    );
}

/// `env` of a container without the variables in `names`.
fn env_without(container: &serde_json::Value, names: &[&str]) -> serde_json::Value {
    let env: Vec<serde_json::Value> = container["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter(|e| !names.contains(&e["name"].as_str().unwrap_or_default()))
        .cloned()
        .collect();
    serde_json::Value::Array(env)
}

/// The value of the env var `name` of `container`.
fn env_value(container: &serde_json::Value, name: &str) -> String {
    container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == name))
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("the container sets {name}"))
        .to_owned()
}

/// The cert-manager csi-driver variant of the nodes (`deploy/kubernetes/node-tls-csi/`): its
/// StatefulSet and headless Service validate strictly against the Kubernetes schema (the csi
/// volume is a core field); the ClusterIssuer is a cert-manager resource, outside the strict
/// check (no cert-manager schema here), checked for its shape; the certificate each pod gets
/// names exactly what the pod advertises, with the node role; and the pod is node.yaml's but for
/// its certificate, its advertised name and the anti-affinity a DaemonSet implies.
#[tokio::test]
async fn the_csi_node_variant_validates_and_certifies_what_each_pod_advertises() {
    let csi_dir = manifests_dir().join("node-tls-csi");
    let files = vec!["node-statefulset.yaml".to_owned()];
    for version in [Some(OLDEST), None] {
        let (ok, output) = validate(&csi_dir, &files, version).await;
        assert!(
            ok && output.contains("node-statefulset.yaml passed"),
            "the csi variant is valid for Kubernetes {version:?}:\n{output}"
        );
    }
    let issuer = doc_of_kind(&csi_dir.join("issuer.yaml"), "ClusterIssuer");
    assert_eq!(issuer["apiVersion"], "cert-manager.io/v1");
    assert!(
        issuer["spec"]["ca"]["secretName"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "a CA issuer with the deployment CA's Secret: {issuer}"
    );

    let file = csi_dir.join("node-statefulset.yaml");
    let set = doc_of_kind(&file, "StatefulSet");
    let service = doc_of_kind(&file, "Service");
    assert_eq!(service["spec"]["clusterIP"], "None", "a headless Service");
    assert_eq!(
        set["spec"]["serviceName"], service["metadata"]["name"],
        "the pods' DNS names come from the headless Service"
    );
    let pod = &set["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let tls = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "tls"))
        .expect("the tls volume");
    assert_eq!(tls["csi"]["driver"], "csi.cert-manager.io");
    let attribute = |key: &str| {
        tls["csi"]["volumeAttributes"][format!("csi.cert-manager.io/{key}")]
            .as_str()
            .unwrap_or_else(|| panic!("the csi volume sets csi.cert-manager.io/{key}"))
            .to_owned()
    };
    assert_eq!(attribute("issuer-name"), issuer["metadata"]["name"]);
    assert_eq!(attribute("issuer-kind"), "ClusterIssuer");
    assert_eq!(
        attribute("uri-sans"),
        "urn:sandgate:role:node",
        "the node role"
    );
    assert!(
        attribute("key-usages").contains("server auth")
            && !attribute("key-usages").contains("client auth"),
        "a node certificate is serverAuth only: {}",
        attribute("key-usages")
    );
    assert_eq!(
        attribute("fs-group"),
        pod["securityContext"]["runAsGroup"].to_string(),
        "the key is readable by the pod's group"
    );
    // The advertised host, with Kubernetes' $(VAR) written as the driver's ${VAR}, is the name
    // the certificate carries; and the Service's name is its second label.
    let advertised = env_value(container, "SANDGATE_NODE__ADVERTISE_URL");
    let host = advertised
        .strip_prefix("https://")
        .and_then(|rest| rest.rsplit_once(':'))
        .map(|(host, _)| host.replace("$(", "${").replace(')', "}"))
        .unwrap_or_else(|| panic!("an https://host:port URL: {advertised}"));
    assert_eq!(
        attribute("dns-names"),
        host,
        "the certificate names what the pod advertises"
    );
    assert_eq!(
        host.split('.').nth(1),
        service["metadata"]["name"].as_str(),
        "the advertised name is the headless Service's"
    );
    for var in ["POD_NAME", "POD_NAMESPACE"] {
        assert!(
            container["env"]
                .as_array()
                .is_some_and(|env| env.iter().any(|e| e["name"] == var)),
            "the container defines {var}, which the advertised URL uses"
        );
    }
    let required =
        &pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(
        required["topologyKey"], "kubernetes.io/hostname",
        "one node process per host, as a DaemonSet would have"
    );

    // The rest of the pod is node.yaml's.
    let daemonset = doc_of_kind(&manifests_dir().join("node.yaml"), "DaemonSet");
    assert_eq!(
        set["spec"]["template"]["metadata"], daemonset["spec"]["template"]["metadata"],
        "the same pod labels (the NetworkPolicies select them)"
    );
    let comparable = |pod: &serde_json::Value| {
        let mut pod = pod.clone();
        let obj = pod.as_object_mut().expect("a pod spec");
        obj.remove("affinity");
        let volumes: Vec<serde_json::Value> = obj["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .filter(|v| v["name"] != "tls")
            .cloned()
            .collect();
        obj.insert("volumes".into(), serde_json::Value::Array(volumes));
        let names = [
            "POD_IP",
            "POD_NAME",
            "POD_NAMESPACE",
            "SANDGATE_NODE__ADVERTISE_URL",
        ];
        let env = env_without(&obj["containers"][0], &names);
        obj.get_mut("containers").expect("containers")[0]["env"] = env;
        pod
    };
    assert_eq!(
        comparable(pod),
        comparable(&daemonset["spec"]["template"]["spec"]),
        "the csi variant's pod is node.yaml's but for its certificate, advertised name and anti-affinity"
    );

    // The component swaps node.yaml's DaemonSet and Secret for the StatefulSet; the base's
    // kustomization names it (commented out: the default is the pki.sh files).
    let component = doc_of_kind(&csi_dir.join("kustomization.yaml"), "Component");
    assert_eq!(
        component["resources"],
        serde_json::json!(["node-statefulset.yaml"])
    );
    let deleted: Vec<String> = component["patches"]
        .as_array()
        .expect("patches")
        .iter()
        .filter_map(|p| p["patch"].as_str())
        .filter(|p| p.contains("$patch: delete"))
        .map(str::to_owned)
        .collect();
    assert!(
        deleted
            .iter()
            .any(|p| p.contains("kind: DaemonSet") && p.contains("name: sandgate-node"))
            && deleted
                .iter()
                .any(|p| p.contains("kind: Secret") && p.contains("name: sandgate-node-tls")),
        "the component deletes node.yaml's DaemonSet and its Secret: {deleted:?}"
    );
    assert!(
        crate::support::front::repo_file("deploy/kubernetes/kustomization.yaml")
            .contains("#   - node-tls-csi"),
        "deploy/kubernetes/kustomization.yaml names the component"
    );
}
