//! Issue 24, holes 5 and 9, played by hostile code in a sandbox against the real binary: user
//! code talks to the agent's loopback index directly (not through pip) to make the gateway
//! download every wheel a page lists, and hands it crafted index paths to make it fetch
//! outside the configured index.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};
use crate::wheels::{self, TempDir, Wheel};

/// Wheels of ~120 KB each (random letters: a wheel is a stored zip), 16 of them: more than the
/// 1 MiB cache the test configures.
const WHEELS: usize = 16;

/// An upstream index under `/pypi/simple/` that records every path asked of it.
#[derive(Clone)]
struct Upstream {
    dir: PathBuf,
    asked: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }

    fn downloads(&self) -> usize {
        self.asked()
            .iter()
            .filter(|p| p.starts_with("/pypi/files/"))
            .count()
    }
}

async fn page(State(up): State<Upstream>, UrlPath(project): UrlPath<String>) -> Response {
    let mut links = String::new();
    for entry in std::fs::read_dir(&up.dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.split('-').next() != Some(project.as_str()) {
            continue;
        }
        let sha = Sha256::digest(std::fs::read(up.dir.join(&name)).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        links.push_str(&format!(
            "<a href=\"/pypi/files/{name}#sha256={sha}\">{name}</a>\n"
        ));
    }
    if links.is_empty() {
        return StatusCode::NOT_FOUND.into_response();
    }
    ([(header::CONTENT_TYPE, "text/html")], links).into_response()
}

async fn file(State(up): State<Upstream>, UrlPath(name): UrlPath<String>) -> Response {
    match std::fs::read(up.dir.join(&name)) {
        Ok(bytes) => bytes.into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

/// Serves `app` on 127.0.0.1, recording every path asked into `asked`.
async fn serve_recording(app: axum::Router, asked: Arc<Mutex<Vec<String>>>) -> SocketAddr {
    let app = app.layer(axum::middleware::from_fn(
        move |uri: Uri, request: axum::extract::Request, next: axum::middleware::Next| {
            asked.lock().unwrap().push(uri.path().to_owned());
            next.run(request)
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Random letters (a wheel's module source that does not shrink).
fn filler(seed: u64, len: usize) -> String {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'a' + ((x >> 33) % 26) as u8)
        })
        .collect()
}

async fn upstream() -> (Upstream, SocketAddr, TempDir) {
    let dir = TempDir::new("sandgate-test-scraped-index");
    for i in 0..WHEELS {
        let name = format!("sgbig{i}");
        let source = format!("BLOB = '{}'\n", filler(i as u64, 120_000));
        let built = wheels::build(
            "sandgate-test-big-wheel",
            &[Wheel {
                name: &name,
                version: "1.0",
                source: &source,
                requires: &[],
            }],
        );
        for entry in std::fs::read_dir(built.path()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let up = Upstream {
        dir: dir.path().to_path_buf(),
        asked: Arc::default(),
    };
    let app = axum::Router::new()
        .route("/pypi/simple/{project}/", axum::routing::get(page))
        .route("/pypi/files/{name}", axum::routing::get(file))
        .with_state(up.clone());
    let addr = serve_recording(app, Arc::clone(&up.asked)).await;
    (up, addr, dir)
}

fn cache_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The Python a cell runs: GETs `paths` (each `/files/…` one after the pages that offer it)
/// from the agent's loopback index and prints `status path detail` per line.
const SCRAPE: &str = r#"
import json, urllib.request, urllib.error
def get(path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:3141" + path, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:
        return 0, repr(e).encode()
files = []
for i in range(PAGES):
    status, body = get(f"/simple/sgbig{i}/")
    print(status, f"/simple/sgbig{i}/")
    if status == 200:
        files += [f["url"] for f in json.loads(body)["files"]]
for url in (files if FETCH else []):
    status, body = get(url)
    print(status, url, body[:160].decode("utf-8", "replace").replace("\n", " ") if status != 200 else len(body))
for path in EXTRA:
    status, body = get(path)
    print(status, path, body[:160].decode("utf-8", "replace").replace("\n", " "))
"#;

fn scrape(fetch: bool, extra: &[String]) -> String {
    SCRAPE
        .replace("PAGES", &WHEELS.to_string())
        .replace("FETCH", if fetch { "True" } else { "False" })
        .replace("EXTRA", &serde_json::to_string(extra).unwrap())
}

#[tokio::test]
async fn a_sandbox_scraping_the_index_leaves_the_cache_within_its_cap_and_its_tenant_within_its_budget()
 {
    let (up, addr, _dir) = upstream().await;
    let cache = TempDir::new("sandgate-test-capped-cache");
    let cache_dir = cache.path().join("wheels");
    let database = support::fresh_database().await;
    let index_url = format!("http://{addr}/pypi/simple/");
    let cache_path = cache_dir.display().to_string();
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_PACKAGES__INDEX_URL", index_url.as_str()),
            ("SANDGATE_PACKAGES__CACHE_DIR", cache_path.as_str()),
            ("SANDGATE_PACKAGES__CACHE_MAX_MB", "1"),
            ("SANDGATE_PACKAGES__MAX_WHEEL_MB", "1"),
            ("SANDGATE_PACKAGES__TENANT_DOWNLOAD_MB_PER_HOUR", "1"),
        ],
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&cache_dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "only the service can write the cache");

    // Every page, no file: a listing downloads nothing.
    let pages = client
        .ok(
            "execute_code",
            json!({"conversation_id": "scrape", "code": scrape(false, &[]), "timeout_seconds": 120}),
        )
        .await;
    let out = pages.structured["stdout"].as_str().unwrap_or_default();
    assert_eq!(
        out.lines().filter(|l| l.starts_with("200 ")).count(),
        WHEELS,
        "every page is served: {}",
        pages.text
    );
    assert_eq!(
        up.downloads(),
        0,
        "pages trigger no download: {:?}",
        up.asked()
    );

    // Every file of every page: the cache stays within 1 MiB, the tenant's budget stops it.
    let files = client
        .ok(
            "execute_code",
            json!({"conversation_id": "scrape", "code": scrape(true, &[]), "timeout_seconds": 300}),
        )
        .await;
    let out = files.structured["stdout"].as_str().unwrap_or_default();
    let served = out.lines().filter(|l| l.starts_with("200 /files/")).count();
    let refused: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("429 /files/"))
        .collect();
    assert!(
        cache_bytes(&cache_dir) <= 1 << 20,
        "the cache holds at most its 1 MiB cap ({} bytes):\n{out}",
        cache_bytes(&cache_dir)
    );
    assert!(
        (8..WHEELS).contains(&served),
        "about 1 MiB of wheels downloaded, then the budget refuses ({served} served):\n{out}"
    );
    assert!(
        refused
            .first()
            .is_some_and(|l| l.contains("packages.tenant_download_mb_per_hour")),
        "the refusal says which budget was spent:\n{out}"
    );
    assert_eq!(
        up.downloads(),
        served,
        "nothing downloaded beyond what was served"
    );
    let audit = gateway
        .cli(&["admin", "audit", "--packages", "--tenant", &tenant])
        .await;
    assert_eq!(
        audit.lines().filter(|l| l.contains("sgbig")).count(),
        served,
        "one install row per wheel handed out:\n{audit}"
    );
}

#[tokio::test]
async fn a_crafted_index_path_never_leaves_the_configured_index() {
    let (up, addr, _dir) = upstream().await;
    // Where an escaping fetch would land: another loopback server, recording what it is asked.
    let canary_asked: Arc<Mutex<Vec<String>>> = Arc::default();
    let canary = serve_recording(
        axum::Router::new().fallback(|| async { "metadata" }),
        Arc::clone(&canary_asked),
    )
    .await;
    let cache = TempDir::new("sandgate-test-ssrf-cache");
    let database = support::fresh_database().await;
    let index_url = format!("http://{addr}/pypi/simple/");
    let cache_path = cache.path().display().to_string();
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_PACKAGES__INDEX_URL", index_url.as_str()),
            ("SANDGATE_PACKAGES__CACHE_DIR", cache_path.as_str()),
        ],
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    // 2130706433 is 127.0.0.1 written as one number (no dots for normalization to turn into
    // dashes); the other paths reach for the upstream's root or climb out of /pypi/simple/.
    let port = canary.port();
    let hostile = [
        "/simple/.../".to_owned(),
        "/simple/-/".to_owned(),
        format!("/simple/http://2130706433:{port}/latest/meta-data/"),
        format!("/simple/http:2130706433:{port}/"),
        format!("/simple///2130706433:{port}/"),
        "/simple/../../".to_owned(),
        "/simple/%2e%2e/".to_owned(),
        "/simple/sgbig0?x=1/".to_owned(),
        format!("/files/{}/sgbig0-1.0-py3-none-any.whl", "0".repeat(64)),
    ];
    let ran = client
        .ok(
            "execute_code",
            json!({"conversation_id": "ssrf", "code": scrape(false, &hostile), "timeout_seconds": 120}),
        )
        .await;
    let out = ran.structured["stdout"].as_str().unwrap_or_default();
    for path in &hostile {
        assert!(
            out.lines()
                .any(|l| l.contains(path.as_str()) && !l.starts_with("200 ")),
            "{path} is refused:\n{out}"
        );
    }
    assert!(
        canary_asked.lock().unwrap().is_empty(),
        "nothing outside the index was fetched: {:?}",
        canary_asked.lock().unwrap()
    );
    let outside: Vec<String> = up
        .asked()
        .into_iter()
        .filter(|p| !p.starts_with("/pypi/simple/sgbig"))
        .collect();
    assert!(
        outside.is_empty(),
        "the upstream was asked only for project pages under /pypi/simple/: {outside:?}"
    );
    // The index still works for a real project.
    assert!(
        out.lines()
            .filter(|l| l.starts_with("200 /simple/sgbig"))
            .count()
            == WHEELS,
        "{out}"
    );
}
