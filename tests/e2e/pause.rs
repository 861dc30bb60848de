//! Conversations that outlive idle (issue 27), through the real binary on a `runsc2024`
//! profile with a 2 s idle timeout: a conversation's sandbox idles past its timeout, is paused
//! (its container gone, its sealed snapshot in the store) and the next call by
//! `conversation_id` resumes it under the same `sandbox_id` with its variables and files; the
//! same across a restart of the gateway while it is paused; ten cycles in a row keep everything
//! and the sandbox's own idle timeout; another tenant naming the paused sandbox gets the
//! missing-sandbox answer; `close_sandbox` deletes the snapshot; a resumed sandbox and a fork
//! of it get their egress again (issue 29).
//!
//! Skipped, saying so, where the engine has no `runsc2024` runtime.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};

const LIMIT: Duration = Duration::from_secs(300);

/// Held (shared) by every test that checkpoints on the stack's engine, and alone by
/// `pause_many`: its twenty snapshots at once fill the plaintext tmpfs and the node's restore
/// places the others need (cargo runs tests in parallel).
pub static RESTORES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

pub fn plain_dir() -> String {
    std::env::var("SANDGATE_SNAPSHOTS__PLAIN_DIR")
        .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into())
}

/// Whether the engine has the runtime that can checkpoint; says why not when it has not.
pub fn runsc2024_registered() -> bool {
    let runtimes = support::docker_words(&["info", "--format", "{{json .Runtimes}}"]).join(" ");
    let registered = runtimes.contains("\"runsc2024\"");
    if !registered {
        eprintln!(
            "skipping: the Docker engine has no runsc2024 runtime (scripts/stack.sh registers \
             it), so sandboxes cannot be checkpointed here"
        );
    }
    registered
}

/// A snapshot store of the test's own (removed on drop).
pub struct StoreDir(pub PathBuf);

impl StoreDir {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "sandgate-e2e-snapshots-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("the store directory is made");
        Self(dir)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 path")
    }

    /// The sealed snapshot files in the store.
    pub fn snapshots(&self) -> Vec<PathBuf> {
        fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "sgsnap") {
                    found.push(path);
                }
            }
        }
        let mut found = Vec::new();
        walk(&self.0, &mut found);
        found
    }
}

impl Drop for StoreDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The settings of a gateway that pauses idle sandboxes after 2 s.
pub fn pausing_env<'a>(plain: &'a str, store: &'a StoreDir) -> Vec<(&'a str, &'a str)> {
    vec![
        ("SANDGATE_SANDBOX__RUNTIME", "runsc2024"),
        ("SANDGATE_SNAPSHOTS__PLAIN_DIR", plain),
        ("SANDGATE_SNAPSHOTS__TEMPLATES", "false"),
        ("SANDGATE_SNAPSHOTS__STORE_DIR", store.path()),
        ("SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS", "2"),
        ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "200"),
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_POOL__MAX_READY", "0"),
    ]
}

/// The running containers of `instance`.
pub fn running(instance: &str) -> Vec<String> {
    support::docker_words(&[
        "ps",
        "-q",
        "--no-trunc",
        "--filter",
        &format!("label=sandgate.instance={instance}"),
    ])
}

/// Waits until the sandbox's container is gone and one snapshot rests in the store: paused.
pub async fn until_paused(instance: &str, store: &StoreDir) {
    support::eventually(LIMIT, "the idle sandbox to be paused", || async {
        (running(instance).is_empty() && store.snapshots().len() == 1).then_some(())
    })
    .await;
}

pub fn text_plain(result: &Value) -> String {
    result["result"]["text/plain"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

pub async fn cell(client: &Client, conversation: &str, code: &str) -> Value {
    let answer = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": code}),
        )
        .await;
    assert!(
        answer.structured["error"].is_null(),
        "the cell ran: {}",
        answer.text
    );
    answer.structured
}

async fn pauses_and_resumes_in(era: Era) {
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let gateway = Gateway::start(&database, &pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, era)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first = cell(
        &client,
        &conversation,
        "v = 41\nopen('/home/user/kept.txt', 'w').write('kept')\nv",
    )
    .await;
    let sandbox_id = first["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    assert!(first["resumed"].is_null(), "a fresh sandbox: {first}");
    until_paused(&gateway.instance, &store).await;

    let after = cell(
        &client,
        &conversation,
        "v += 1\n(v, open('/home/user/kept.txt').read())",
    )
    .await;
    assert_eq!(after["sandbox_id"], sandbox_id.as_str(), "the same sandbox");
    assert_eq!(
        text_plain(&after),
        "(42, 'kept')",
        "the variable and the file survived the pause: {after}"
    );
    assert!(
        after["resumed"]["paused_seconds"].as_f64().is_some(),
        "the result says it was resumed: {after}"
    );
    assert!(
        store.snapshots().is_empty(),
        "a resumed sandbox's snapshot is deleted"
    );

    // Another tenant naming the paused sandbox hears what a missing one would say.
    until_paused(&gateway.instance, &store).await;
    let other = gateway.create_tenant().await;
    let other_token = gateway.token(&other).await;
    let intruder = Client::connect(&gateway.mcp_url(), &other_token, era)
        .await
        .expect("client connects");
    intruder
        .assert_foreign_looks_missing("execute_code", json!({"code": "v"}), &sandbox_id)
        .await;
    assert_eq!(store.snapshots().len(), 1, "the intruder resumed nothing");

    // Closing a paused sandbox deletes its snapshot.
    client
        .ok("close_sandbox", json!({"sandbox_id": sandbox_id}))
        .await;
    support::eventually(LIMIT, "the closed sandbox's snapshot to go", || async {
        store.snapshots().is_empty().then_some(())
    })
    .await;
    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn an_idle_sandbox_pauses_and_resumes_with_its_state_stateless_era() {
    if !runsc2024_registered() {
        return;
    }
    pauses_and_resumes_in(Era::Stateless).await;
}

#[tokio::test]
async fn an_idle_sandbox_pauses_and_resumes_with_its_state_sessions_era() {
    if !runsc2024_registered() {
        return;
    }
    pauses_and_resumes_in(Era::Sessions).await;
}

#[tokio::test]
async fn a_paused_sandbox_resumes_after_the_gateway_restarts() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let env = pausing_env(&plain, &store);
    let mut gateway = Gateway::start(&database, &env).await;
    let instance = gateway.instance.clone();
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let first = cell(&client, &conversation, "w = 'before the restart'\nw").await;
    let sandbox_id = first["sandbox_id"].as_str().expect("an id").to_owned();
    until_paused(&instance, &store).await;
    assert!(gateway.terminate().await, "sandgate stops on SIGTERM");
    drop(client);

    let gateway = Gateway::start_instance(&database, &instance, &env).await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let after = cell(&client, &conversation, "w").await;
    assert_eq!(after["sandbox_id"], sandbox_id.as_str(), "{after}");
    assert_eq!(text_plain(&after), "'before the restart'", "{after}");
    assert!(after["resumed"].is_object(), "{after}");
    support::remove_containers_of(&instance);
}

#[tokio::test]
async fn ten_pause_and_resume_cycles_keep_every_file_and_variable_and_the_idle_timeout() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let gateway = Gateway::start(&database, &pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    // Its own idle timeout (3 s), not the default (2 s): a resume must keep it.
    let created = client
        .ok(
            "create_sandbox",
            json!({"conversation_id": conversation, "keep_alive_seconds": 3}),
        )
        .await;
    let sandbox_id = created.structured["sandbox_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    cell(&client, &conversation, "kept = []").await;
    for round in 0..10 {
        let code = format!(
            "kept.append({round})\nopen(f'/home/user/round-{round}.txt', 'w').write('{round}')\n\
             import os\n(kept == list(range({round} + 1)), \
             all(open(f'/home/user/round-{{i}}.txt').read() == str(i) for i in range({round} + 1)))"
        );
        until_paused(&gateway.instance, &store).await;
        let answer = cell(&client, &conversation, &code).await;
        assert_eq!(answer["sandbox_id"], sandbox_id.as_str(), "round {round}");
        assert_eq!(
            text_plain(&answer),
            "(True, True)",
            "round {round}: every variable and file of the rounds before is kept: {answer}"
        );
        assert!(answer["resumed"].is_object(), "round {round}: {answer}");
    }
    let again = client
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await;
    assert_eq!(
        again.structured["idle_timeout_seconds"], 3,
        "the resumed sandbox keeps its own idle timeout: {}",
        again.text
    );
    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn retention_closes_a_paused_sandbox_and_its_conversation_hears_why() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    // The deployment keeps pauses its default 30 days; this tenant's own retention is 3 s
    // (`admin tenant retention --paused`): the retention pass closes its pause then.
    let gateway = Gateway::start(&database, &pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let set = gateway
        .cli(&["admin", "tenant", "retention", &tenant, "--paused", "3s"])
        .await;
    assert!(set.contains("paused sandboxes kept 3s"), "{set}");
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");

    // Retention: the paused sandbox is closed, its snapshot deleted from the store, and the
    // conversation's next call hears why its state is gone.
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first = cell(&client, &conversation, "r = 1\nr").await;
    let old = first["sandbox_id"].as_str().expect("an id").to_owned();
    until_paused(&gateway.instance, &store).await;
    support::eventually(LIMIT, "retention to delete the snapshot", || async {
        store.snapshots().is_empty().then_some(())
    })
    .await;
    let after = cell(&client, &conversation, "'r' in globals()").await;
    assert_ne!(after["sandbox_id"], old.as_str(), "a new sandbox: {after}");
    assert_eq!(after["state_lost"], true, "{after}");
    assert_eq!(
        after["previous_sandbox"]["sandbox_id"],
        old.as_str(),
        "{after}"
    );
    assert!(
        after["previous_sandbox"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("retention"),
        "the reason names the retention: {after}"
    );

    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn purging_a_tenant_deletes_its_paused_sandboxes_snapshots() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let gateway = Gateway::start(&database, &pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    cell(&client, &conversation, "p = 1").await;
    until_paused(&gateway.instance, &store).await;
    let purged = gateway.cli(&["admin", "tenant", "purge", &tenant]).await;
    assert!(purged.contains("snapshots of paused sandboxes"), "{purged}");
    assert!(
        store.snapshots().is_empty(),
        "the purge deleted the tenant's snapshots from the store: {purged}"
    );
    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn a_fork_diverges_from_its_source() {
    if !runsc2024_registered() {
        return;
    }
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let gateway = Gateway::start(&database, &pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first = cell(
        &client,
        &conversation,
        "a = 1\nopen('/home/user/shared.txt', 'w').write('before')\na",
    )
    .await;
    let source = first["sandbox_id"].as_str().expect("an id").to_owned();
    let forked = client
        .ok("fork_sandbox", json!({"conversation_id": conversation}))
        .await;
    let fork = forked.structured["sandbox_id"]
        .as_str()
        .expect("the fork's id")
        .to_owned();
    assert_ne!(fork, source, "a fork has a new id: {}", forked.text);
    assert_eq!(forked.structured["forked_from"], source.as_str());
    let in_fork = |code: &'static str| {
        let client = &client;
        let fork = fork.clone();
        async move {
            client
                .ok("execute_code", json!({"sandbox_id": fork, "code": code}))
                .await
                .structured
        }
    };
    let copied = in_fork("(a, open('/home/user/shared.txt').read())").await;
    assert_eq!(
        text_plain(&copied),
        "(1, 'before')",
        "the fork is a copy: {copied}"
    );
    in_fork("a = 2\nopen('/home/user/fork-only.txt', 'w').write('fork')").await;
    let source_view = cell(
        &client,
        &conversation,
        "import os\nb = 'source'\n(a, os.path.exists('/home/user/fork-only.txt'))",
    )
    .await;
    assert_eq!(
        source_view["sandbox_id"],
        source.as_str(),
        "the conversation keeps its source"
    );
    assert_eq!(
        text_plain(&source_view),
        "(1, False)",
        "the source sees none of the fork's changes: {source_view}"
    );
    let fork_view = in_fork("('b' in globals(), a)").await;
    assert_eq!(
        text_plain(&fork_view),
        "(False, 2)",
        "the fork sees none of the source's later changes: {fork_view}"
    );

    // Both transcripts mark the fork, each naming the other sandbox; the copy's holds none of
    // the source's cells, the source's none of the copy's.
    let source_page = crate::pause_many::transcript(&client, &source, "html").await;
    let fork_page = crate::pause_many::transcript(&client, &fork, "html").await;
    let mark = |page: &str, kind: &str| {
        let at = page
            .find(&format!("data-kind=\"{kind}\""))
            .unwrap_or_else(|| panic!("a {kind} mark: {page}"));
        page[at..at + page[at..].find("</div>").expect("its end")].to_owned()
    };
    assert!(
        mark(&source_page, "forked_into").contains(&fork),
        "the source's transcript names the copy: {source_page}"
    );
    assert!(
        mark(&fork_page, "forked_from").contains(&source),
        "the copy's transcript names the source: {fork_page}"
    );
    assert!(
        source_page.contains("a = 1") && !source_page.contains("a = 2"),
        "{source_page}"
    );
    assert!(
        fork_page.contains("a = 2") && !fork_page.contains("a = 1"),
        "{fork_page}"
    );
    let notes =
        crate::pause_many::notes(&crate::pause_many::transcript(&client, &fork, "ipynb").await);
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Forked from sandbox") && n.contains(&source.replace('_', "\\_"))),
        "the copy's notebook names the source: {notes:#?}"
    );
    support::remove_containers_of(&gateway.instance);
}

/// A tenant with an egress rule and a secret (issue 29): what the gateway delivered before a
/// call is delivered again to a resumed sandbox and to a fork, whose container is new: the
/// resumed sandbox keeps its placeholder and fetches through the relay, the secret filled in;
/// the fork gets a placeholder of its own and its own CA, and the source's placeholder, copied
/// into the fork's memory, is never filled in there.
#[tokio::test]
async fn a_resumed_sandbox_and_its_fork_reach_the_allowed_host_again() {
    use crate::egress_secrets::{get_cell, https_server};
    if !runsc2024_registered() {
        return;
    }
    let pki = sandgate_node::test_pki::Pki::new("sandgate e2e resume-and-fork CA");
    let (port, seen) = https_server(&pki, &["shop.sandgate.test"]).await;
    let dir = std::env::temp_dir().join(format!("sandgate-resume-egress-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("test-ca.pem");
    std::fs::write(&ca_file, pki.ca_pem()).unwrap();
    let hosts = format!("shop.sandgate.test=127.0.0.1:{port}");
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let store = StoreDir::new();
    let mut env = pausing_env(&plain, &store);
    env.push(("SANDGATE_EGRESS__TEST_HOSTS", &hosts));
    env.push(("SANDGATE_EGRESS__TEST_CA_FILE", ca_file.to_str().unwrap()));
    let gateway = Gateway::start(&database, &env).await;
    let tenant = gateway.create_tenant().await;
    let rule = format!("shop.sandgate.test:{port}");
    gateway
        .cli(&["admin", "tenant", "egress", &tenant, "--allow", &rule])
        .await;
    let value = format!("shpat_{}", uuid::Uuid::new_v4().simple());
    gateway
        .cli_stdin(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &tenant,
                "SHOP_TOKEN",
                "--host",
                "shop.sandgate.test",
                "--header",
                "authorization",
            ],
            &value,
        )
        .await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let url = format!("https://shop.sandgate.test:{port}/echo");
    // A cell that fetches with the placeholder `tok` (an expression) and prints it.
    let fetch_with = |tok: &str| {
        let fetch = get_cell(&url, "{'Authorization': 'Bearer ' + tok}", "True").replacen(
            "tok = os.environ.get('SHOP_TOKEN', '')",
            &format!("tok = {tok}"),
            1,
        );
        format!("{fetch}print('TOKEN', tok)\n")
    };
    // The kernel's placeholder now, kept in `kept`.
    let fetch = format!("{}kept = tok\n", fetch_with("os.environ['SHOP_TOKEN']"));
    let stdout = |result: &Value| result["stdout"].as_str().unwrap_or_default().to_owned();
    let last_head = || {
        seen.lock()
            .unwrap()
            .last()
            .cloned()
            .unwrap_or_default()
            .to_lowercase()
    };
    let filled = format!("authorization: bearer {}", value.to_lowercase());

    let first = cell(&client, &conversation, &fetch).await;
    let source = first["sandbox_id"].as_str().expect("an id").to_owned();
    let out = stdout(&first);
    let placeholder = out
        .lines()
        .find_map(|l| l.strip_prefix("TOKEN "))
        .unwrap_or_default()
        .to_owned();
    assert!(
        out.starts_with("STATUS 200") && placeholder.starts_with("sgp_"),
        "before the pause the fetch goes through: {out}"
    );
    assert!(last_head().contains(&filled), "the value was filled in");

    until_paused(&gateway.instance, &store).await;
    let requests = seen.lock().unwrap().len();
    let resumed = cell(&client, &conversation, &fetch).await;
    let out = stdout(&resumed);
    assert!(
        resumed["resumed"]["paused_seconds"].as_f64().is_some(),
        "the sandbox was resumed: {resumed}"
    );
    assert!(
        out.starts_with("STATUS 200")
            && out.contains(&format!("ECHO Bearer {placeholder}"))
            && out.contains(&format!("TOKEN {placeholder}")),
        "a resumed sandbox keeps its placeholder and reaches the host: {out}"
    );
    assert_eq!(seen.lock().unwrap().len(), requests + 1, "one more request");
    assert!(
        last_head().contains(&filled),
        "the resumed sandbox's request got the value"
    );
    assert!(!out.contains(&value), "never the value: {out}");

    let forked = client
        .ok("fork_sandbox", json!({"conversation_id": conversation}))
        .await;
    let fork = forked.structured["sandbox_id"]
        .as_str()
        .expect("the fork's id")
        .to_owned();
    assert_ne!(fork, source, "a fork has a new id: {}", forked.text);
    let in_fork = |code: String| {
        let client = &client;
        let fork = fork.clone();
        async move {
            client
                .ok(
                    "execute_code",
                    json!({"sandbox_id": fork, "code": code, "timeout_seconds": 180}),
                )
                .await
                .structured
        }
    };
    // The fork's environment holds a placeholder of its own; the source's, which the fork's
    // memory holds too (`kept`), is not filled in for the fork.
    let out = stdout(&in_fork("import os\nprint('ENV', os.environ['SHOP_TOKEN'])".into()).await);
    let fork_placeholder = out
        .lines()
        .find_map(|l| l.strip_prefix("ENV "))
        .unwrap_or_default()
        .to_owned();
    assert!(
        fork_placeholder.starts_with("sgp_") && fork_placeholder != placeholder,
        "the fork gets a placeholder of its own: {out}"
    );
    let out = stdout(&in_fork(fetch_with("kept")).await);
    assert!(
        out.starts_with("STATUS 200") && out.contains(&format!("TOKEN {placeholder}")),
        "the fork reaches the host, verifying its own CA: {out}"
    );
    assert!(
        last_head().contains(&format!("authorization: bearer {placeholder}")),
        "the source's placeholder is not filled in for the fork: {}",
        last_head()
    );
    let out = stdout(&in_fork(fetch_with("os.environ['SHOP_TOKEN']")).await);
    assert!(
        out.starts_with("STATUS 200")
            && out.contains(&format!("ECHO Bearer {fork_placeholder}"))
            && !out.contains(&value),
        "the fork's own placeholder goes through, redacted on the way back: {out}"
    );
    assert!(
        last_head().contains(&filled),
        "the fork's placeholder is filled in: {}",
        last_head()
    );
    support::remove_containers_of(&gateway.instance);
    let _ = std::fs::remove_dir_all(&dir);
}
