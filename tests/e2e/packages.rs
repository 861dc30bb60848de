//! Packages on demand, end to end: `pip install` in a terminal command, `%pip` in a cell and the
//! `install_packages` tool install into a sandbox that has no network, from a package index the
//! test serves on loopback (wheels it builds itself); nothing reaches an outside index.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};
use crate::wheels::{self, TempDir, Wheel};

/// The wheels the loopback index serves (and an sdist-only project, `sgsdist`).
const WHEELS: &[Wheel<'static>] = &[
    Wheel {
        name: "sgdemo-dep",
        version: "1.0",
        source: "VALUE = 41\n",
        requires: &[],
    },
    Wheel {
        name: "sgdemo",
        version: "1.0",
        source: "from sgdemo_dep import VALUE\nANSWER = VALUE + 1\n",
        requires: &["sgdemo-dep"],
    },
    Wheel {
        name: "sgtool",
        version: "2.0",
        source: "NAME = 'sgtool'\n",
        requires: &[],
    },
    Wheel {
        name: "sgcell",
        version: "1.0",
        source: "GREETING = 'hello from a cell'\n",
        requires: &[],
    },
    Wheel {
        name: "sgcorrupt",
        version: "1.0",
        source: "BAD = True\n",
        requires: &[],
    },
    Wheel {
        name: "sgevil",
        version: "1.0",
        source: "EVIL = True\n",
        requires: &[],
    },
];

/// The loopback index: PEP 503 HTML pages of the files in a directory, downloads counted.
#[derive(Clone)]
pub(crate) struct TestIndex {
    dir: PathBuf,
    downloads: Arc<Mutex<HashMap<String, usize>>>,
}

impl TestIndex {
    pub(crate) fn downloads_of(&self, filename: &str) -> usize {
        self.downloads
            .lock()
            .unwrap()
            .get(filename)
            .copied()
            .unwrap_or(0)
    }
}

fn normalize(name: &str) -> String {
    name.to_ascii_lowercase().replace(['_', '.'], "-")
}

async fn project_page(
    State(index): State<TestIndex>,
    UrlPath(project): UrlPath<String>,
) -> Response {
    let project = normalize(project.trim_end_matches('/'));
    let mut links = String::new();
    for entry in std::fs::read_dir(&index.dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let owner = normalize(name.split('-').next().unwrap_or_default());
        if owner != project {
            continue;
        }
        let bytes = std::fs::read(index.dir.join(&name)).unwrap();
        let sha = hex(&Sha256::digest(&bytes));
        links.push_str(&format!(
            "<a href=\"/files/{name}#sha256={sha}\" data-requires-python=\"&gt;=3.8\">{name}</a><br/>\n"
        ));
    }
    if links.is_empty() {
        return StatusCode::NOT_FOUND.into_response();
    }
    (
        [(header::CONTENT_TYPE, "text/html")],
        format!("<!DOCTYPE html><html><body>\n{links}</body></html>\n"),
    )
        .into_response()
}

async fn file(State(index): State<TestIndex>, UrlPath(name): UrlPath<String>) -> Response {
    let Ok(mut bytes) = std::fs::read(index.dir.join(&name)) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    *index
        .downloads
        .lock()
        .unwrap()
        .entry(name.clone())
        .or_default() += 1;
    if name.starts_with("sgcorrupt") {
        // Corrupted on the way: not the bytes the page's sha256 is of.
        bytes.extend_from_slice(b"tampered");
    }
    bytes.into_response()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Builds the wheels into a fresh directory and serves them on 127.0.0.1.
pub(crate) async fn serve_index() -> (TestIndex, SocketAddr, TempDir) {
    let dir = wheels::build("sandgate-test-index", WHEELS);
    std::fs::write(
        dir.path().join("sgsdist-1.0.tar.gz"),
        b"not really a tarball",
    )
    .expect("the sdist is written");
    let index = TestIndex {
        dir: dir.path().to_path_buf(),
        downloads: Arc::default(),
    };
    let app = axum::Router::new()
        .route("/simple/{project}/", axum::routing::get(project_page))
        .route("/files/{name}", axum::routing::get(file))
        .with_state(index.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (index, addr, dir)
}

/// A gateway whose package index is the test's, with a cache of its own.
pub(crate) async fn gateway_with_index(
    addr: SocketAddr,
    cache: &Path,
) -> (Gateway, String, String) {
    let database = support::fresh_database().await;
    let index_url = format!("http://{addr}/simple/");
    let cache = cache.display().to_string();
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_PACKAGES__INDEX_URL", index_url.as_str()),
            ("SANDGATE_PACKAGES__CACHE_DIR", cache.as_str()),
        ],
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    (gateway, tenant, token)
}

#[tokio::test]
async fn pip_install_and_install_packages_work_without_network_from_the_shared_cache() {
    let (index, addr, _dir) = serve_index().await;
    let cache = TempDir::new("sandgate-test-wheel-cache");
    let (gateway, tenant, token) = gateway_with_index(addr, cache.path()).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let tools = client.service.list_all_tools().await.expect("tools/list");
    assert!(
        tools
            .iter()
            .any(|t| t.name == "install_packages" && t.output_schema.is_some()),
        "install_packages is listed with an output schema"
    );

    // A terminal command: pip resolves sgdemo and its dependency through the sandbox's loopback
    // index, with the sandbox's own interpreter; the sandbox has no network.
    let first = client
        .ok("create_sandbox", json!({"conversation_id": "packages-1"}))
        .await
        .structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pip = client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": first, "command": "pip install sgdemo && python3 -c 'import socket; print(sorted(n for _, n in socket.if_nameindex()))'", "timeout_seconds": 120}),
        )
        .await;
    let out = pip.structured["stdout"].as_str().unwrap();
    assert!(
        out.contains("Successfully installed sgdemo-1.0 sgdemo-dep-1.0"),
        "pip installs the package and its dependency: {}",
        pip.text
    );
    assert!(out.contains("['lo']"), "the sandbox has no network: {out}");
    let cell = client
        .ok(
            "execute_code",
            json!({"sandbox_id": first, "code": "import sgdemo, os\nprint(sgdemo.__file__)\nsgdemo.ANSWER"}),
        )
        .await;
    assert_eq!(
        cell.structured["result"]["text/plain"], "42",
        "the next cell imports what pip installed: {}",
        cell.text
    );
    assert!(
        cell.structured["stdout"]
            .as_str()
            .unwrap()
            .starts_with("/opt/packages/"),
        "packages live outside /home/user: {}",
        cell.text
    );
    let files = client.ok("list_files", json!({"sandbox_id": first})).await;
    assert!(
        !files.text.contains("sgdemo") && !files.text.contains(".local"),
        "installed packages do not clutter the user's files: {}",
        files.text
    );

    // %pip in a cell installs too, and the same cell's next line imports it.
    let magic = client
        .ok(
            "execute_code",
            json!({"sandbox_id": first, "code": "%pip install sgcell\nimport sgcell\nsgcell.GREETING", "timeout_seconds": 120}),
        )
        .await;
    assert_eq!(
        magic.structured["result"]["text/plain"], "'hello from a cell'",
        "%pip installs in a cell: {}",
        magic.text
    );

    // A second sandbox gets sgdemo through install_packages, from the gateway's cache: the index
    // saw exactly one download of each wheel.
    let second = client
        .ok("create_sandbox", json!({"conversation_id": "packages-2"}))
        .await
        .structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(first, second, "two sandboxes");
    let tool = client
        .ok(
            "install_packages",
            json!({"sandbox_id": second, "packages": ["sgdemo", "sgtool==2.0"]}),
        )
        .await;
    assert_eq!(tool.structured["exit_code"], 0, "{}", tool.text);
    assert!(
        tool.structured["stdout"]
            .as_str()
            .unwrap()
            .contains("sgtool-2.0"),
        "install_packages reports pip's output: {}",
        tool.text
    );
    let cell = client
        .ok(
            "execute_code",
            json!({"sandbox_id": second, "code": "import sgdemo, sgtool\n(sgdemo.ANSWER, sgtool.NAME)"}),
        )
        .await;
    assert_eq!(
        cell.structured["result"]["text/plain"], "(42, 'sgtool')",
        "{}",
        cell.text
    );
    assert_eq!(
        index.downloads_of("sgdemo-1.0-py3-none-any.whl"),
        1,
        "the second sandbox installed sgdemo from the cache, not the index"
    );
    assert_eq!(index.downloads_of("sgdemo_dep-1.0-py3-none-any.whl"), 1);

    // Refusals: a package the tenant's policy denies, an sdist-only package and a corrupted
    // wheel fail with reasons that say so.
    let policy = gateway
        .cli(&["admin", "tenant", "packages", &tenant, "--deny", "sgevil"])
        .await;
    assert!(policy.contains("deny: sgevil"), "{policy}");
    let denied = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": second, "command": "pip install sgevil", "timeout_seconds": 120}),
        )
        .await
        .expect("a tool result");
    assert!(denied.is_error, "pip fails for a denied package");
    assert!(
        denied.text.contains(
            "sgevil is refused by your organisation's package policy (deny rule \"sgevil\")"
        ),
        "the reason names the rule: {}",
        denied.text
    );
    assert_eq!(
        index.downloads_of("sgevil-1.0-py3-none-any.whl"),
        0,
        "a denied wheel is never fetched"
    );
    let sdist = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": second, "command": "pip install sgsdist", "timeout_seconds": 120}),
        )
        .await
        .expect("a tool result");
    assert!(sdist.is_error, "pip fails for an sdist-only package");
    assert!(
        sdist.text.contains("sgsdist publishes no binary wheel"),
        "the reason names the package and says wheels only: {}",
        sdist.text
    );
    assert_eq!(
        index.downloads_of("sgsdist-1.0.tar.gz"),
        0,
        "an sdist is never fetched"
    );
    let corrupt = client
        .call(
            "install_packages",
            json!({"sandbox_id": second, "packages": ["sgcorrupt"]}),
        )
        .await
        .expect("a tool result");
    assert!(corrupt.is_error, "a corrupted wheel is refused");
    assert!(
        corrupt.text.contains("does not match its published sha256"),
        "the reason says the hash did not match: {}",
        corrupt.text
    );
    let broken = client
        .ok("execute_code", json!({"sandbox_id": second, "code": "import importlib.util\nimportlib.util.find_spec('sgcorrupt') is None"}))
        .await;
    assert_eq!(
        broken.structured["result"]["text/plain"], "True",
        "nothing of it was installed"
    );

    // Bad requirements never reach pip.
    let injected = client
        .call(
            "install_packages",
            json!({"sandbox_id": second, "packages": ["sgdemo; touch /home/user/pwned"]}),
        )
        .await;
    assert!(
        injected.is_err() || injected.as_ref().is_ok_and(|r| r.is_error),
        "a requirement with shell syntax is refused"
    );
    let files = client.ok("list_files", json!({"sandbox_id": second})).await;
    assert!(!files.text.contains("pwned"), "{}", files.text);

    // The sandbox is fine after the refusals, and the audit shows what was installed where.
    let fine = client
        .ok(
            "execute_code",
            json!({"sandbox_id": second, "code": "1 + 1"}),
        )
        .await;
    assert_eq!(fine.structured["result"]["text/plain"], "2");
    let audit = gateway
        .cli(&["admin", "audit", "--packages", "--tenant", &tenant])
        .await;
    let rows: Vec<Vec<&str>> = audit
        .lines()
        .map(|l| l.split_whitespace().skip(1).take(3).collect())
        .collect();
    for (sandbox, package, version) in [
        (&first, "sgdemo", "1.0"),
        (&first, "sgdemo-dep", "1.0"),
        (&first, "sgcell", "1.0"),
        (&second, "sgdemo", "1.0"),
        (&second, "sgtool", "2.0"),
    ] {
        assert!(
            rows.contains(&vec![sandbox.as_str(), package, version]),
            "the install audit shows {package} {version} in {sandbox}:\n{audit}"
        );
    }
    assert!(
        !audit.contains("sgcorrupt"),
        "a refused wheel is not recorded as installed:\n{audit}"
    );
}

#[tokio::test]
async fn with_installs_turned_off_pip_says_so_and_how_an_operator_enables_them() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_PACKAGES__ENABLED", "false")]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let answer = client
        .call(
            "install_packages",
            json!({"conversation_id": "off", "packages": ["anything"]}),
        )
        .await
        .expect("a tool result");
    assert!(answer.is_error, "nothing can be installed");
    assert!(
        answer.text.contains("package installs are turned off")
            && answer.text.contains("SANDGATE_PACKAGES__ENABLED=true"),
        "pip's failure says installs are off and how an operator enables them: {}",
        answer.text
    );
}
