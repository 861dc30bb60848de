//! How the service reaches sandboxes: through a node. A node owns one engine's containers, warm
//! pools and attach channels (`sandgate node`, or the node inside `sandgate serve`).
//!
//! - [`NodeHandle`]: the node-level operations a gateway needs (start a sandbox, claim a warm one,
//!   re-attach, remove, pool numbers).
//! - [`SandboxHandle`]: one live sandbox on a node (exec with streamed output, commands, jobs,
//!   files, ping, restart, the package-index relay).
//! - The node RPC (`proto/node.proto`, gRPC with tonic over mutual TLS): [`NodeService`] serves a
//!   [`SandboxManager`]; [`RemoteNode`] and [`RemoteSandbox`] call it; [`status`] carries typed
//!   errors across; [`NodeTls`] holds the certificates. The package-index relay rides on a cell's
//!   or command's own stream (`relay`), bounded by [`RelayLimits`], and so does the egress relay
//!   (`egress`: the CONNECTs of the sandbox's proxy, decided in the gateway); what the node holds for
//!   calls (whole files, a cell's images) is bounded by [`ReadLimits`] (`budget`).
//!
//! Both handles are enums: the in-process variant calls the [`SandboxManager`] and [`Sandbox`]
//! directly (no serialization, no extra task: the one-machine case pays one `match`).

mod budget;
mod convert;
mod egress;
mod handle;
mod node;
mod relay;
mod remote;
mod sealed;
mod server;
pub mod status;
#[cfg(feature = "test-pki")]
pub mod test_pki;
mod tls;
pub mod version;

/// The messages and tonic stubs generated from `proto/node.proto`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)] // generated
pub mod proto {
    tonic::include_proto!("sandgate.node.v1");
}

pub use budget::ReadLimits;
pub use egress::{MAX_AUTHORITY, OPEN_PER_CALL};
pub use handle::SandboxHandle;
pub use node::{NodeHandle, StartTicket};
pub use relay::{MAX_INDEX_CHUNK_BYTES, RelayLimits};
pub use remote::{ConnectError, RemoteNode, RemoteSandbox, channel_lazy, cleartext_allowed};
pub use server::{NodeService, ServeError, serve};

/// Largest message either side of the node RPC accepts: a file upload travels in one message,
/// bounded by the gateway's own file limit well below this.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;
pub use tls::{Expiry, GATEWAY_URI, NODE_URI, NodeTls, Role, TlsError};

#[doc(no_inline)]
pub use sandgate_sandbox::{Sandbox, SandboxManager};
