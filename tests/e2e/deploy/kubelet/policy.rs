//! The NetworkPolicies of `deploy/kubernetes/` evaluated as a network plugin does: a pod selected
//! by a policy of a direction is isolated in it, and a connection is allowed when one rule of one
//! policy selecting the pod lets that peer through on that port (named ports resolved against the
//! receiving pod's declared ports).

use std::net::Ipv4Addr;

use serde_json::Value;

use super::manifests::{Strings, text};

/// The namespace kustomization.yaml puts every resource in.
pub const NAMESPACE: &str = "sandgate";

/// Ingress or egress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    fn key(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }

    fn peers(self) -> &'static str {
        match self {
            Direction::Ingress => "from",
            Direction::Egress => "to",
        }
    }

    fn policy_type(self) -> &'static str {
        match self {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        }
    }
}

/// One end of a connection.
#[derive(Debug, Clone)]
pub enum Peer {
    /// A pod: its namespace, labels and declared ports (name, number).
    Pod {
        namespace: String,
        labels: Strings,
        ports: Vec<(String, u16)>,
    },
    /// An address outside the cluster.
    External(Ipv4Addr),
}

impl Peer {
    /// A pod of `namespace` with `labels` (and no declared ports).
    pub fn pod(namespace: &str, labels: &[(&str, &str)]) -> Peer {
        Peer::Pod {
            namespace: namespace.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ports: Vec::new(),
        }
    }
}

fn selects(selector: &Value, labels: &Strings) -> bool {
    let by_label = selector["matchLabels"].as_object().is_none_or(|m| {
        m.iter()
            .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str())
    });
    let by_expression = selector["matchExpressions"].as_array().is_none_or(|list| {
        list.iter().all(|e| {
            let value = labels.get(text(&e["key"], "a key"));
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            match text(&e["operator"], "an operator") {
                "In" => value.is_some_and(|v| values.contains(&v.as_str())),
                "NotIn" => value.is_none_or(|v| !values.contains(&v.as_str())),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("an operator NetworkPolicies know: {other}"),
            }
        })
    });
    by_label && by_expression
}

fn in_cidr(ip: Ipv4Addr, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').expect("a CIDR");
    let net: Ipv4Addr = net.parse().expect("an IPv4 network");
    let len: u32 = len.parse().expect("a prefix length");
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
}

fn peer_matches(entry: &Value, peer: &Peer) -> bool {
    match peer {
        Peer::External(ip) => entry["ipBlock"].as_object().is_some_and(|block| {
            let except = block
                .get("except")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            in_cidr(*ip, text(&block["cidr"], "a cidr"))
                && !except.iter().any(|c| in_cidr(*ip, text(c, "a cidr")))
        }),
        Peer::Pod {
            namespace, labels, ..
        } => {
            if entry.get("ipBlock").is_some() {
                return false;
            }
            let ns_labels: Strings =
                [("kubernetes.io/metadata.name".to_owned(), namespace.clone())].into();
            let ns_ok = match entry.get("namespaceSelector") {
                Some(selector) => selects(selector, &ns_labels),
                None => namespace == NAMESPACE,
            };
            let pod_ok = entry
                .get("podSelector")
                .is_none_or(|selector| selects(selector, labels));
            ns_ok && pod_ok
        }
    }
}

fn port_matches(rule_port: &Value, port: u16, receiver_ports: &[(String, u16)]) -> bool {
    match &rule_port["port"] {
        Value::Null => true,
        Value::Number(n) => n.as_u64() == Some(u64::from(port)),
        Value::String(name) => receiver_ports.iter().any(|(n, p)| n == name && *p == port),
        other => panic!("a NetworkPolicy port is a number or a name: {other}"),
    }
}

fn applies(policy: &Value, direction: Direction, labels: &Strings) -> bool {
    let types: Vec<&str> = match policy["spec"]["policyTypes"].as_array() {
        Some(types) => types.iter().filter_map(Value::as_str).collect(),
        None if policy["spec"].get("egress").is_some() => vec!["Ingress", "Egress"],
        None => vec!["Ingress"],
    };
    types.contains(&direction.policy_type()) && selects(&policy["spec"]["podSelector"], labels)
}

/// Whether `policies` let a connection through in `direction` at the pod with `labels`: from
/// `peer` (ingress) or to it (egress), on `port` (TCP). `receiver_ports` are the declared
/// ports of the receiving end, for named ports.
pub fn allows(
    policies: &[Value],
    direction: Direction,
    labels: &Strings,
    peer: &Peer,
    port: u16,
    receiver_ports: &[(String, u16)],
) -> bool {
    let applicable: Vec<&Value> = policies
        .iter()
        .filter(|p| applies(p, direction, labels))
        .collect();
    if applicable.is_empty() {
        return true;
    }
    applicable.iter().any(|policy| {
        let rules = policy["spec"][direction.key()]
            .as_array()
            .cloned()
            .unwrap_or_default();
        rules.iter().any(|rule| {
            let peers_ok = rule[direction.peers()]
                .as_array()
                .is_none_or(|peers| peers.iter().any(|e| peer_matches(e, peer)));
            let ports_ok = rule["ports"].as_array().is_none_or(|ports| {
                ports.iter().any(|p| {
                    p["protocol"].as_str().is_none_or(|proto| proto == "TCP")
                        && port_matches(p, port, receiver_ports)
                })
            });
            peers_ok && ports_ok
        })
    })
}

/// Whether a TCP connection from `client` (a pod of the namespace with `client_labels`, or a
/// peer) to `server` on `port` gets through both ends' policies.
pub fn connects(policies: &[Value], client: &Peer, server: &Peer, port: u16) -> bool {
    let server_ports = match server {
        Peer::Pod { ports, .. } => ports.clone(),
        Peer::External(_) => Vec::new(),
    };
    let egress_ok = match client {
        Peer::Pod {
            namespace, labels, ..
        } if namespace == NAMESPACE => allows(
            policies,
            Direction::Egress,
            labels,
            server,
            port,
            &server_ports,
        ),
        // Another namespace's own policies are not ours.
        _ => true,
    };
    let ingress_ok = match server {
        Peer::Pod {
            namespace, labels, ..
        } if namespace == NAMESPACE => allows(
            policies,
            Direction::Ingress,
            labels,
            client,
            port,
            &server_ports,
        ),
        _ => true,
    };
    egress_ok && ingress_ok
}
