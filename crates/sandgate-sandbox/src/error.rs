//! The container engine's errors, shared by the backend and the snapshots (both name them, and
//! neither module reaches into the other for them).

/// Any engine error, kept as the cause of a [`BackendError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong in the container engine.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Creating the container failed (bad image, engine refused the configuration …).
    #[error("creating a sandbox container for sandbox {sandbox_id} failed")]
    Create {
        /// The sandbox the container was for.
        sandbox_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// Starting a created container failed.
    #[error("starting sandbox container {container_id} failed")]
    Start {
        /// The container.
        container_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// Attaching to the container's stdin/stdout failed.
    #[error("attaching to sandbox container {container_id} failed")]
    Attach {
        /// The container.
        container_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// Inspecting the container failed (other than it being absent).
    #[error("inspecting sandbox container {container_id} failed")]
    Inspect {
        /// The container.
        container_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// Removing the container failed (other than it being absent already).
    #[error("removing sandbox container {container_id} failed")]
    Remove {
        /// The container.
        container_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// Listing the managed containers failed.
    #[error("listing sandbox containers failed")]
    List(#[source] BoxError),
    /// The engine did not create, attach to and start a sandbox's container in time (it may be
    /// restarting); the launch was given up.
    #[error("the Docker engine did not start sandbox {sandbox_id}'s container within {after:?}")]
    TimedOut {
        /// The sandbox the container was for.
        sandbox_id: String,
        /// How long the launch waited.
        after: std::time::Duration,
    },
}
