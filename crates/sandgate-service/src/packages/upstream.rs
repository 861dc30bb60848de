//! The upstream package index: project pages (PEP 691 JSON, else PEP 503 HTML) and downloads.

use std::path::Path;
use std::time::Duration;

use html5gum::{StartTag, Token, Tokenizer};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use url::Url;

use super::PackagesConfigError;
use crate::config::PackagesConfig;

/// The JSON API first (PEP 691), HTML (PEP 503) for indexes that only have that.
const ACCEPT: &str = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1";
/// The largest project page read (a project with thousands of files is a few MB).
const MAX_PAGE_BYTES: usize = 32 << 20;

/// The HTTP client for the upstream: the system's trust store plus the configured extra bundle.
pub(super) fn client(config: &PackagesConfig) -> Result<reqwest::Client, PackagesConfigError> {
    let mut builder = reqwest::Client::builder()
        .user_agent(concat!("sandgate/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(config.fetch_timeout_seconds.min(30)))
        .read_timeout(Duration::from_secs(config.fetch_timeout_seconds));
    let bundle = config.ca_bundle.trim();
    if !bundle.is_empty() {
        let refuse = |message: String| PackagesConfigError::CaBundle {
            path: bundle.to_owned(),
            message,
        };
        let pem = std::fs::read(bundle).map_err(|e| refuse(e.to_string()))?;
        let certs =
            reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| refuse(e.to_string()))?;
        if certs.is_empty() {
            return Err(refuse("no PEM certificate in it".into()));
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().map_err(PackagesConfigError::Client)
}

/// One file of a project, as the upstream index lists it.
#[derive(Debug, Clone)]
pub(super) struct ProjectFile {
    pub(super) filename: String,
    pub(super) url: Url,
    pub(super) sha256: Option<String>,
    pub(super) requires_python: Option<String>,
    /// PEP 592: `Some(reason)` (possibly empty) when yanked.
    pub(super) yanked: Option<String>,
}

/// Why a project page could not be had.
#[derive(Debug)]
pub(super) enum PageError {
    /// The index has no such project.
    NotFound,
    /// The index could not be reached or answered something unusable.
    Upstream(String),
}

/// The files of `project` (a normalized name) on the index at `base`.
pub(super) async fn project_files(
    client: &reqwest::Client,
    base: &Url,
    project: &str,
) -> Result<Vec<ProjectFile>, PageError> {
    let page = under_index(base, project)?;
    let response = client
        .get(page.clone())
        .header(reqwest::header::ACCEPT, ACCEPT)
        .send()
        .await
        .map_err(|e| PageError::Upstream(describe(&e)))?;
    if response.status() == reqwest::StatusCode::NOT_FOUND {
        return Err(PageError::NotFound);
    }
    if !response.status().is_success() {
        return Err(PageError::Upstream(format!(
            "the index answered {} for {page}",
            response.status()
        )));
    }
    let page = response.url().clone();
    let json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let body = read_bounded(response, MAX_PAGE_BYTES).await?;
    if json {
        parse_json(&page, &body)
    } else {
        Ok(parse_html(&page, &String::from_utf8_lossy(&body)))
    }
}

/// The page of `project` under the index at `base`: only ever a URL inside the index (same
/// origin, the index's path as a prefix), whatever the name.
fn under_index(base: &Url, project: &str) -> Result<Url, PageError> {
    let Ok(page) = base.join(&format!("{project}/")) else {
        return Err(PageError::NotFound);
    };
    let inside = page.origin() == base.origin()
        && page.path().starts_with(base.path())
        && page.path().len() > base.path().len()
        && page.query().is_none();
    if !inside {
        return Err(PageError::NotFound);
    }
    Ok(page)
}

async fn read_bounded(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, PageError> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| PageError::Upstream(describe(&e)))?
    {
        if body.len() + chunk.len() > max {
            return Err(PageError::Upstream(format!(
                "project page larger than {max} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// PEP 691.
fn parse_json(page: &Url, body: &[u8]) -> Result<Vec<ProjectFile>, PageError> {
    #[derive(Deserialize)]
    struct Page {
        files: Vec<File>,
    }
    #[derive(Deserialize)]
    struct File {
        filename: String,
        url: String,
        #[serde(default)]
        hashes: std::collections::HashMap<String, String>,
        #[serde(default, rename = "requires-python")]
        requires_python: Option<String>,
        #[serde(default)]
        yanked: Option<serde_json::Value>,
    }
    let parsed: Page = serde_json::from_slice(body)
        .map_err(|e| PageError::Upstream(format!("the index's JSON project page: {e}")))?;
    Ok(parsed
        .files
        .into_iter()
        .filter_map(|f| {
            let url = page.join(&f.url).ok()?;
            let yanked = match f.yanked {
                Some(serde_json::Value::Bool(true)) => Some(String::new()),
                Some(serde_json::Value::String(reason)) => Some(reason),
                _ => None,
            };
            Some(ProjectFile {
                filename: f.filename,
                url,
                sha256: f.hashes.get("sha256").map(|h| h.to_ascii_lowercase()),
                requires_python: f.requires_python,
                yanked,
            })
        })
        .collect())
}

/// PEP 503 (<https://peps.python.org/pep-0503/>): the anchors of the page; the sha256 from each
/// URL's fragment. The page is read by html5gum's WHATWG tokenizer, so any tag soup a browser
/// reads (unquoted or upper-case attributes, every character reference) reads the same here.
fn parse_html(page: &Url, html: &str) -> Vec<ProjectFile> {
    let mut files = Vec::new();
    // The anchor being read: its start tag and its text so far.
    let mut open: Option<(StartTag<()>, String)> = None;
    for Ok(token) in Tokenizer::new(html) {
        match token {
            Token::StartTag(tag) if tag.name == b"a" => {
                // An anchor left open ends where the next one starts.
                files.extend(
                    open.take()
                        .and_then(|(tag, text)| anchor(page, &tag, &text)),
                );
                open = Some((tag, String::new()));
            }
            Token::String(s) => {
                if let Some((_, text)) = open.as_mut() {
                    text.push_str(&String::from_utf8_lossy(&s));
                }
            }
            Token::EndTag(tag) if tag.name == b"a" => {
                files.extend(
                    open.take()
                        .and_then(|(tag, text)| anchor(page, &tag, &text)),
                );
            }
            _ => {}
        }
    }
    files.extend(open.and_then(|(tag, text)| anchor(page, &tag, &text)));
    files
}

/// The file one anchor lists: its `href` resolved against the page, its text (else the URL's
/// last segment) as the file name, PEP 503's `data-requires-python` and PEP 592's
/// `data-yanked`. `None` without a usable `href`.
fn anchor(page: &Url, tag: &StartTag<()>, text: &str) -> Option<ProjectFile> {
    let attribute = |name: &str| {
        tag.attributes
            .get(name.as_bytes())
            .map(|value| String::from_utf8_lossy(value).into_owned())
    };
    let mut url = page.join(&attribute("href")?).ok()?;
    let sha256 = url
        .fragment()
        .and_then(|f| f.strip_prefix("sha256="))
        .map(str::to_ascii_lowercase);
    url.set_fragment(None);
    let text = text.trim();
    let filename = if text.is_empty() {
        url.path_segments()
            .and_then(|mut s| s.next_back())
            .unwrap_or_default()
            .to_owned()
    } else {
        text.to_owned()
    };
    Some(ProjectFile {
        filename,
        url,
        sha256,
        requires_python: attribute("data-requires-python"),
        yanked: attribute("data-yanked"),
    })
}

/// Why a download failed.
#[derive(Debug)]
pub(super) enum DownloadError {
    /// The bytes do not have the sha256 the index published.
    HashMismatch { got: String },
    /// Larger than allowed.
    TooLarge { limit: u64 },
    /// The index or the local disk failed.
    Failed(String),
}

/// Starts downloading `url`: the response, once its status is a success and its announced
/// length (if any) is within `max_bytes`.
pub(super) async fn start(
    client: &reqwest::Client,
    url: &Url,
    max_bytes: u64,
) -> Result<reqwest::Response, DownloadError> {
    let response = client
        .get(url.clone())
        .send()
        .await
        .map_err(|e| DownloadError::Failed(describe(&e)))?;
    if !response.status().is_success() {
        return Err(DownloadError::Failed(format!(
            "the index answered {} for {url}",
            response.status()
        )));
    }
    if response.content_length().is_some_and(|n| n > max_bytes) {
        return Err(DownloadError::TooLarge { limit: max_bytes });
    }
    Ok(response)
}

/// Writes a started download into `dest`, checking size and sha256 as it goes; `dest` is
/// removed on failure.
pub(super) async fn save(
    response: reqwest::Response,
    dest: &Path,
    max_bytes: u64,
    sha256: &str,
) -> Result<u64, DownloadError> {
    let result = save_inner(response, dest, max_bytes, sha256).await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(dest).await;
    }
    result
}

async fn save_inner(
    mut response: reqwest::Response,
    dest: &Path,
    max_bytes: u64,
    sha256: &str,
) -> Result<u64, DownloadError> {
    let failed = |e: &dyn std::fmt::Display| DownloadError::Failed(e.to_string());
    let mut file = tokio::fs::File::create(dest)
        .await
        .map_err(|e| failed(&e))?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| DownloadError::Failed(describe(&e)))?
    {
        size += chunk.len() as u64;
        if size > max_bytes {
            return Err(DownloadError::TooLarge { limit: max_bytes });
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(|e| failed(&e))?;
    }
    file.flush().await.map_err(|e| failed(&e))?;
    file.sync_all().await.map_err(|e| failed(&e))?;
    let got = hex::encode(hasher.finalize());
    if got != sha256 {
        return Err(DownloadError::HashMismatch { got });
    }
    Ok(size)
}

/// A reqwest error with its causes (a TLS failure says why).
fn describe(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_pages_give_file_names_hashes_and_yanks() {
        let page = Url::parse("http://127.0.0.1:1/simple/demo/").unwrap();
        let html = r#"<html><body>
            <a href="../../files/demo-1.0-py3-none-any.whl#sha256=ABCD" data-requires-python="&gt;=3.8">demo-1.0-py3-none-any.whl</a>
            <A HREF='demo-0.9.tar.gz' data-yanked>demo-0.9.tar.gz</A>
            <a href=demo-0.8.tar.gz data-yanked="&quot;bad&quot; &amp; gone &#x2014; see&nbsp;#1"></a>
            </body></html>"#;
        let files = parse_html(&page, html);
        assert_eq!(files.len(), 3, "{files:?}");
        assert_eq!(files[0].filename, "demo-1.0-py3-none-any.whl");
        assert_eq!(
            files[0].url.as_str(),
            "http://127.0.0.1:1/files/demo-1.0-py3-none-any.whl"
        );
        assert_eq!(files[0].sha256.as_deref(), Some("abcd"));
        assert_eq!(files[0].requires_python.as_deref(), Some(">=3.8"));
        assert_eq!(files[0].yanked, None);
        assert_eq!(files[1].yanked.as_deref(), Some(""));
        assert_eq!(
            files[1].url.as_str(),
            "http://127.0.0.1:1/simple/demo/demo-0.9.tar.gz"
        );
        assert_eq!(
            files[2].filename, "demo-0.8.tar.gz",
            "an unquoted href, and no text: the name from the URL"
        );
        assert_eq!(
            files[2].yanked.as_deref(),
            Some("\"bad\" & gone \u{2014} see\u{a0}#1"),
            "every character reference is decoded, named or numeric"
        );
    }

    #[test]
    fn project_pages_never_leave_the_index() {
        let base = Url::parse("http://127.0.0.1:1/pypi/simple/").unwrap();
        assert_eq!(
            under_index(&base, "demo").unwrap().as_str(),
            "http://127.0.0.1:1/pypi/simple/demo/"
        );
        for hostile in ["", "http://169.254.169.254", "//evil", "..", "/", "?x"] {
            assert!(
                matches!(under_index(&base, hostile), Err(PageError::NotFound)),
                "{hostile:?} stays inside the index"
            );
        }
    }

    #[test]
    fn json_pages_resolve_relative_urls() {
        let page = Url::parse("http://127.0.0.1:1/simple/demo/").unwrap();
        let body = br#"{"meta":{"api-version":"1.0"},"name":"demo","files":[
            {"filename":"demo-1.0-py3-none-any.whl","url":"/f/demo-1.0-py3-none-any.whl","hashes":{"sha256":"AB"},"yanked":"broken"}]}"#;
        let files = parse_json(&page, body).unwrap();
        assert_eq!(
            files[0].url.as_str(),
            "http://127.0.0.1:1/f/demo-1.0-py3-none-any.whl"
        );
        assert_eq!(files[0].sha256.as_deref(), Some("ab"));
        assert_eq!(files[0].yanked.as_deref(), Some("broken"));
    }
}
