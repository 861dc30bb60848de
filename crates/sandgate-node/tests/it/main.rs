//! The node RPC against the real Docker engine and sandbox image, over mutual TLS with
//! certificates made here: a gateway's client drives a node's sandboxes as the service would
//! (streamed output, cancellation, files, typed errors), and clients without the deployment's
//! certificates are refused.

mod attacker;
mod calls;
mod egress;
mod relay;
mod sealed;
mod support;
mod tls;
mod versions;
#[path = "../../../../tests/shared/wheels.rs"]
mod wheels;
