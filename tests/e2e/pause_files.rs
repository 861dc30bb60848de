//! The files-only pause (issue 27), through the real binary on the default runc profile, which
//! cannot checkpoint: a conversation's sandbox idles past its timeout, its container is removed
//! and its row is `paused` with `paused_kind = files`, one sealed snapshot in the store; the next
//! `execute_code` by `conversation_id` gets a fresh kernel under the same `sandbox_id` with its
//! files (links kept as links) and its pip installs back, and says `state_lost: true`, "resumed
//! from files: variables were not kept". Another tenant naming it hears what a missing sandbox
//! would say; `fork_sandbox` refuses it plainly. A home whose archive is over the tenant's
//! storage quota is not kept: the sandbox is closed and the conversation hears so.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::Connection;

use crate::mcp_client::{Client, Era};
use crate::packages::serve_index;
use crate::pause::StoreDir;
use crate::support::{self, Gateway};
use crate::wheels::TempDir;

const LIMIT: Duration = Duration::from_secs(300);

/// A gateway on runc that pauses idle sandboxes after 2 s into `store`, with `extra` settings.
pub(crate) fn files_env<'a>(
    store: &'a StoreDir,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("SANDGATE_SANDBOX__RUNTIME", "runc"),
        ("SANDGATE_SNAPSHOTS__STORE_DIR", store.path()),
        ("SANDGATE_SNAPSHOTS__TEMPLATES", "false"),
        ("SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS", "2"),
        ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "200"),
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_POOL__MAX_READY", "0"),
    ];
    env.extend_from_slice(extra);
    env
}

fn running(instance: &str) -> Vec<String> {
    support::docker_words(&[
        "ps",
        "-aq",
        "--no-trunc",
        "--filter",
        &format!("label=sandgate.instance={instance}"),
    ])
}

/// The sandbox's state and paused kind, from Postgres.
async fn row_of(database_url: &str, sandbox_id: &str) -> (String, Option<String>) {
    let mut conn = sqlx::PgConnection::connect(database_url)
        .await
        .expect("Postgres connects");
    sqlx::query_as("SELECT state, paused_kind FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut conn)
        .await
        .expect("the sandbox's row")
}

async fn cell(client: &Client, conversation: &str, code: &str) -> Value {
    let answer = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": code}),
        )
        .await;
    let mut out = answer.structured;
    out["text"] = json!(answer.text);
    out
}

#[tokio::test]
async fn an_idle_runc_sandbox_pauses_with_its_files_and_resumes_without_its_variables() {
    let (_index, addr, _wheels) = serve_index().await;
    let cache = TempDir::new("sandgate-test-wheel-cache");
    let index_url = format!("http://{addr}/simple/");
    let cache_dir = cache.path().display().to_string();
    let database = support::fresh_database().await;
    let store = StoreDir::new();
    let env = files_env(
        &store,
        &[
            ("SANDGATE_PACKAGES__INDEX_URL", index_url.as_str()),
            ("SANDGATE_PACKAGES__CACHE_DIR", cache_dir.as_str()),
        ],
    );
    let gateway = Gateway::start(&database, &env).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());

    // A variable, a file, a file with an odd name, a link out of /home/user, and a package.
    let first = cell(
        &client,
        &conversation,
        "import os\nv = 41\nopen('/home/user/kept.txt', 'w').write('kept')\n\
         os.makedirs('/home/user/d', exist_ok=True)\n\
         open('/home/user/d/odd name\\nline.txt', 'w').write('odd')\n\
         os.symlink('/etc/hostname', '/home/user/link-out')\nv",
    )
    .await;
    assert!(first["error"].is_null(), "the cell ran: {}", first["text"]);
    let sandbox_id = first["sandbox_id"].as_str().expect("an id").to_owned();
    let installed = client
        .ok(
            "install_packages",
            json!({"sandbox_id": sandbox_id, "packages": ["sgtool"]}),
        )
        .await;
    assert!(
        installed.text.contains("sgtool"),
        "sgtool is installed: {}",
        installed.text
    );

    support::eventually(
        LIMIT,
        "the idle runc sandbox to be paused with its files",
        || async {
            (running(&gateway.instance).is_empty() && store.snapshots().len() == 1).then_some(())
        },
    )
    .await;
    assert_eq!(
        row_of(&gateway.database_url, &sandbox_id).await,
        ("paused".to_owned(), Some("files".to_owned())),
        "the row is paused, files only"
    );
    let sealed = std::fs::read(&store.snapshots()[0]).expect("the snapshot is readable");
    assert!(sealed.starts_with(b"SGSNAPv1"), "sealed like a checkpoint");
    let head = String::from_utf8_lossy(&sealed[..sealed.len().min(4096)]).into_owned();
    assert!(
        head.contains(r#""content":"files""#),
        "its header says files only"
    );
    assert!(
        !sealed.windows(4).any(|w| w == b"kept"),
        "the archive is not in the clear at rest"
    );

    // Another tenant naming it hears what a missing sandbox would say, and resumes nothing.
    let other = gateway.create_tenant().await;
    let other_token = gateway.token(&other).await;
    let intruder = Client::connect(&gateway.mcp_url(), &other_token, Era::Stateless)
        .await
        .expect("client connects");
    intruder
        .assert_foreign_looks_missing("execute_code", json!({"code": "1"}), &sandbox_id)
        .await;
    assert_eq!(store.snapshots().len(), 1, "the intruder resumed nothing");

    // A fork needs a checkpoint: refused, saying why; still paused.
    let fork = client
        .call("fork_sandbox", json!({"sandbox_id": sandbox_id}))
        .await
        .expect("a tool result");
    assert!(
        fork.is_error && fork.text.contains("files only"),
        "fork of a files-only pause is refused plainly: {}",
        fork.text
    );
    assert_eq!(
        store.snapshots().len(),
        1,
        "the refused fork resumed nothing"
    );

    let after = cell(
        &client,
        &conversation,
        "import os, sgtool\n('v' in globals(), open('/home/user/kept.txt').read(), \
         open('/home/user/d/odd name\\nline.txt').read(), os.readlink('/home/user/link-out'), \
         sgtool.NAME)",
    )
    .await;
    assert!(after["error"].is_null(), "the cell ran: {}", after["text"]);
    assert_eq!(
        after["sandbox_id"],
        sandbox_id.as_str(),
        "the same sandbox id"
    );
    assert_eq!(
        after["result"]["text/plain"], "(False, 'kept', 'odd', '/etc/hostname', 'sgtool')",
        "files, the link and the package are back, the variable is not: {}",
        after["text"]
    );
    assert_eq!(after["state_lost"], true, "{}", after["text"]);
    assert_eq!(
        after["state_lost_reason"],
        "resumed from files: variables were not kept"
    );
    assert_eq!(after["resumed"]["from_files"], true, "{after}");
    assert_eq!(
        after["resumed"]["packages_reinstalled"],
        json!(["sgtool==2.0"]),
        "{after}"
    );
    assert!(
        after["text"]
            .as_str()
            .unwrap()
            .contains("resumed from files: variables were not kept"),
        "the text says so: {}",
        after["text"]
    );
    assert!(
        store.snapshots().is_empty(),
        "the resumed snapshot is deleted"
    );
    assert_eq!(row_of(&gateway.database_url, &sandbox_id).await.0, "leased");
    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn a_home_over_the_storage_quota_is_not_kept_and_the_conversation_hears_so() {
    let database = support::fresh_database().await;
    let store = StoreDir::new();
    let gateway = Gateway::start(
        &database,
        &files_env(&store, &[("SANDGATE_SNAPSHOTS__TENANT_MAX_BYTES", "65536")]),
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first = cell(
        &client,
        &conversation,
        "import os\nopen('/home/user/big.bin', 'wb').write(os.urandom(1 << 20))",
    )
    .await;
    let sandbox_id = first["sandbox_id"].as_str().expect("an id").to_owned();
    support::eventually(LIMIT, "the idle sandbox to be closed", || async {
        let (state, _) = row_of(&gateway.database_url, &sandbox_id).await;
        (state == "closed" && running(&gateway.instance).is_empty()).then_some(())
    })
    .await;
    assert!(store.snapshots().is_empty(), "nothing was kept");
    let after = cell(&client, &conversation, "1").await;
    assert_ne!(after["sandbox_id"], sandbox_id.as_str(), "a new sandbox");
    assert_eq!(after["state_lost"], true, "{}", after["text"]);
    assert_eq!(
        after["previous_sandbox"]["sandbox_id"],
        sandbox_id.as_str(),
        "{}",
        after["text"]
    );
    support::remove_containers_of(&gateway.instance);
}
