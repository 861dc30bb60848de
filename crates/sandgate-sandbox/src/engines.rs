//! The engines of one node behind one [`SandboxBackend`]: Docker (the gVisor profiles, and any
//! profile naming a Docker runtime) and the lean engine (profiles whose runtime is `lean`). A
//! launch goes by the profile's runtime; every other call by the container id (a lean one starts
//! with [`crate::lean::ID_PREFIX`]).

use async_trait::async_trait;

use crate::backend::{
    AgentStreams, BackendError, LaunchSpec, Launched, ManagedContainer, SandboxBackend,
};
use crate::config::SandboxProfile;
use crate::docker::DockerBackend;
use crate::lean::{LeanBackend, is_lean};
use crate::snapshot::{SnapshotError, SnapshotImage, SnapshotStep, SnapshotUnavailable};

/// A node's engines.
#[derive(Debug, Clone)]
pub struct Engines {
    docker: DockerBackend,
    lean: Option<LeanBackend>,
    /// Why the lean engine is not available, when it is not.
    lean_unavailable: Option<String>,
}

impl Engines {
    /// Docker, and the lean engine when the host can run it (`lean` is its outcome).
    pub fn new(docker: DockerBackend, lean: Result<LeanBackend, String>) -> Self {
        match lean {
            Ok(lean) => Self {
                docker,
                lean: Some(lean),
                lean_unavailable: None,
            },
            Err(reason) => Self {
                docker,
                lean: None,
                lean_unavailable: Some(reason),
            },
        }
    }

    /// The lean engine, when this host runs it.
    pub fn lean(&self) -> Option<&LeanBackend> {
        self.lean.as_ref()
    }

    fn for_container(&self, container_id: &str) -> Result<&dyn SandboxBackend, BackendError> {
        if is_lean(container_id) {
            match &self.lean {
                Some(lean) => Ok(lean),
                None => Err(BackendError::Inspect {
                    container_id: container_id.to_owned(),
                    source: self.unavailable(),
                }),
            }
        } else {
            Ok(&self.docker)
        }
    }

    fn unavailable(&self) -> crate::backend::BoxError {
        Box::new(std::io::Error::other(format!(
            "the lean engine is not available on this node: {}",
            self.lean_unavailable.as_deref().unwrap_or("unknown")
        )))
    }
}

#[async_trait]
impl SandboxBackend for Engines {
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, BackendError> {
        if spec.profile.runtime.is_lean() {
            match &self.lean {
                Some(lean) => lean.launch(spec).await,
                None => Err(BackendError::Create {
                    sandbox_id: spec.sandbox_id.clone(),
                    source: self.unavailable(),
                }),
            }
        } else {
            self.docker.launch(spec).await
        }
    }

    async fn attach(&self, container_id: &str) -> Result<AgentStreams, BackendError> {
        self.for_container(container_id)?.attach(container_id).await
    }

    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError> {
        if is_lean(container_id) && self.lean.is_none() {
            return Ok(None);
        }
        self.for_container(container_id)?
            .inspect(container_id)
            .await
    }

    async fn remove(&self, container_id: &str) -> Result<(), BackendError> {
        if is_lean(container_id) && self.lean.is_none() {
            return Ok(());
        }
        self.for_container(container_id)?.remove(container_id).await
    }

    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError> {
        let mut all = self.docker.list(instance).await?;
        if let Some(lean) = &self.lean {
            all.extend(lean.list(instance).await?);
        }
        Ok(all)
    }

    async fn image_id(&self, image: &str) -> Option<String> {
        self.docker.image_id(image).await
    }

    fn engine(&self, profile: &SandboxProfile) -> String {
        if !profile.runtime.is_lean() {
            return SandboxBackend::engine(&self.docker, profile);
        }
        match &self.lean_unavailable {
            None => "lean (forked from a warmed zygote)".to_owned(),
            Some(reason) => format!("lean, unavailable: {reason}"),
        }
    }

    async fn snapshot_support(&self, runtime: &str) -> Result<(), SnapshotUnavailable> {
        self.docker.snapshot_support(runtime).await
    }

    fn snapshot_images_dir(&self) -> Option<std::path::PathBuf> {
        self.docker.snapshot_images_dir()
    }

    async fn checkpoint(
        &self,
        container_id: &str,
        name: &str,
        leave_running: bool,
    ) -> Result<SnapshotImage, SnapshotError> {
        if is_lean(container_id) {
            return Err(SnapshotUnavailable::NotSupported.into());
        }
        self.docker
            .checkpoint(container_id, name, leave_running)
            .await
    }

    async fn restore(
        &self,
        spec: &LaunchSpec,
        image: &SnapshotImage,
    ) -> Result<Launched, SnapshotError> {
        if spec.profile.runtime.is_lean() {
            return Err(SnapshotUnavailable::NotSupported.into());
        }
        self.docker.restore(spec, image).await
    }

    fn snapshot_fault(&self, step: SnapshotStep) -> Result<(), SnapshotError> {
        self.docker.snapshot_fault(step)
    }
}
