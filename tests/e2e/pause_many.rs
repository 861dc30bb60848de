//! Twenty pauses and resumes at once while another tenant works (issue 27, "Done when"),
//! through the real binary on a `runsc2024` profile: tenant A's twenty conversations each set a
//! variable and write a file, go idle together past a 2 s timeout and are paused together
//! (their containers gone, twenty sealed snapshots in the store); then twenty calls at once by
//! `conversation_id` resume them, each under its own `sandbox_id` with its own variable and
//! file. Tenant B runs `1 + 1` cells the whole time; every call of both tenants is answered.
//! The transcript of a resumed sandbox marks its pause (sandgate's, on idle) and its resume, in
//! that order, before the call that resumed it.
//!
//! Skipped, saying so, where the engine has no `runsc2024` runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::join_all;
use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::pause::{StoreDir, pausing_env, plain_dir, running, runsc2024_registered, text_plain};
use crate::support::{self, Gateway};

const LIMIT: Duration = Duration::from_secs(600);
const SANDBOXES: usize = 20;
/// Tenant A's sandboxes are started this many at a time (see below).
const STARTS_AT_ONCE: usize = 4;

/// A transcript resource's text (`format`: `html` or `ipynb`).
pub async fn transcript(client: &Client, sandbox_id: &str, format: &str) -> String {
    let read = client
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(format!(
            "sandbox://{sandbox_id}/transcript.{format}"
        )))
        .await
        .unwrap_or_else(|e| panic!("the {format} transcript of {sandbox_id} reads: {e}"));
    match read.contents.into_iter().next() {
        Some(rmcp::model::ResourceContents::TextResourceContents { text, .. }) => text,
        other => panic!("a text transcript: {other:?}"),
    }
}

/// The markdown cells' sources of a notebook.
pub fn notes(notebook: &str) -> Vec<String> {
    let nb: Value = serde_json::from_str(notebook).expect("the notebook is JSON");
    nb["cells"]
        .as_array()
        .expect("cells")
        .iter()
        .filter(|c| c["cell_type"] == "markdown")
        .filter_map(|c| c["source"].as_str().map(str::to_owned))
        .collect()
}

/// Tenant B's cells, run one after another until stopped: how many were answered `2`, and
/// what every other answer said.
struct Neighbour {
    answered: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Neighbour {
    fn start(client: Client, conversation: &'static str) -> Self {
        let answered = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (answered, stop) = (answered.clone(), stop.clone());
            tokio::spawn(async move {
                let mut failures = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let args = json!({"conversation_id": conversation, "code": "1 + 1"});
                    match client.call("execute_code", args).await {
                        Ok(r) if !r.is_error && text_plain(&r.structured) == "2" => {
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(r) => failures.push(r.text),
                        Err(e) => failures.push(e.to_string()),
                    }
                }
                failures
            })
        };
        Self {
            answered,
            stop,
            task,
        }
    }

    /// Waits until one more of B's cells was answered (B is not starved by what A does).
    async fn answers_again(&self, during: &str) {
        let seen = self.answered.load(Ordering::SeqCst);
        support::eventually(
            LIMIT,
            &format!("tenant B's next cell to be answered {during}"),
            || async { (self.answered.load(Ordering::SeqCst) > seen).then_some(()) },
        )
        .await;
    }

    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let failures = self.task.await.expect("tenant B's loop ends");
        (self.answered.load(Ordering::SeqCst), failures)
    }
}

#[tokio::test]
async fn twenty_sandboxes_pause_and_resume_at_once_while_another_tenant_runs_cells() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.write().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    // Twenty restores at once queue behind the node's restores in flight (as many as cores):
    // the last ones wait longer than a cold start's default bound on a loaded 2-core machine.
    let mut env = pausing_env(&plain, &store);
    env.push(("SANDGATE_POOL__START_WAIT_SECONDS", "600"));
    let gateway = Gateway::start(&database, &env).await;
    let (a, b) = (gateway.create_tenant().await, gateway.create_tenant().await);
    let client = Client::connect(&gateway.mcp_url(), &gateway.token(&a).await, Era::Stateless)
        .await
        .expect("A's client connects");
    let neighbour = Client::connect(&gateway.mcp_url(), &gateway.token(&b).await, Era::Stateless)
        .await
        .expect("B's client connects");

    // Tenant B: a sandbox of its own, kept alive long (it is never idle here), running cells
    // throughout.
    neighbour
        .ok(
            "create_sandbox",
            json!({"conversation_id": "b", "keep_alive_seconds": 600}),
        )
        .await;
    let neighbour = Neighbour::start(neighbour, "b");

    // Tenant A's twenty sandboxes, started with a long keep-alive so that none pauses while
    // the others start, a few at a time: twenty cold runsc starts at once on a loaded 2-core
    // machine outwait the node's start queue (pool.start_wait_seconds, "limit reached: sandbox
    // starts"), which is the start path's answer to saturation and not what this test is
    // about. Then one cell in each at once, which sets its variable and file and its idle
    // timeout to 2 s: they go idle together.
    let conversations: Vec<String> = (0..SANDBOXES).map(|i| format!("a-{i}")).collect();
    let mut ids: Vec<String> = Vec::new();
    for batch in conversations.chunks(STARTS_AT_ONCE) {
        let created = join_all(batch.iter().map(|c| {
            client.ok(
                "create_sandbox",
                json!({"conversation_id": c, "keep_alive_seconds": 600}),
            )
        }))
        .await;
        ids.extend(created.iter().map(|r| {
            r.structured["sandbox_id"]
                .as_str()
                .expect("a sandbox id")
                .to_owned()
        }));
    }
    join_all(conversations.iter().enumerate().map(|(i, c)| {
        client.ok(
            "execute_code",
            json!({
                "conversation_id": c,
                "keep_alive_seconds": 2,
                // The data stack imported first: no pause races a kernel still importing it.
                "code": format!(
                    "import numpy, pandas\nv = {i}\nopen('/home/user/mine.txt', 'w').write('file {i}')\nv"
                ),
            }),
        )
    }))
    .await;

    support::eventually(LIMIT, "A's twenty idle sandboxes to be paused", || async {
        (store.snapshots().len() == SANDBOXES && running(&gateway.instance).len() == 1)
            .then_some(())
    })
    .await;
    neighbour.answers_again("after A's pauses").await;

    // Twenty calls at once resume them, each its own. Each call gives its sandbox a long
    // keep-alive again: with its own 2 s it would idle and be paused again while the last of
    // the twenty still wait for their restore.
    let snapshots = store.snapshots();
    let answers = join_all(conversations.iter().map(|c| {
        client.call(
            "execute_code",
            json!({
                "conversation_id": c,
                "keep_alive_seconds": 600,
                "code": "(v, open('/home/user/mine.txt').read())",
            }),
        )
    }))
    .await;
    let failed: Vec<String> = answers
        .iter()
        .zip(&conversations)
        .filter_map(|(answer, c)| match answer {
            Ok(r) if !r.is_error && r.structured["error"].is_null() => None,
            Ok(r) => Some(format!("{c}: {}", r.text)),
            Err(e) => Some(format!("{c}: {e}")),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "every resume at once is answered; {} failed: {failed:#?}",
        failed.len()
    );
    for (i, answer) in answers.iter().enumerate() {
        let out = &answer.as_ref().expect("answered").structured;
        assert_eq!(out["sandbox_id"], ids[i].as_str(), "a-{i}: its own sandbox");
        assert_eq!(
            text_plain(out),
            format!("({i}, 'file {i}')"),
            "a-{i}: its own variable and file: {out}"
        );
        assert!(out["resumed"].is_object(), "a-{i} says it resumed: {out}");
    }
    assert!(
        snapshots.iter().all(|s| !s.exists()),
        "every resumed sandbox's snapshot is deleted"
    );
    assert!(
        store.snapshots().is_empty(),
        "no resumed sandbox was paused again: {:?}",
        store.snapshots()
    );
    neighbour.answers_again("after A's resumes").await;
    let (answered, failures) = neighbour.stop().await;
    assert!(
        failures.is_empty(),
        "every one of tenant B's cells is answered; {} of {} were not: {failures:#?}",
        failures.len(),
        answered + failures.len()
    );

    // The transcript marks the pause and the resume, in order, before the resuming call.
    let page = transcript(&client, &ids[0], "html").await;
    let at = |needle: &str| {
        page.find(needle)
            .unwrap_or_else(|| panic!("the transcript has {needle:?}: {page}"))
    };
    let (pause, resume) = (at("data-kind=\"pause\""), at("data-kind=\"resume\""));
    let last_cell = page.rfind("data-kind=\"cell\"").expect("cells");
    assert!(
        pause < resume && resume < last_cell,
        "pause, then resume, then the call that resumed it: {page}"
    );
    assert!(
        page[pause..resume].contains("data-by=\"sandgate\"")
            && page[pause..resume].contains("Paused (idle past its timeout)"),
        "the pause is sandgate's, on idle: {page}"
    );
    assert!(
        page[resume..last_cell].contains("Resumed after"),
        "the resume says after how long: {page}"
    );
    let notebook = notes(&transcript(&client, &ids[0], "ipynb").await);
    assert!(
        notebook
            .iter()
            .any(|n| n.contains("Paused (idle past its timeout)"))
            && notebook.iter().any(|n| n.contains("Resumed after")),
        "the notebook marks them too: {notebook:#?}"
    );
    // A's other conversation's transcript is its own: one pause, one resume.
    let other = transcript(&client, &ids[1], "html").await;
    assert_eq!(other.matches("data-kind=\"pause\"").count(), 1, "{other}");
    assert_eq!(other.matches("data-kind=\"resume\"").count(), 1, "{other}");
    support::remove_containers_of(&gateway.instance);
}
