//! `deploy/kubernetes/` read as the API server would store it: every document of every manifest,
//! with the pod templates of the workloads, the ConfigMaps, the Secret templates and the
//! NetworkPolicies picked out.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

/// Labels or a ConfigMap's / Secret's data.
pub type Strings = BTreeMap<String, String>;

/// Every document of `deploy/kubernetes/*.yaml` (kustomization.yaml aside).
#[derive(Debug)]
pub struct Manifests {
    docs: Vec<Value>,
}

/// A Deployment, DaemonSet or Job: the pod it makes.
#[derive(Debug, Clone)]
pub struct Workload {
    /// `Deployment/sandgate-gateway` and the like, for messages.
    pub what: String,
    /// The pod template's labels (what NetworkPolicies select).
    pub labels: Strings,
    /// The pod template's spec.
    pub spec: Value,
}

impl Workload {
    /// The pod's containers.
    pub fn containers(&self) -> Vec<Value> {
        self.spec["containers"]
            .as_array()
            .unwrap_or_else(|| panic!("{} has containers", self.what))
            .clone()
    }

    /// The volume named `name`.
    pub fn volume(&self, name: &str) -> &Value {
        self.spec["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .unwrap_or_else(|| panic!("{} declares the volume {name} it mounts", self.what))
    }
}

/// The declared ports of `container`: name (may be empty) and number.
pub fn ports(container: &Value) -> Vec<(String, u16)> {
    container["ports"]
        .as_array()
        .map(|ports| {
            ports
                .iter()
                .map(|p| {
                    let number = p["containerPort"].as_u64().expect("a containerPort number");
                    (
                        p["name"].as_str().unwrap_or_default().to_owned(),
                        u16::try_from(number).expect("a port number"),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A string field of `value` (panics naming `what` when it is not one).
pub fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is a string: {value}"))
}

fn strings(value: &Value) -> Strings {
    value
        .as_object()
        .map(|map| {
            map.iter()
                .map(|(k, v)| (k.clone(), text(v, k).to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

impl Manifests {
    /// Parses every manifest of `dir`.
    pub fn load(dir: &Path) -> Manifests {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .expect("deploy/kubernetes is there")
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| {
                p.extension().is_some_and(|e| e == "yaml")
                    && p.file_name().is_some_and(|n| n != "kustomization.yaml")
            })
            .collect();
        files.sort();
        let mut docs = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a manifest");
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let value = Value::deserialize(doc)
                    .unwrap_or_else(|e| panic!("{} is YAML: {e}", file.display()));
                if !value.is_null() {
                    docs.push(value);
                }
            }
        }
        Manifests { docs }
    }

    /// The documents of `kind`.
    pub fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.docs.iter().filter(move |d| d["kind"] == kind)
    }

    fn named(&self, kind: &str, name: &str) -> &Value {
        self.docs
            .iter()
            .filter(|d| d["kind"] == kind)
            .find(|d| d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("deploy/kubernetes has the {kind} {name}"))
    }

    /// A ConfigMap's data.
    pub fn config_map(&self, name: &str) -> Strings {
        strings(&self.named("ConfigMap", name)["data"])
    }

    /// A Secret template's keys (their values are placeholders).
    pub fn secret_keys(&self, name: &str) -> Vec<String> {
        strings(&self.named("Secret", name)["stringData"])
            .into_keys()
            .collect()
    }

    /// Every Secret template: (name, key) pairs.
    pub fn all_secret_keys(&self) -> Vec<(String, String)> {
        self.of_kind("Secret")
            .flat_map(|s| {
                let name = text(&s["metadata"]["name"], "a Secret's name").to_owned();
                self.secret_keys(&name)
                    .into_iter()
                    .map(move |k| (name.clone(), k))
            })
            .collect()
    }

    /// The workloads, in the order a release applies them: the migrate Job, the nodes, the
    /// gateways.
    pub fn workloads(&self) -> Vec<Workload> {
        let mut workloads = Vec::new();
        for kind in ["Job", "DaemonSet", "Deployment"] {
            for doc in self.of_kind(kind) {
                let template = &doc["spec"]["template"];
                workloads.push(Workload {
                    what: format!("{kind}/{}", text(&doc["metadata"]["name"], "a name")),
                    labels: strings(&template["metadata"]["labels"]),
                    spec: template["spec"].clone(),
                });
            }
        }
        workloads
    }

    /// The NetworkPolicies.
    pub fn network_policies(&self) -> Vec<Value> {
        self.of_kind("NetworkPolicy").cloned().collect()
    }
}
