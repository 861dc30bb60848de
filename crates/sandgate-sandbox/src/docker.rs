//! The Docker backend: talks to the engine with bollard.

use bollard::Docker;

/// What went wrong talking to the Docker engine.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// The engine could not be reached at the configured address.
    #[error("cannot connect to the Docker engine")]
    Connect(#[source] bollard::errors::Error),
    /// The engine did not answer a ping.
    #[error("the Docker engine does not answer")]
    Ping(#[source] bollard::errors::Error),
    /// The sandbox image is not present on the engine.
    #[error("sandbox image {0} is not present; build it with deploy/sandbox/build.sh")]
    ImageMissing(String),
    /// Inspecting the image failed for another reason.
    #[error("inspecting image {image} failed")]
    InspectImage {
        /// The image asked about.
        image: String,
        /// What the engine said.
        #[source]
        source: bollard::errors::Error,
    },
}

/// A handle on one Docker engine.
#[derive(Debug, Clone)]
pub struct DockerBackend {
    docker: Docker,
}

impl DockerBackend {
    /// Connects to the engine at `host` (`unix:///…`, `tcp://…`), or to the local default
    /// (`DOCKER_HOST`, else `/var/run/docker.sock`) when `host` is empty. Connecting is lazy: an
    /// engine that is down shows up on the first call, not here.
    pub fn connect(host: &str) -> Result<Self, DockerError> {
        let docker = if host.is_empty() {
            Docker::connect_with_defaults()
        } else if host.starts_with("unix://") || host.starts_with('/') {
            Docker::connect_with_unix(host, 120, bollard::API_DEFAULT_VERSION)
        } else {
            Docker::connect_with_http(host, 120, bollard::API_DEFAULT_VERSION)
        }
        .map_err(DockerError::Connect)?;
        Ok(Self { docker })
    }

    /// The underlying client, for the rest of this crate.
    pub(crate) fn client(&self) -> &Docker {
        &self.docker
    }

    /// Checks that the engine answers.
    #[tracing::instrument(skip_all)]
    pub async fn ping(&self) -> Result<(), DockerError> {
        self.docker.ping().await.map_err(DockerError::Ping)?;
        Ok(())
    }

    /// Checks that `image` is present on the engine (images are built locally, never pulled).
    #[tracing::instrument(skip_all, fields(image))]
    pub async fn ensure_image(&self, image: &str) -> Result<(), DockerError> {
        match self.docker.inspect_image(image).await {
            Ok(_) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => Err(DockerError::ImageMissing(image.to_owned())),
            Err(source) => Err(DockerError::InspectImage {
                image: image.to_owned(),
                source,
            }),
        }
    }
}
