//! One call's package index: what pip in that call sees, and what it may install.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use futures::future::BoxFuture;
use sandgate_sandbox::{IndexAnswer, IndexBody, IndexHandler};
use serde_json::json;
use uuid::Uuid;

use super::PackageIndex;
use super::cache::is_sha256;
use super::policy::{Policy, ProjectVerdict};
use super::upstream::{self, DownloadError, PageError};

/// PEP 691's JSON project page, which pip prefers.
const JSON_PAGE: &str = "application/vnd.pypi.simple.v1+json";

/// A wheel this call's project pages offered: only these can be downloaded through it.
#[derive(Debug, Clone)]
struct Offered {
    project: String,
    version: String,
    filename: String,
    url: url::Url,
}

/// The [`IndexHandler`] of one call of one tenant in one sandbox.
#[derive(Debug)]
pub struct CallIndex {
    index: PackageIndex,
    tenant: Uuid,
    sandbox_id: String,
    offered: Mutex<HashMap<String, Offered>>,
    policy: tokio::sync::OnceCell<Policy>,
}

impl CallIndex {
    pub(super) fn new(index: PackageIndex, tenant: Uuid, sandbox_id: String) -> Self {
        Self {
            index,
            tenant,
            sandbox_id,
            offered: Mutex::new(HashMap::new()),
            policy: tokio::sync::OnceCell::new(),
        }
    }

    /// The tenant's policy, read once per call.
    async fn policy(&self) -> Result<&Policy, IndexAnswer> {
        self.policy
            .get_or_try_init(|| self.index.tenant_policy(self.tenant))
            .await
            .map_err(|why| {
                tracing::warn!(tenant_id = %self.tenant, %why, "package policy unreadable");
                IndexAnswer::refused(
                    503,
                    "the package policy of your organisation could not be read; try again shortly",
                )
            })
    }

    async fn answer(&self, path: &str) -> IndexAnswer {
        let base = match &self.index.inner.upstream {
            Ok(url) => url.clone(),
            Err(why) => return IndexAnswer::refused(403, why.clone()),
        };
        if path == "/simple/" {
            return page(json!({"meta": {"api-version": "1.0"}, "projects": []}));
        }
        if let Some(name) = path
            .strip_prefix("/simple/")
            .and_then(|p| p.strip_suffix('/'))
        {
            // Only a project's own page: pip asks for the normalized name (PEP 503), and anything
            // else (an empty name, a URL, `..`) could make the fetch leave the index.
            if !is_normalized_name(name) {
                return IndexAnswer::refused(
                    404,
                    format!(
                        "not a package index path: {path} (pip asks for /simple/<normalized project name>/)"
                    ),
                );
            }
            return self.project_page(&base, name).await;
        }
        if let Some(rest) = path.strip_prefix("/files/")
            && let Some((sha256, filename)) = rest.split_once('/')
            && is_sha256(sha256)
        {
            return self.wheel(sha256, filename).await;
        }
        IndexAnswer::refused(404, format!("not a package index path: {path}"))
    }

    /// The project's page with its binary wheels only (pointing at `/files/<sha256>/<name>`).
    async fn project_page(&self, base: &url::Url, name: &str) -> IndexAnswer {
        let project = normalize(name);
        let policy = match self.policy().await {
            Ok(policy) => policy,
            Err(answer) => return answer,
        };
        // A refused project is never fetched from the index.
        if let ProjectVerdict::Refused(why) = policy.project(&project) {
            return IndexAnswer::refused(403, why);
        }
        let files = match upstream::project_files(&self.index.inner.client, base, &project).await {
            Ok(files) => files,
            Err(PageError::NotFound) => {
                return IndexAnswer::refused(
                    404,
                    format!("no project named {project:?} on the package index: check the name"),
                );
            }
            Err(PageError::Upstream(why)) => {
                tracing::warn!(%project, %why, "package index unreachable");
                return IndexAnswer::refused(
                    502,
                    format!(
                        "the package index could not be reached for {project:?} ({why}); try again later"
                    ),
                );
            }
        };
        let mut listed = Vec::new();
        let mut refused: Vec<(String, String)> = Vec::new();
        let mut offered = self.offered.lock().unwrap_or_else(|e| e.into_inner());
        for file in &files {
            let Some(version) = wheel_version(&file.filename) else {
                continue; // an sdist or anything else: never offered
            };
            if let Some(rule) = policy.refuses_version(&project, &version) {
                if !refused.iter().any(|(v, _)| *v == version) {
                    refused.push((version, rule));
                }
                continue;
            }
            // A wheel without a published sha256 cannot be checked, so it is not offered.
            let Some(sha256) = file.sha256.as_deref().filter(|h| is_sha256(h)) else {
                continue;
            };
            offered.insert(
                sha256.to_owned(),
                Offered {
                    project: project.clone(),
                    version,
                    filename: file.filename.clone(),
                    url: file.url.clone(),
                },
            );
            let mut entry = json!({
                "filename": file.filename,
                "url": format!("/files/{sha256}/{}", file.filename),
                "hashes": {"sha256": sha256},
            });
            if let Some(rp) = &file.requires_python {
                entry["requires-python"] = rp.clone().into();
            }
            if let Some(reason) = &file.yanked {
                entry["yanked"] = if reason.is_empty() {
                    true.into()
                } else {
                    reason.clone().into()
                };
            }
            listed.push(entry);
        }
        drop(offered);
        let policy_note = (!refused.is_empty()).then(|| {
            let versions: Vec<&str> = refused.iter().map(|(v, _)| v.as_str()).collect();
            format!(
                "{project} {} refused by your organisation's package policy ({}); ask an administrator to change it (sandgate admin tenant packages)",
                versions.join(", "),
                refused[0].1
            )
        });
        if listed.is_empty()
            && let Some(note) = policy_note.clone()
        {
            return IndexAnswer::refused(403, note);
        }
        if listed.is_empty() && !files.is_empty() {
            return IndexAnswer::refused(
                404,
                format!(
                    "{project} publishes no binary wheel on the package index (only source distributions): sandboxes install binary wheels only and never build from source; use another package or version that ships a wheel"
                ),
            );
        }
        let mut answer =
            page(json!({"meta": {"api-version": "1.0"}, "name": project, "files": listed}));
        answer.note = policy_note;
        answer
    }

    /// A wheel the page offered: from the cache, else downloaded into it (hash checked) first.
    async fn wheel(&self, sha256: &str, filename: &str) -> IndexAnswer {
        let offered = self
            .offered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(sha256)
            .cloned();
        let Some(offered) = offered.filter(|o| o.filename == filename) else {
            return IndexAnswer::refused(
                404,
                format!("{filename} was not offered to this sandbox"),
            );
        };
        let inner = &self.index.inner;
        // The tenant's limit, and never more than the whole cache holds.
        let max_wheel_bytes = match self.policy().await {
            Ok(policy) => policy
                .max_wheel_mb
                .map_or(inner.max_wheel_bytes, |mb| mb.saturating_mul(1 << 20))
                .min(inner.cache.max_bytes()),
            Err(answer) => return answer,
        };
        if inner
            .cache
            .size(sha256)
            .is_some_and(|size| size > max_wheel_bytes)
        {
            return self.download_refused(
                &offered,
                sha256,
                DownloadError::TooLarge {
                    limit: max_wheel_bytes,
                },
            );
        }
        let cached = match inner.cache.verified(sha256).await {
            Some(path) => path,
            None => match self.download(&offered, sha256, max_wheel_bytes).await {
                Ok(path) => path,
                Err(answer) => return answer,
            },
        };
        tracing::info!(
            tenant_id = %self.tenant,
            sandbox_id = %self.sandbox_id,
            project = %offered.project,
            version = %offered.version,
            "package wheel handed to a sandbox"
        );
        self.index
            .audit_install(
                self.tenant,
                &self.sandbox_id,
                &offered.project,
                &offered.version,
                &offered.filename,
                sha256,
            )
            .await;
        IndexAnswer {
            status: 200,
            content_type: "application/octet-stream".into(),
            note: None,
            body: IndexBody::File(cached),
        }
    }

    /// Downloads an offered wheel into the cache, within the tenant's budget and the cache's
    /// room; the cached file.
    async fn download(
        &self,
        offered: &Offered,
        sha256: &str,
        max_wheel_bytes: u64,
    ) -> Result<std::path::PathBuf, IndexAnswer> {
        let inner = &self.index.inner;
        if let Err(spent) = inner.budget.admit(self.tenant) {
            tracing::info!(tenant_id = %self.tenant, "package download budget spent");
            return Err(IndexAnswer::refused(
                429,
                format!(
                    "your organisation's sandboxes downloaded their {} MiB of wheels for this hour                      from the package index (packages.tenant_download_mb_per_hour): {} was not                      downloaded; try again in {} minutes (wheels already cached install at once)",
                    spent.per_hour >> 20,
                    offered.filename,
                    spent.retry_after.as_secs().div_ceil(60).max(1)
                ),
            ));
        }
        let response = upstream::start(&inner.client, &offered.url, max_wheel_bytes)
            .await
            .map_err(|err| self.download_refused(offered, sha256, err))?;
        // Room for what the index announced, else for the largest wheel allowed; the download
        // may not grow past it.
        let room = response
            .content_length()
            .unwrap_or(max_wheel_bytes)
            .min(max_wheel_bytes);
        let Ok(reservation) = inner.cache.reserve(room) else {
            return Err(IndexAnswer::refused(
                503,
                "the gateway's wheel cache has no room now: it is held by downloads under way; \
                 try again shortly",
            ));
        };
        let partial = inner.cache.temporary(sha256);
        let size = upstream::save(response, &partial, room, sha256)
            .await
            .map_err(|err| self.download_refused(offered, sha256, err))?;
        inner.budget.charge(self.tenant, size);
        inner
            .cache
            .store(reservation, &partial, sha256, size)
            .await
            .map_err(|err| {
                tracing::warn!(%err, "wheel cache write failed");
                IndexAnswer::refused(502, "the gateway could not store this wheel; try again")
            })
    }

    fn download_refused(&self, offered: &Offered, sha256: &str, err: DownloadError) -> IndexAnswer {
        let text = match err {
            DownloadError::HashMismatch { got } => format!(
                "{} from the package index does not match its published sha256 (expected {sha256}, got {got}): refused, it is corrupted or was tampered with",
                offered.filename
            ),
            DownloadError::TooLarge { limit } => format!(
                "{} is larger than the {} MiB a sandbox may download (packages.max_wheel_mb, or your organisation's limit set with sandgate admin tenant packages --max-wheel-mb)",
                offered.filename,
                limit >> 20
            ),
            DownloadError::Failed(why) => {
                tracing::warn!(%why, file = %offered.filename, "wheel download failed");
                format!(
                    "{} could not be downloaded from the package index ({why}); try again later",
                    offered.filename
                )
            }
        };
        IndexAnswer::refused(502, text)
    }
}

impl IndexHandler for CallIndex {
    fn get<'a>(&'a self, path: &'a str) -> BoxFuture<'a, IndexAnswer> {
        Box::pin(self.answer(path))
    }
}

fn page(body: serde_json::Value) -> IndexAnswer {
    IndexAnswer {
        status: 200,
        content_type: JSON_PAGE.into(),
        note: None,
        body: IndexBody::Bytes(Bytes::from(body.to_string())),
    }
}

/// PEP 503 name normalization: lower case, runs of `-`, `_`, `.` become one `-`.
pub(super) fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut dash = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            dash = true;
        } else {
            if dash && !out.is_empty() {
                out.push('-');
            }
            dash = false;
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// Whether `name` is a project name as PEP 503 normalizes it: ASCII lower-case letters and
/// digits, single dashes between them (PEP 508's name, normalized).
pub(super) fn is_normalized_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The version of a wheel file name (`name-version(-build)?-py-abi-platform.whl`); `None` for
/// anything that is not a wheel.
fn wheel_version(filename: &str) -> Option<String> {
    let stem = filename.strip_suffix(".whl")?;
    let parts: Vec<&str> = stem.split('-').collect();
    (parts.len() == 5 || parts.len() == 6).then(|| parts[1].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalized_like_pep_503() {
        assert_eq!(normalize("Friendly-Bard"), "friendly-bard");
        assert_eq!(normalize("FRIENDLY__bard"), "friendly-bard");
        assert_eq!(normalize("friendly.-_bard"), "friendly-bard");
    }

    #[test]
    fn only_normalized_project_names_are_index_paths() {
        for good in ["sgdemo", "friendly-bard", "a", "zope-interface", "py3"] {
            assert!(is_normalized_name(good), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "-x",
            "x-",
            "a--b",
            "Demo",
            "a_b",
            "a.b",
            "http://169.254.169.254",
            "http:",
            "a/b",
            "%2e%2e",
            "//evil",
        ] {
            assert!(!is_normalized_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn only_wheels_have_a_version_here() {
        assert_eq!(
            wheel_version("demo-1.0-py3-none-any.whl").as_deref(),
            Some("1.0")
        );
        assert_eq!(
            wheel_version("demo-1.0-1b-cp311-cp311-manylinux_2_28_x86_64.whl").as_deref(),
            Some("1.0")
        );
        assert_eq!(wheel_version("demo-1.0.tar.gz"), None);
    }
}
