//! Resuming a paused sandbox and "take over in a copy" from the console (issue 28), in
//! headless Chromium, on a gateway that pauses idle sandboxes (the `pause` tests' settings):
//! the bot's sandbox idles into a pause; another tenant's user gets the missing-conversation
//! page for its fork, resume and download URLs (and resumes nothing); the owner's user resumes
//! it from the page, forks it into a copy with a conversation of its own and works there; the
//! bot's sandbox is untouched; the audit trail has the resume and the fork under the user.
//!
//! Skipped, saying so, where the engine has no `runsc2024` runtime.

use reqwest::StatusCode;
use serde_json::json;

use super::{new_user, signed_in, takeover, text_with};
use crate::mcp_client::{Client, Era};
use crate::pause::{StoreDir, pausing_env, plain_dir, runsc2024_registered, until_paused};
use crate::support::oauth::{PASSWORD, Stack, url_encode};
use crate::support::{self};
use crate::webdriver::Browser;

#[tokio::test]
async fn a_person_resumes_a_paused_sandbox_and_takes_over_in_a_copy() {
    if !runsc2024_registered() {
        return;
    }
    let store = StoreDir::new();
    let plain = plain_dir();
    let mut env = pausing_env(&plain, &store);
    // Long enough for the page to show the resumed sandbox running before it idles again.
    for (key, value) in &mut env {
        if *key == "SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS" {
            *value = "6";
        }
    }
    let stack = Stack::start(&env).await;
    takeover(&stack, &stack.email).await;
    let token = stack.gateway.token(&stack.tenant).await;
    let bot = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let conversation = format!("ticket-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    bot.ok(
        "execute_code",
        json!({"conversation_id": conversation, "code": "x = 41\nopen('bot.txt', 'w').write('from the bot')"}),
    )
    .await;
    until_paused(&stack.gateway.instance, &store).await;

    // Another tenant's user (with the takeover role) can neither resume, fork nor download.
    let other_tenant = stack.gateway.create_tenant().await;
    let intruder = new_user(&stack, &other_tenant).await;
    takeover(&stack, &intruder).await;
    let (mut them, their_csrf) = signed_in(&stack, &intruder).await;
    let missing = them
        .get(&stack.url("/console/conversation?id=no-such-conversation"))
        .await;
    for action in ["/console/resume", "/console/fork"] {
        let refused = them
            .post(
                &stack.url(action),
                &[("csrf", &their_csrf), ("conversation", &conversation)],
            )
            .await;
        assert_eq!(refused.status, StatusCode::NOT_FOUND, "{action}");
        assert_eq!(refused.body, missing.body, "{action}: the missing page");
    }
    let file = |conversation: &str| {
        format!(
            "/console/file?conversation={}&path=%2Fhome%2Fuser%2Fbot.txt",
            url_encode(conversation)
        )
    };
    let download = them.get(&stack.url(&file(&conversation))).await;
    assert_eq!(download.status, StatusCode::NOT_FOUND, "downloads");
    assert_eq!(
        store.snapshots().len(),
        1,
        "the intruder resumed nothing: the sandbox is still paused"
    );

    // The owner's user resumes it from the page, then takes over in a copy.
    let chromium = Browser::start().await;
    chromium.goto(&stack.url("/apps")).await;
    chromium.type_into("#email", &stack.email).await;
    chromium.type_into("#password", PASSWORD).await;
    chromium.click("#sign-in").await;
    // Signed in: the apps page with its console link (a page opened before would be the
    // sign-in form again).
    chromium.find("#console").await;
    chromium
        .goto(&stack.url(&format!(
            "/console/conversation?id={}",
            url_encode(&conversation)
        )))
        .await;
    text_with(&chromium, "#sandbox", "is paused").await;
    chromium.click("#resume").await;
    text_with(&chromium, "#sandbox", "Live sandbox").await;
    text_with(&chromium, "#files", "bot.txt").await;
    chromium.click("#fork").await;
    let title = text_with(&chromium, "#title", "~copy-").await;
    let copy = title
        .trim()
        .strip_prefix("Conversation ")
        .expect("the copy's page names its conversation")
        .to_owned();
    assert!(copy.starts_with(&conversation), "{copy}");
    chromium
        .type_into("#code", "x = x + 1000\nprint('the copy has', x)")
        .await;
    chromium.click("#run").await;
    text_with(&chromium, "#live-output", "the copy has 1041").await;
    text_with(&chromium, "#run-state", "finished").await;
    chromium.quit().await;

    // The copy's file downloads from the console; the intruder's try at it is refused.
    let (mut owner, _) = signed_in(&stack, &stack.email).await;
    let mine = owner.get(&stack.url(&file(&copy))).await;
    assert_eq!(mine.status, StatusCode::OK, "{}", mine.body);
    assert_eq!(mine.body, "from the bot");
    let theirs = them.get(&stack.url(&file(&copy))).await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND, "the copy's downloads");

    // The bot's sandbox did not see the person's work in the copy.
    let seen = bot
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "x"}),
        )
        .await;
    assert_eq!(
        seen.structured["result"]["text/plain"], "41",
        "the bot's sandbox is untouched: {:?}",
        seen.structured
    );

    // The resume and the fork are audited under the person.
    let audit = stack
        .gateway
        .cli(&["admin", "audit", "--tenant", &stack.tenant, "--limit", "50"])
        .await;
    let user = format!("user:{}", stack.email);
    for tool in ["console_resume_sandbox", "console_fork_sandbox"] {
        assert!(
            audit.lines().any(|l| l.contains(tool) && l.contains(&user)),
            "{tool} is audited under {user}:\n{audit}"
        );
    }
    support::remove_containers_of(&stack.gateway.instance);
}
