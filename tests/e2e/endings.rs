//! Honest endings (issue 27): a conversation whose sandbox ended (idle where it cannot be
//! paused, closed) is told so on its next call: `state_lost: true`, the previous sandbox's id,
//! when and why it ended. Here on the default runc profile without a snapshot store, where an
//! idle sandbox is closed, not paused.

use std::time::Duration;

use serde_json::json;

use crate::mcp_client::{Client, Era};
use crate::pause_files::files_env;
use crate::support::{self, Gateway};

const LIMIT: Duration = Duration::from_secs(120);

#[tokio::test]
async fn a_conversation_whose_sandbox_ended_hears_so_on_its_next_call() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_SANDBOX__RUNTIME", "runc"),
            ("SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS", "2"),
            ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "200"),
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_POOL__MAX_READY", "0"),
        ],
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let run = |code: &'static str| {
        let client = &client;
        let conversation = conversation.clone();
        async move {
            client
                .ok(
                    "execute_code",
                    json!({"conversation_id": conversation, "code": code}),
                )
                .await
        }
    };
    let first = run("v = 1\nv").await;
    assert_eq!(first.structured["state_lost"], false, "{}", first.text);
    assert!(
        first.structured["previous_sandbox"].is_null(),
        "{}",
        first.text
    );
    let old = first.structured["sandbox_id"].as_str().unwrap().to_owned();

    // Idle past its timeout: closed (runc cannot be paused), its container removed. (Polling
    // with calls would keep it alive: watch the engine instead.)
    support::eventually(LIMIT, "the idle sandbox's container to go", || async {
        support::containers_of(&gateway.instance)
            .is_empty()
            .then_some(())
    })
    .await;
    let after = run("'v' in globals()").await;
    assert_ne!(
        after.structured["sandbox_id"],
        old.as_str(),
        "{}",
        after.text
    );
    assert_eq!(
        after.structured["state_lost"], true,
        "a new sandbox for the conversation says its state is lost: {}",
        after.text
    );
    assert_eq!(after.structured["result"]["text/plain"], "False");
    let previous = &after.structured["previous_sandbox"];
    assert_eq!(previous["sandbox_id"], old.as_str(), "{}", after.text);
    assert!(
        previous["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("idle"),
        "the reason says it idled: {}",
        after.text
    );
    assert!(previous["ended_at"].is_string(), "{}", after.text);
    assert!(
        after.text.contains(&old),
        "the text names it: {}",
        after.text
    );

    // Closed by the bot: the next call by conversation hears that too; the one after does not.
    let current = after.structured["sandbox_id"].as_str().unwrap().to_owned();
    client
        .ok("close_sandbox", json!({"sandbox_id": current}))
        .await;
    let reopened = run("1").await;
    assert_eq!(reopened.structured["state_lost"], true, "{}", reopened.text);
    assert_eq!(
        reopened.structured["previous_sandbox"]["sandbox_id"],
        current.as_str()
    );
    assert_eq!(
        reopened.structured["previous_sandbox"]["reason"], "it was closed",
        "{}",
        reopened.text
    );
    let next = run("2").await;
    assert_eq!(next.structured["state_lost"], false, "{}", next.text);
    support::remove_containers_of(&gateway.instance);
}

/// A conversation's sandbox past `limits.max_lifetime_seconds`, first while it is live (its
/// idle timeout far away), then while it is paused with its files (runc into a store): each
/// time the next call by conversation gets a new sandbox and is told the lifetime ended the
/// previous one; the paused one's snapshot is deleted from the store.
#[tokio::test]
async fn a_conversation_whose_sandbox_reached_its_lifetime_hears_so_live_or_paused() {
    let database = support::fresh_database().await;
    let store = crate::pause::StoreDir::new();
    // Live: idle timeout 600 s, lifetime 3 s.
    let live = Gateway::start(
        &database,
        &[
            ("SANDGATE_SANDBOX__RUNTIME", "runc"),
            ("SANDGATE_LIMITS__MAX_LIFETIME_SECONDS", "3"),
            ("SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS", "600"),
            ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "200"),
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_POOL__MAX_READY", "0"),
        ],
    )
    .await;
    let tenant = live.create_tenant().await;
    let token = live.token(&tenant).await;
    ends_by_lifetime(&live, &token, None).await;
    support::remove_containers_of(&live.instance);
    drop(live);

    // Paused: the files-only pause's gateway (runc, idle after 2 s into the store), lifetime
    // 10 s (room for the pause to end first).
    let env = files_env(&store, &[("SANDGATE_LIMITS__MAX_LIFETIME_SECONDS", "10")]);
    let paused = Gateway::start(&database, &env).await;
    let token = paused.token(&tenant).await;
    ends_by_lifetime(&paused, &token, Some(&store)).await;
    support::remove_containers_of(&paused.instance);
}

/// Runs a cell in a new conversation, waits for its sandbox to end by its lifetime (paused into
/// `store` first, when given) and checks what the next call by conversation is told.
async fn ends_by_lifetime(gateway: &Gateway, token: &str, store: Option<&crate::pause::StoreDir>) {
    let client = Client::connect(&gateway.mcp_url(), token, Era::Stateless)
        .await
        .expect("client connects");
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "v = 1\nv"}),
        )
        .await;
    assert_eq!(first.structured["state_lost"], false, "{}", first.text);
    let old = first.structured["sandbox_id"].as_str().unwrap().to_owned();
    support::eventually(LIMIT, "the sandbox's container to go", || async {
        support::containers_of(&gateway.instance)
            .is_empty()
            .then_some(())
    })
    .await;
    if let Some(store) = store {
        // It paused (one snapshot), then its lifetime ended it and the snapshot went.
        support::eventually(
            LIMIT,
            "the paused sandbox's snapshot to be kept",
            || async { (!store.snapshots().is_empty()).then_some(()) },
        )
        .await;
        support::eventually(
            LIMIT,
            "the snapshot to be deleted at the end of its lifetime",
            || async { store.snapshots().is_empty().then_some(()) },
        )
        .await;
    }
    let after = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "'v' in globals()"}),
        )
        .await;
    assert_ne!(
        after.structured["sandbox_id"],
        old.as_str(),
        "{}",
        after.text
    );
    assert_eq!(after.structured["state_lost"], true, "{}", after.text);
    assert_eq!(after.structured["result"]["text/plain"], "False");
    let previous = &after.structured["previous_sandbox"];
    assert_eq!(previous["sandbox_id"], old.as_str(), "{}", after.text);
    assert_eq!(
        previous["reason"], "it reached its maximum lifetime",
        "the reason is its lifetime: {}",
        after.text
    );
}
