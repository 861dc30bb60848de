//! The egress component's counters (`/metrics`): connections by outcome and kind, bytes each
//! way, secrets put into requests. Process-wide, like the audit's counters; no tenant or host
//! label (the audit trail has those, per connection).

use std::sync::OnceLock;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// How a connection ended up.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
pub enum ConnectionOutcome {
    /// Opened and relayed.
    ok,
    /// Refused by the policy, the target check or a budget.
    refused,
    /// Could not be made (the server, the policy's or a secret's store).
    failed,
}

/// Whether an opened connection was a plain tunnel or intercepted for a secret.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ConnectionKind {
    /// The client's own TLS end to end (or a refusal: nothing was opened).
    tunnel,
    /// TLS terminated for a secret bound to the host.
    intercepted,
}

/// Labels of `egress_connections`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// How it ended up.
    pub outcome: ConnectionOutcome,
    /// Tunnel or intercepted.
    pub kind: ConnectionKind,
}

/// Which way bytes went.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    /// From the sandbox to the server.
    sent,
    /// From the server to the sandbox.
    received,
}

/// Labels of `egress_bytes`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    /// Which way.
    pub direction: Direction,
}

/// The egress counters.
#[derive(Debug, Default)]
pub struct EgressCounters {
    /// CONNECTs, by outcome and kind.
    pub connections: Family<ConnectionLabels, Counter>,
    /// Bytes relayed, by direction.
    pub bytes: Family<BytesLabels, Counter>,
    /// Requests a secret's value was put into (one per secret and request).
    pub secrets_injected: Counter,
}

/// The process's egress counters.
pub fn counters() -> &'static EgressCounters {
    static COUNTERS: OnceLock<EgressCounters> = OnceLock::new();
    COUNTERS.get_or_init(EgressCounters::default)
}

/// Counts one CONNECT.
pub(crate) fn connection(outcome: ConnectionOutcome, kind: ConnectionKind) {
    counters()
        .connections
        .get_or_create(&ConnectionLabels { outcome, kind })
        .inc();
}

/// Counts what an opened connection carried.
pub(crate) fn carried(sent: u64, received: u64) {
    let bytes = &counters().bytes;
    bytes
        .get_or_create(&BytesLabels {
            direction: Direction::sent,
        })
        .inc_by(sent);
    bytes
        .get_or_create(&BytesLabels {
            direction: Direction::received,
        })
        .inc_by(received);
}
