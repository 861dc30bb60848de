//! The package-index relay over the node RPC: pip in a cell or command on a remote node installs
//! from an index the gateway serves (here a handler of the test's, as the service's would be),
//! and hostile code in the sandbox or a gateway answering garbage gets bounded, clear refusals.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use sandgate_node::proto::{self, node_client::NodeClient};
use sandgate_node::{NodeService, RelayLimits, RemoteSandbox, SandboxHandle};
use sandgate_sandbox::{CommandOptions, ExecOptions, IndexAnswer, IndexBody, IndexHandler};
use tokio::sync::mpsc;

use crate::support::{TestNode, profile, within};
use crate::wheels::{self, TempDir, Wheel};

/// The wheels the gateway's side serves.
const WHEELS: &[Wheel<'static>] = &[
    Wheel {
        name: "sgnode",
        version: "1.0",
        source: "ANSWER = 42\n",
        requires: &[],
    },
    Wheel {
        name: "sgnodecell",
        version: "1.0",
        source: "GREETING = 'hello from a remote cell'\n",
        requires: &[],
    },
];

/// The gateway's side in these tests: PEP 691 pages of the wheels in a directory, the wheels
/// from disk; every path asked and the most requests served at once recorded.
struct TestIndex {
    dir: PathBuf,
    /// sha256 → file name.
    wheels: HashMap<String, String>,
    asked: Mutex<Vec<String>>,
    running: AtomicUsize,
    most_at_once: AtomicUsize,
}

impl TestIndex {
    fn build() -> (Self, TempDir) {
        let dir = wheels::build("sandgate-node-test-wheels", WHEELS);
        let mut wheels = HashMap::new();
        for entry in std::fs::read_dir(dir.path()).expect("the wheels' directory") {
            let name = entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            let bytes = std::fs::read(dir.path().join(&name)).expect("a wheel");
            wheels.insert(sha256_hex(&bytes), name);
        }
        let index = Self {
            dir: dir.path().to_path_buf(),
            wheels,
            asked: Mutex::default(),
            running: AtomicUsize::new(0),
            most_at_once: AtomicUsize::new(0),
        };
        (index, dir)
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }

    fn answer(&self, path: &str) -> IndexAnswer {
        if let Some(project) = path
            .strip_prefix("/simple/")
            .and_then(|p| p.strip_suffix('/'))
        {
            let files: Vec<_> = self
                .wheels
                .iter()
                .filter(|(_, name)| name.split('-').next() == Some(project))
                .map(|(sha, name)| {
                    serde_json::json!({
                        "filename": name,
                        "url": format!("/files/{sha}/{name}"),
                        "hashes": {"sha256": sha},
                    })
                })
                .collect();
            if files.is_empty() {
                return IndexAnswer::refused(404, format!("no project named {project:?}"));
            }
            let page = serde_json::json!({"meta": {"api-version": "1.0"}, "name": project, "files": files});
            return IndexAnswer {
                status: 200,
                content_type: "application/vnd.pypi.simple.v1+json".into(),
                note: None,
                body: IndexBody::Bytes(Bytes::from(page.to_string())),
            };
        }
        if let Some((sha, name)) = path.strip_prefix("/files/").and_then(|r| r.split_once('/'))
            && self.wheels.get(sha).map(String::as_str) == Some(name)
        {
            return IndexAnswer {
                status: 200,
                content_type: "application/octet-stream".into(),
                note: None,
                // From disk, as the service serves cached wheels.
                body: IndexBody::File(self.dir.join(name)),
            };
        }
        IndexAnswer::refused(404, format!("not a package index path: {path}"))
    }
}

impl IndexHandler for TestIndex {
    fn get<'a>(&'a self, path: &'a str) -> BoxFuture<'a, IndexAnswer> {
        Box::pin(async move {
            self.asked.lock().unwrap().push(path.to_owned());
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_at_once.fetch_max(now, Ordering::SeqCst);
            // Give overlapping requests a chance to show up as overlapping.
            tokio::task::yield_now().await;
            let answer = self.answer(path);
            self.running.fetch_sub(1, Ordering::SeqCst);
            answer
        })
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn launch(node: &TestNode) -> RemoteSandbox {
    within(
        Duration::from_secs(180),
        "a sandbox launch",
        node.client().launch(&profile()),
    )
    .await
    .expect("the node starts a sandbox")
}

fn command_options() -> CommandOptions {
    CommandOptions {
        timeout: Duration::from_secs(120),
        ..CommandOptions::default()
    }
}

fn exec_options() -> ExecOptions {
    ExecOptions {
        timeout: Duration::from_secs(120),
        ..ExecOptions::default()
    }
}

fn value(outcome: &sandgate_sandbox::ExecOutcome) -> Option<String> {
    outcome
        .result
        .as_ref()
        .and_then(|b| b.get("text/plain").cloned())
}

#[tokio::test]
async fn pip_in_a_remote_command_and_cell_installs_from_the_gateways_index() {
    let node = TestNode::start("relay-pip").await;
    let (index, _dir) = TestIndex::build();
    let sandbox = SandboxHandle::Remote(launch(&node).await);

    // `pip install` typed as a terminal command.
    let installed = within(
        Duration::from_secs(180),
        "pip install through the relay",
        sandbox.with_index(
            &index,
            sandbox.command("pip install sgnode", command_options(), None),
        ),
    )
    .await
    .expect("the command runs");
    assert_eq!(
        installed.exit_code,
        Some(0),
        "pip installs from the gateway's index; stdout: {}\nstderr: {}",
        installed.stdout,
        installed.stderr
    );
    assert!(
        installed
            .stdout
            .contains("Successfully installed sgnode-1.0"),
        "pip says what it installed: {}",
        installed.stdout
    );
    let asked = index.asked();
    assert!(
        asked.iter().any(|p| p == "/simple/sgnode/")
            && asked.iter().any(|p| p.starts_with("/files/")),
        "the page and the wheel came from the gateway's handler: {asked:?}"
    );
    let imported = sandbox
        .exec("import sgnode; sgnode.ANSWER", exec_options(), None)
        .await
        .expect("the next cell runs");
    assert_eq!(
        value(&imported).as_deref(),
        Some("42"),
        "the next cell imports it: {imported:?}"
    );

    // `%pip` in a cell, with output streamed as it goes.
    let (tx, mut rx) = mpsc::channel(64);
    let collector = tokio::spawn(async move {
        let mut streamed = String::new();
        while let Some(event) = rx.recv().await {
            if let sandgate_sandbox::OutputEvent::Stdout(text) = event {
                streamed.push_str(&text);
            }
        }
        streamed
    });
    let cell = within(
        Duration::from_secs(180),
        "%pip in a cell through the relay",
        sandbox.with_index(
            &index,
            sandbox.exec(
                "%pip install sgnodecell\nimport sgnodecell\nsgnodecell.GREETING",
                exec_options(),
                Some(tx),
            ),
        ),
    )
    .await
    .expect("the cell runs");
    assert_eq!(
        value(&cell).as_deref(),
        Some("'hello from a remote cell'"),
        "the package installed in the cell imports in it: {cell:?}"
    );
    let streamed = collector.await.expect("the events' collector");
    assert!(
        streamed.contains("sgnodecell"),
        "pip's progress streamed while the cell ran: {streamed:?}"
    );

    // Without the relay, nothing reaches the handler: a plain cell asks nothing.
    let before = index.asked().len();
    let plain = sandbox
        .exec("1 + 1", exec_options(), None)
        .await
        .expect("a plain cell");
    assert_eq!(value(&plain).as_deref(), Some("2"));
    assert_eq!(
        index.asked().len(),
        before,
        "a plain cell asks the index nothing"
    );
    node.cleanup().await;
}

/// A cell that requests `paths` from the sandbox's loopback index, 8 at a time, and prints
/// `status length first-line` per path, in order.
fn fetch_cell(paths: &[String]) -> String {
    let paths = serde_json::to_string(paths).expect("paths as JSON");
    format!(
        r#"
import concurrent.futures, urllib.request, urllib.error
def get(path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:3141" + path, timeout=150) as r:
            body = r.read()
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:
        return 0, repr(e).encode()
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(get, {paths}))
for status, body in results:
    line = body.decode(errors="replace").splitlines()[0] if body else ""
    print(status, len(body), line[:200])
"#
    )
}

/// The `status length first-line` lines a [`fetch_cell`] printed.
fn fetched(stdout: &str) -> Vec<(u16, usize, String)> {
    stdout
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ' ');
            let status = parts.next()?.parse().ok()?;
            let len = parts.next()?.parse().ok()?;
            Some((status, len, parts.next().unwrap_or_default().to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn hostile_code_flooding_the_relay_or_leaving_the_index_is_bounded_and_refused() {
    let node = TestNode::start("relay-flood").await;
    let (index, _dir) = TestIndex::build();
    let sandbox = SandboxHandle::Remote(launch(&node).await);

    // 300 requests, 8 at a time: unknown projects, and paths outside the index.
    let outside = [
        "/../../etc/passwd",
        "/files/../../../etc/shadow",
        "/simple/../../x/",
        "/files/0000/x.whl",
        "/admin",
    ];
    let mut paths: Vec<String> = (0..295).map(|i| format!("/simple/flood{i}/")).collect();
    paths.extend(outside.iter().map(|p| (*p).to_owned()));
    let flood = within(
        Duration::from_secs(300),
        "a flooding cell",
        sandbox.with_index(
            &index,
            sandbox.exec(&fetch_cell(&paths), exec_options(), None),
        ),
    )
    .await
    .expect("the flooding cell ends with an outcome");
    let results = fetched(&flood.stdout);
    assert_eq!(
        results.len(),
        paths.len(),
        "every request got an answer: {}",
        flood.stdout
    );
    for ((status, _, line), path) in results.iter().zip(&paths) {
        if outside.contains(&path.as_str()) {
            assert_eq!(
                (*status, line.as_str()),
                (404, "not a package index path"),
                "{path} is refused by the sandbox's relay, as in one process"
            );
        } else {
            assert!(
                *status == 404 || *status == 503,
                "{path}: the handler's 404 or the agent's 503 for too many at once, got {status} {line}"
            );
        }
    }
    let asked = index.asked();
    assert!(
        asked
            .iter()
            .all(|p| p.starts_with("/simple/flood") && p.ends_with('/')),
        "only index paths reached the gateway: {:?}",
        asked
            .iter()
            .filter(|p| !p.starts_with("/simple/flood"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        index.most_at_once.load(Ordering::SeqCst),
        1,
        "the node relays one request of a call at a time"
    );

    // The sandbox is fine afterwards, and so is the relay.
    let after = within(
        Duration::from_secs(180),
        "pip after the flood",
        sandbox.with_index(
            &index,
            sandbox.command("pip install sgnode", command_options(), None),
        ),
    )
    .await
    .expect("the command runs");
    assert_eq!(after.exit_code, Some(0), "pip still installs: {after:?}");
    node.cleanup().await;
}

/// What the test's raw gateway does with each index request, in order.
#[derive(Debug, Clone, Copy)]
enum Garbage {
    NoHead,
    BadStatus,
    HeaderInjection,
    WrongLength,
    FutureRid,
    OverCap,
    Silence,
    /// A late answer to the request before, then a good answer.
    Good,
}

/// The chunks `kind` sends for request `rid`.
fn garbage(kind: Garbage, rid: u64) -> Vec<proto::IndexChunk> {
    let head = |status: u32, content_type: &str, length: Option<u64>| proto::IndexHead {
        status,
        content_type: content_type.into(),
        note: None,
        length,
    };
    let chunk = |rid, head, data: &[u8], last| proto::IndexChunk {
        rid,
        head,
        data: Bytes::copy_from_slice(data),
        last,
    };
    match kind {
        Garbage::NoHead => vec![chunk(rid, None, b"no head", true)],
        Garbage::BadStatus => vec![chunk(rid, Some(head(999, "text/plain", None)), b"x", true)],
        Garbage::HeaderInjection => vec![chunk(
            rid,
            Some(head(200, "text/html\r\nX-Evil: 1", None)),
            b"x",
            true,
        )],
        Garbage::WrongLength => vec![chunk(
            rid,
            Some(head(200, "text/plain", Some(10))),
            b"twenty bytes of body",
            true,
        )],
        Garbage::FutureRid => vec![chunk(
            rid + 5,
            Some(head(200, "text/plain", None)),
            b"x",
            true,
        )],
        // The node's cap in this test is 1000 bytes.
        Garbage::OverCap => vec![
            chunk(
                rid,
                Some(head(200, "text/plain", None)),
                &[b'a'; 600],
                false,
            ),
            chunk(rid, None, &[b'a'; 600], true),
        ],
        Garbage::Silence => Vec::new(),
        Garbage::Good => vec![
            chunk(
                rid - 1,
                Some(head(200, "text/plain", None)),
                b"too late",
                true,
            ),
            chunk(rid, Some(head(200, "text/plain", Some(2))), b"ok", true),
        ],
    }
}

#[tokio::test]
async fn a_gateway_answering_garbage_or_nothing_gets_clear_errors_and_the_cell_ends() {
    let limits = RelayLimits {
        max_answer_bytes: 1000,
        // The shortest wait that shows a silent gateway does not hang the cell.
        deadline: Duration::from_secs(2),
    };
    let node = TestNode::start_with("relay-garbage", "127.0.0.1", None, move |m| {
        NodeService::new(m).with_relay_limits(limits)
    })
    .await;
    let sandbox = launch(&node).await;
    let kinds = [
        Garbage::NoHead,
        Garbage::BadStatus,
        Garbage::HeaderInjection,
        Garbage::WrongLength,
        Garbage::FutureRid,
        Garbage::OverCap,
        Garbage::Silence,
        Garbage::Good,
    ];
    // One request at a time, so that each meets its kind of garbage.
    let paths: Vec<String> = (0..kinds.len()).map(|i| format!("/simple/p{i}/")).collect();
    let code = fetch_cell(&paths).replace("ThreadPoolExecutor(8)", "ThreadPoolExecutor(1)");

    // A raw gateway: the node RPC by hand, with the test's certificate.
    let channel =
        sandgate_node::channel_lazy(&node.url(), Some(&node.pki.tls())).expect("a channel");
    let mut client = NodeClient::new(channel);
    let (inputs, rx) = mpsc::channel(16);
    let start = proto::ExecInput {
        input: Some(proto::exec_input::Input::Start(proto::ExecRequest {
            sandbox: Some(proto::SandboxCall {
                sandbox_id: sandbox.id().to_owned(),
                container_id: sandbox.container_id().to_owned(),
            }),
            code,
            timeout_ms: 120_000,
            output_limit: 1 << 20,
            display_limit: 1 << 20,
            stream: false,
            index: true,
            egress: false,
        })),
    };
    inputs.send(start).await.expect("the request is queued");
    let mut events = client
        .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the node takes the call")
        .into_inner();
    let mut served = 0;
    let outcome = within(Duration::from_secs(240), "the garbage cell", async {
        while let Some(event) = events.next().await {
            match event.expect("the call's stream").event {
                Some(proto::exec_event::Event::IndexRequest(request)) => {
                    let kind = kinds[served.min(kinds.len() - 1)];
                    served += 1;
                    for chunk in garbage(kind, request.rid) {
                        let input = proto::ExecInput {
                            input: Some(proto::exec_input::Input::IndexAnswer(chunk)),
                        };
                        if inputs.send(input).await.is_err() {
                            break;
                        }
                    }
                }
                Some(proto::exec_event::Event::Outcome(outcome)) => return outcome,
                _ => {}
            }
        }
        panic!("the call's stream ended without an outcome");
    })
    .await;
    let results = fetched(&outcome.stdout);
    assert_eq!(
        results.len(),
        kinds.len(),
        "every request got an answer: {outcome:?}"
    );
    let malformed = "the gateway sent a malformed answer to this package index request";
    for (kind, (status, _, line)) in kinds.iter().zip(&results) {
        match kind {
            Garbage::Silence => assert!(
                *status == 504 && line.contains("did not answer"),
                "{kind:?}: pip hears the gateway was late, got {status} {line}"
            ),
            Garbage::Good => assert_eq!(
                (*status, line.as_str()),
                (200, "ok"),
                "after all that the relay still works (a late answer is skipped)"
            ),
            _ => assert!(
                *status == 502 && line.starts_with(malformed),
                "{kind:?}: refused as garbage, got {status} {line}"
            ),
        }
    }
    assert_eq!(served, kinds.len(), "each request reached the gateway once");

    // The sandbox goes on.
    let next = sandbox
        .exec("1 + 1", exec_options(), None)
        .await
        .expect("the next cell");
    assert_eq!(value(&next).as_deref(), Some("2"));
    node.cleanup().await;
}
