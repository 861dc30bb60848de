//! Pulling the sandbox image from a registry (`sandbox.pull`): a node on an engine that lacks
//! the image fetches it before it starts sandboxes, instead of an operator loading 870 MB into
//! every engine by hand.

use std::time::{Duration, Instant};

use bollard::query_parameters::CreateImageOptionsBuilder;
use futures::StreamExt;

use super::{DockerBackend, DockerError};
use crate::config::PullPolicy;

/// How often a running pull logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What [`DockerBackend::prepare_image`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageReady {
    /// The image was on the engine and nothing was pulled (`never`, or `if_missing` with the
    /// image there).
    Present,
    /// The image was pulled from its registry.
    Pulled,
    /// `always`: the registry could not be reached or refused, and the image already on the
    /// engine is used; the message says why the pull failed.
    PullFailedUsingPresent(String),
}

impl DockerBackend {
    /// Makes the engine hold `image` as `policy` says: with `never`, only checks nothing (a
    /// missing image shows in readiness); with `if_missing`, pulls it when the engine lacks it;
    /// with `always`, pulls it, keeping an image already there when the pull fails. Progress
    /// is logged every 10 s while a pull runs.
    #[tracing::instrument(skip_all, fields(image = %image, pull = ?policy))]
    pub async fn prepare_image(
        &self,
        image: &str,
        policy: PullPolicy,
    ) -> Result<ImageReady, DockerError> {
        match policy {
            PullPolicy::Never => Ok(ImageReady::Present),
            PullPolicy::IfMissing => match self.ensure_image(image).await {
                Ok(()) => Ok(ImageReady::Present),
                Err(DockerError::ImageMissing(_)) => {
                    self.pull(image).await?;
                    Ok(ImageReady::Pulled)
                }
                Err(other) => Err(other),
            },
            PullPolicy::Always => match self.pull(image).await {
                Ok(()) => Ok(ImageReady::Pulled),
                Err(pull) => match self.ensure_image(image).await {
                    Ok(()) => {
                        let why = error_chain(&pull);
                        tracing::warn!(
                            image,
                            error = %why,
                            "pulling the sandbox image failed; using the one already on the engine"
                        );
                        Ok(ImageReady::PullFailedUsingPresent(why))
                    }
                    Err(_) => Err(pull),
                },
            },
        }
    }

    /// Pulls `image` (a reference with a tag or a digest), logging progress.
    async fn pull(&self, image: &str) -> Result<(), DockerError> {
        let started = Instant::now();
        tracing::info!(image, "pulling the sandbox image");
        let options = CreateImageOptionsBuilder::default()
            .from_image(image)
            .build();
        let mut stream = self.docker.create_image(Some(options), None, None);
        let mut last_report = Instant::now();
        let mut layers_done = 0usize;
        while let Some(item) = stream.next().await {
            let info = item.map_err(|source| DockerError::Pull {
                image: image.to_owned(),
                source,
            })?;
            let status = info.status.unwrap_or_default();
            if status.starts_with("Pull complete") || status.starts_with("Already exists") {
                layers_done += 1;
            }
            if last_report.elapsed() >= PROGRESS_EVERY {
                last_report = Instant::now();
                let detail = info.progress_detail.unwrap_or_default();
                tracing::info!(
                    image,
                    layers_done,
                    seconds = started.elapsed().as_secs(),
                    status = %status,
                    layer = info.id.as_deref().unwrap_or(""),
                    layer_bytes = detail.current.unwrap_or(0),
                    layer_total_bytes = detail.total.unwrap_or(0),
                    "still pulling the sandbox image"
                );
            }
        }
        // The engine answers a pull of a reference it could not resolve with an error in the
        // stream (above); a stream that ends without one means the image is there now. Check
        // anyway: an engine that stored it under another name would fail every start later.
        self.ensure_image(image).await?;
        tracing::info!(
            image,
            seconds = started.elapsed().as_secs(),
            "pulled the sandbox image"
        );
        Ok(())
    }
}

/// An error with its causes, for the log line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
