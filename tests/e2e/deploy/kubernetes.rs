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
