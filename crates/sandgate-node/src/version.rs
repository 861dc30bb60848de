//! Which node RPC versions a gateway and a node speak with each other (docs/scale-out.md,
//! "Upgrades"). Every request carries the caller's version in the `sandgate-rpc-version`
//! header; a node serves callers from [`RPC_OLDEST`] up, and refuses older ones with a
//! [`VersionSkew`](crate::proto::VersionSkew) failure that names both sides' versions. A caller
//! newer than the node may use calls the node does not know: those come back `Unimplemented`,
//! and the gateway says the node is older than it ([`SandboxError::OlderNode`]). Hence the rule
//! the docs give: roll nodes first, then gateways.
//!
//! A version changes when a message or call changes in a way an older peer would misread; a
//! field or call added that an older peer can ignore or refuse keeps it. A gateway of version N
//! keeps working with nodes back to [`RPC_OLDEST`]'s gateway era.
//!
//! [`SandboxError::OlderNode`]: sandgate_sandbox::SandboxError::OlderNode

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The node RPC version this build speaks.
pub const RPC_VERSION: u32 = 1;

/// The oldest caller version a node of this build serves.
pub const RPC_OLDEST: u32 = 1;

/// The request header carrying the caller's version.
pub const VERSION_HEADER: &str = "sandgate-rpc-version";

/// Stamps every outgoing request with [`RPC_VERSION`].
#[derive(Debug, Clone, Copy, Default)]
pub struct StampVersion;

impl Interceptor for StampVersion {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert(VERSION_HEADER, MetadataValue::from(RPC_VERSION));
        Ok(request)
    }
}

/// Refuses a request whose caller speaks a version older than `oldest` (an absent header is a
/// caller from before versions were sent: version 1).
#[derive(Debug, Clone, Copy)]
pub struct CheckVersion {
    /// The oldest caller version served.
    pub oldest: u32,
    /// The newest this node speaks.
    pub newest: u32,
}

impl Default for CheckVersion {
    fn default() -> Self {
        Self {
            oldest: RPC_OLDEST,
            newest: RPC_VERSION,
        }
    }
}

impl Interceptor for CheckVersion {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let caller = match request.metadata().get(VERSION_HEADER) {
            None => 1,
            Some(value) => value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
                .ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "the {VERSION_HEADER} header is not a version number"
                    ))
                })?,
        };
        if caller < self.oldest {
            return Err(crate::status::version_skew(
                caller,
                self.oldest,
                self.newest,
            ));
        }
        Ok(request)
    }
}
