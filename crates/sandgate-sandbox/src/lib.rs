//! The sandbox manager.
//!
//! - [`config`]: the sandbox profile (image, runtime, limits) read from configuration.
//! - [`docker`]: the Docker backend (bollard): engine health, image checks, hardened containers.

pub mod config;
pub mod docker;

pub use config::SandboxProfile;
pub use docker::{DockerBackend, DockerError};
