//! `[snapshots]`: memory snapshots of sandboxes on this process's node (docs/snapshots.md) and
//! the warm pool restored from a template.

use std::path::PathBuf;
use std::time::Duration;

use sandgate_sandbox::TemplateConfig;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use url::Url;
use validator::Validate;

/// The most a tenant's snapshot bytes may be (Postgres `bigint`).
const TENANT_BYTES_MAX: u64 = i64::MAX as u64;

/// The `[snapshots]` settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsConfig {
    /// The Docker engine's plaintext tmpfs (scripts/stack.sh: `<cache>/docker/plain`); empty:
    /// no snapshots on this node (every start is an ordinary one, and `/readyz` says so).
    pub plain_dir: PathBuf,
    /// Whether the pool is filled by restoring a template where the profile's runtime can take
    /// snapshots (false: ordinary starts only).
    pub templates: bool,
    /// A template older than this is rebuilt, seconds.
    #[validate(range(min = 60, message = "must be at least 60"))]
    pub template_max_age_seconds: u64,
    /// How long after a failed template build the next is tried, seconds (doubled per failure
    /// in a row, up to 30 minutes).
    #[validate(range(min = 1, max = 1800, message = "must be between 1 and 1800"))]
    pub template_retry_seconds: u64,
    /// Which snapshot store paused sandboxes' sealed snapshots rest in: a local directory
    /// (`store_dir`) or an S3-compatible bucket (`[snapshots.s3]`).
    pub store: StoreKind,
    /// With `store = "fs"`: the snapshot store's local directory (every process that resumes
    /// must reach the same one); empty: no pauses, an idle sandbox is closed.
    pub store_dir: PathBuf,
    /// With `store = "s3"`: the bucket and how to reach it.
    pub s3: S3StoreConfig,
    /// Whether a leased sandbox idle past its timeout is paused (false: closed, as without a
    /// store).
    pub pause_on_idle: bool,
    /// On a `sandgate node`: the deployment's gateways pause idle sandboxes (they hold the key
    /// custody and the snapshot store; a node holds neither), so this node leaves its idle
    /// leased sandboxes to them and closes one itself only when none paused it within
    /// `transition_deadline_seconds` past its idle deadline (no gateway pausing, or all down).
    /// Ignored by `serve`, which pauses itself.
    pub paused_by_gateways: bool,
    /// A pause or resume still unfinished after this long was cut short by a crash and is
    /// undone (pausing: running again; resuming: paused again), seconds.
    #[validate(range(min = 10, max = 86_400, message = "must be between 10 and 86400"))]
    pub transition_deadline_seconds: u64,
    /// Most sandboxes one tenant may have paused at once; beyond it an idle sandbox is closed.
    #[validate(range(max = 1_000_000, message = "must be at most 1000000"))]
    pub max_paused: u32,
    /// Most bytes of sealed snapshots one tenant may keep; beyond it an idle sandbox is closed.
    #[validate(range(max = TENANT_BYTES_MAX, message = "must fit in a bigint"))]
    pub tenant_max_bytes: u64,
}

/// `snapshots.store`: the kind of snapshot store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// A local directory, `snapshots.store_dir`.
    Fs,
    /// An S3-compatible bucket, `[snapshots.s3]`.
    S3,
}

/// `[snapshots.s3]`: an S3-compatible bucket as the snapshot store. Gateway-only, like
/// `keys.secret`: a node never holds these credentials ([`super::Config::drop_gateway_secrets`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3StoreConfig {
    /// The bucket (made beforehand; the service never creates one).
    pub bucket: String,
    /// The S3 endpoint's URL (`https://…`); empty: AWS's own endpoint for `region`.
    pub endpoint: String,
    /// The region the bucket is in (any non-empty name for a store that has none).
    pub region: String,
    /// The access key id the service signs its requests with.
    pub access_key_id: SecretString,
    /// The secret access key that goes with it.
    pub secret_access_key: SecretString,
    /// A prefix the store's objects are put under (`sandgate/prod`); empty: the bucket's root.
    pub prefix: String,
    /// Whether `endpoint` may be plain `http://`: only for a loopback endpoint (a test server),
    /// since the snapshots' ciphertext and the request signatures would otherwise cross a
    /// network unprotected.
    pub allow_http: bool,
}

/// The snapshot store a configuration names, when pauses are on.
#[derive(Debug, Clone, Copy)]
pub enum StoreSettings<'a> {
    /// A local directory.
    Fs(&'a std::path::Path),
    /// An S3-compatible bucket.
    S3(&'a S3StoreConfig),
}

impl S3StoreConfig {
    /// Checks the block (`store = "s3"`); `credentials`: whether the keys must be there (a
    /// gateway; a node's were dropped). `Err((key, message))` names the key.
    pub fn check(&self, credentials: bool) -> Result<(), (String, String)> {
        let invalid = |key: &str, message: String| Err((format!("snapshots.s3.{key}"), message));
        if self.bucket.is_empty() {
            return invalid("bucket", "is required with snapshots.store = \"s3\"".into());
        }
        if self.region.is_empty() {
            return invalid(
                "region",
                "is required with snapshots.store = \"s3\" (any name, e.g. \"us-east-1\", for a \
                 store that has no regions)"
                    .into(),
            );
        }
        if object_store::path::Path::parse(&self.prefix).is_err() {
            return invalid(
                "prefix",
                format!(
                    "{:?} is not an object path: segments separated by single '/', no '.' or \
                     '..', no leading or trailing '/'",
                    self.prefix
                ),
            );
        }
        if !self.endpoint.is_empty() {
            let url = match Url::parse(&self.endpoint) {
                Ok(url) if url.host().is_some() => url,
                _ => {
                    return invalid(
                        "endpoint",
                        format!("{:?} must be an http(s) URL with a host", self.endpoint),
                    );
                }
            };
            let loopback = match url.host() {
                Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
                Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                None => false,
            };
            match url.scheme() {
                "https" => {}
                "http" if !self.allow_http => {
                    return invalid(
                        "endpoint",
                        format!(
                            "{} is plain http: use https, or, for a test server on this host \
                             only, set snapshots.s3.allow_http = true",
                            self.endpoint
                        ),
                    );
                }
                "http" => {}
                _ => {
                    return invalid(
                        "endpoint",
                        format!("{:?} must be an http(s) URL", self.endpoint),
                    );
                }
            }
            if self.allow_http && !loopback {
                return invalid(
                    "allow_http",
                    format!(
                        "is only for a loopback endpoint (127.0.0.0/8, ::1, localhost), not {}: \
                         snapshots and request signatures must not cross a network in the clear; \
                         use an https endpoint",
                        self.endpoint
                    ),
                );
            }
        } else if self.allow_http {
            return invalid(
                "allow_http",
                "is only for a loopback endpoint, and snapshots.s3.endpoint is empty (AWS's own)"
                    .into(),
            );
        }
        if credentials {
            for (key, value) in [
                ("access_key_id", &self.access_key_id),
                ("secret_access_key", &self.secret_access_key),
            ] {
                if value.expose_secret().is_empty() {
                    return invalid(
                        key,
                        format!(
                            "is required with snapshots.store = \"s3\" (SANDGATE_SNAPSHOTS__S3__{})",
                            key.to_ascii_uppercase()
                        ),
                    );
                }
            }
        }
        Ok(())
    }
}

impl SnapshotsConfig {
    /// The snapshot store, when pauses are on (`store = "s3"`, or `"fs"` with a `store_dir`).
    pub fn store(&self) -> Option<StoreSettings<'_>> {
        match self.store {
            StoreKind::Fs => (!self.store_dir.as_os_str().is_empty())
                .then_some(StoreSettings::Fs(self.store_dir.as_path())),
            StoreKind::S3 => Some(StoreSettings::S3(&self.s3)),
        }
    }

    /// Checks the store's settings; `gateway`: whether this process uses the store (a node
    /// never does, and holds no credentials). `Err((key, message))` names the key.
    pub fn check_store(&self, gateway: bool) -> Result<(), (String, String)> {
        match self.store {
            StoreKind::Fs => Ok(()),
            StoreKind::S3 => self.s3.check(gateway),
        }
    }

    /// The plaintext tmpfs, when one is configured.
    pub fn plain_dir(&self) -> Option<&std::path::Path> {
        (!self.plain_dir.as_os_str().is_empty()).then_some(self.plain_dir.as_path())
    }

    /// What the sandbox manager's templates follow.
    pub fn templates(&self) -> TemplateConfig {
        TemplateConfig {
            enabled: self.templates,
            max_age: Duration::from_secs(self.template_max_age_seconds),
            retry: Duration::from_secs(self.template_retry_seconds),
            ..TemplateConfig::default()
        }
    }
}
