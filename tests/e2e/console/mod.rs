//! The console (issue 28) end to end: a tenant's user takes over the bot's live sandbox in
//! headless Chromium while the bot is the official Python SDK; and the attackers: another
//! tenant's user, a read-only user, a cross-site form, a stale sign-in, a revoked session,
//! hostile output; and in [`copy`], resuming a paused sandbox and taking over in a copy.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection as _;

use crate::mcp_client::{Client, Era};
use crate::python_sdk::{python, run_python};
use crate::support::oauth::{Browser as HttpBrowser, PASSWORD, Stack, hidden, url_encode};
use crate::support::{self, eventually};
use crate::webdriver::Browser;

mod copy;

const BOT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/e2e/python/console_bot.py"
);

/// A loopback listener counting the connections made to it: where the hostile HTML points.
async fn remote_server() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((_stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    (url, hits)
}

/// Gives the stack's user the takeover role.
async fn takeover(stack: &Stack, email: &str) {
    let out = stack
        .gateway
        .cli(&[
            "admin", "user", "role", "--email", email, "--role", "takeover",
        ])
        .await;
    assert!(out.contains("takeover"), "the role is set: {out}");
}

/// Waits until the element's visible text contains `needle`; returns the text.
async fn text_with(browser: &Browser, css: &str, needle: &str) -> String {
    let deadline = Duration::from_secs(90);
    let start = std::time::Instant::now();
    loop {
        // The page may be reloading (after an upload or a form's post): an element that is
        // missing or stale is read again.
        if let Some(text) = browser.text_now(css).await
            && text.contains(needle)
        {
            return text;
        }
        if start.elapsed() >= deadline {
            let url = browser.url().await;
            let body = browser.text_now("body").await.unwrap_or_default();
            panic!(
                "timed out after {deadline:?} waiting for {css} to show {needle:?}; the page at \
                 {url} reads:\n{body}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn bot(stack: &Stack, token: &str, args: &[&str]) -> String {
    run_python(
        &python(),
        BOT,
        args,
        &stack.gateway.mcp_url(),
        token,
        Duration::from_secs(240),
    )
    .await
}

#[tokio::test]
async fn a_person_takes_over_the_bots_sandbox_in_the_browser() {
    let stack = Stack::start(&[]).await;
    takeover(&stack, &stack.email).await;
    let token = stack.gateway.token(&stack.tenant).await;
    let conversation = format!("ticket-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let (remote, hits) = remote_server().await;
    bot(
        &stack,
        &token,
        &[
            "--phase",
            "work",
            "--conversation",
            &conversation,
            "--remote",
            &remote,
        ],
    )
    .await;

    // The user signs in, finds the conversation by its id and sees what the bot did.
    let chromium = Browser::start().await;
    chromium.goto(&stack.url("/apps")).await;
    chromium.type_into("#email", &stack.email).await;
    chromium.type_into("#password", PASSWORD).await;
    chromium.click("#sign-in").await;
    chromium.click("#console").await;
    chromium.type_into("#q", &conversation).await;
    chromium.click("#search").await;
    // The search's page, not the list it replaces (whose row would go stale under the click).
    eventually(Duration::from_secs(30), "the search's page", || async {
        chromium.url().await.contains("q=").then_some(())
    })
    .await;
    chromium
        .click(&format!("tr[data-conversation='{conversation}'] a"))
        .await;
    let notebook = text_with(&chromium, "#notebook", "groupby").await;
    assert!(
        notebook.contains("by the bot"),
        "the bot's cells are marked: {notebook}"
    );
    assert!(
        notebook.contains("<script>document.title = \"pwned-print\"</script>"),
        "a printed script shows as text: {notebook}"
    );
    chromium.find("img[alt=chart]").await;
    chromium.find("iframe.html[sandbox='']").await;

    // A cell that reads the bot's DataFrame and writes a file.
    chromium
        .type_into(
            "#code",
            "human_total = int(df['amount'].sum())\nopen('human.csv', 'w').write(f'total,{human_total}')\nprint('human wrote', human_total)",
        )
        .await;
    chromium.click("#run").await;
    text_with(&chromium, "#live-output", "human wrote 22").await;
    text_with(&chromium, "#run-state", "finished").await;

    // A slow cell streams its output, and the interrupt stops it.
    chromium
        .goto(&stack.url(&format!(
            "/console/conversation?id={}",
            url_encode(&conversation)
        )))
        .await;
    chromium
        .type_into(
            "#code",
            "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.2)\n",
        )
        .await;
    chromium.click("#run").await;
    text_with(&chromium, "#live-output", "tick 2").await;
    chromium.click("#interrupt").await;
    let state = text_with(&chromium, "#run-state", "KeyboardInterrupt").await;
    assert!(
        state.contains("a person"),
        "the interrupt names a person: {state}"
    );

    // A file uploaded from the page lands in /home/user.
    let upload = std::env::temp_dir().join(format!("notes-{}.txt", uuid::Uuid::new_v4().simple()));
    std::fs::write(&upload, "from the person\n").unwrap();
    chromium
        .goto(&stack.url(&format!(
            "/console/conversation?id={}",
            url_encode(&conversation)
        )))
        .await;
    chromium
        .type_into("#upload-file", upload.to_str().unwrap())
        .await;
    chromium.click("#upload").await;
    let name = upload.file_name().unwrap().to_str().unwrap().to_owned();
    text_with(&chromium, "#files", &name).await;
    let _ = std::fs::remove_file(&upload);

    // The notebook marks the person's cells, and the file is there to download.
    chromium
        .goto(&stack.url(&format!(
            "/console/conversation?id={}",
            url_encode(&conversation)
        )))
        .await;
    let notebook = text_with(&chromium, "#notebook", &format!("by {}", stack.email)).await;
    assert!(notebook.contains("human_total"), "{notebook}");
    let files = text_with(&chromium, "#files", "/home/user/human.csv").await;
    assert!(files.contains("human.csv"), "{files}");
    let title = chromium.title().await;
    assert!(
        !title.contains("pwned"),
        "no output's script ran: {title:?}"
    );
    chromium.resize(1280, 1400).await;
    chromium.scroll_to(".entry:not([data-by=bot])").await;
    let png = chromium.screenshot().await;
    std::fs::write(crate::webdriver::artifacts_dir().join("console.png"), &png).unwrap();
    if std::env::var_os("UPDATE_DOCS_SCREENSHOTS").is_some() {
        let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/console.png");
        std::fs::write(docs, &png).unwrap();
    }
    chromium.quit().await;
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the HTML display's remote image and stylesheet were never fetched"
    );

    // The bot's next call finds the person's variable and file, and is told a person acted.
    let text = bot(
        &stack,
        &token,
        &["--phase", "check", "--conversation", &conversation],
    )
    .await;
    assert!(
        text.contains("22 total,22"),
        "the bot sees the human's work: {text}"
    );
    assert!(
        text.contains(&format!("a person ({})", stack.email)),
        "the bot is told a person acted: {text}"
    );

    // The audit trail has the person's runs under their user.
    let audit = stack
        .gateway
        .cli(&["admin", "audit", "--tenant", &stack.tenant, "--limit", "50"])
        .await;
    let mine: Vec<&str> = audit
        .lines()
        .filter(|l| {
            l.contains("console_execute_code") && l.contains(&format!("user:{}", stack.email))
        })
        .collect();
    assert!(
        mine.len() >= 2,
        "both of the person's cells are audited under them:\n{audit}"
    );
}

/// Signs `email` in and returns the browser and the console's CSRF token.
async fn signed_in(stack: &Stack, email: &str) -> (HttpBrowser, String) {
    let mut browser = HttpBrowser::new(stack);
    let first = browser.get(&stack.url("/console")).await;
    let login = first.location.expect("anonymous users log in first");
    browser.log_in(&login, email, PASSWORD).await;
    let list = browser.get(&stack.url("/console")).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    let apps = browser.get(&stack.url("/apps")).await;
    let csrf = hidden(&apps.body, "csrf").expect("a CSRF token");
    (browser, csrf)
}

async fn new_user(stack: &Stack, tenant: &str) -> String {
    let email = format!(
        "agent-{}@example.com",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    stack
        .gateway
        .cli_stdin(
            &[
                "admin", "user", "create", "--tenant", tenant, "--email", &email,
            ],
            &format!("{PASSWORD}\n"),
        )
        .await;
    email
}

#[tokio::test]
async fn other_tenants_readers_forged_forms_and_stale_sign_ins_cannot_act() {
    let stack = Stack::start(&[]).await;
    takeover(&stack, &stack.email).await;
    let token = stack.gateway.token(&stack.tenant).await;
    let bot = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let conversation = format!("ticket-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    bot.ok(
        "execute_code",
        json!({"conversation_id": conversation, "code": "secret = 41\nopen('secret.txt', 'w').write('41')"}),
    )
    .await;
    let page = format!("/console/conversation?id={}", url_encode(&conversation));
    let run_form = |csrf: &str| {
        vec![
            ("csrf".to_owned(), csrf.to_owned()),
            ("conversation".to_owned(), conversation.clone()),
            ("kind".to_owned(), "cell".to_owned()),
            ("code".to_owned(), "secret = 0".to_owned()),
        ]
    };

    // Another tenant's user, with the takeover role, gets the missing-conversation page on
    // every URL of this conversation.
    let other_tenant = stack.gateway.create_tenant().await;
    let intruder = new_user(&stack, &other_tenant).await;
    takeover(&stack, &intruder).await;
    let (mut them, their_csrf) = signed_in(&stack, &intruder).await;
    let missing = them.get(&stack.url(&page)).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.body);
    assert!(missing.body.contains("No such conversation"));
    let nowhere = them
        .get(&stack.url("/console/conversation?id=no-such-conversation"))
        .await;
    assert_eq!(nowhere.status, StatusCode::NOT_FOUND);
    assert_eq!(
        nowhere.body, missing.body,
        "foreign and missing look the same"
    );
    let listed = them
        .get(&stack.url(&format!("/console?q={}", url_encode(&conversation))))
        .await;
    assert!(
        listed.body.contains("id=\"no-conversations\"")
            && !listed
                .body
                .contains(&format!("data-conversation=\"{conversation}\"")),
        "not listed for them: {}",
        listed.body
    );
    // Every action on this conversation answers them exactly as the same action on one that
    // does not exist: status and body (the run is also the output stream).
    let foreign = every_action(&mut them, &stack, &their_csrf, &conversation).await;
    let absent = every_action(&mut them, &stack, &their_csrf, "no-such-conversation").await;
    for ((action, status, body), (_, absent_status, absent_body)) in foreign.iter().zip(&absent) {
        assert_eq!(*status, StatusCode::NOT_FOUND, "{action}: {body}");
        assert_eq!(
            (status, body),
            (absent_status, absent_body),
            "{action}: another tenant's conversation answers as a missing one"
        );
    }
    let download = foreign
        .iter()
        .find(|(action, _, _)| *action == "file")
        .expect("the download was tried");
    assert_eq!(download.2, missing.body, "downloads: the missing page");

    // The owner's user: a form without the token, or from another site, is refused.
    let (mut owner, csrf) = signed_in(&stack, &stack.email).await;
    let shown = owner.get(&stack.url(&page)).await;
    assert_eq!(shown.status, StatusCode::OK);
    for h in [
        "content-security-policy",
        "x-frame-options",
        "cache-control",
    ] {
        assert!(shown.headers.contains_key(h), "the page carries {h}");
    }
    assert!(
        shown.body.contains("/console/file?conversation=") && !shown.body.contains("/files/"),
        "the page's downloads are the console's own"
    );
    let download = owner
        .get(&stack.url(&format!(
            "/console/file?conversation={}&path=%2Fhome%2Fuser%2Fsecret.txt",
            url_encode(&conversation)
        )))
        .await;
    assert_eq!(download.status, StatusCode::OK, "{}", download.body);
    assert_eq!(download.body, "41", "the file's bytes");
    assert!(
        download.headers["content-disposition"]
            .to_str()
            .unwrap()
            .starts_with("attachment"),
        "a download, not a page"
    );
    assert_eq!(download.headers["x-content-type-options"], "nosniff");
    let csp = shown.headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("default-src 'none'")
            && csp.contains("img-src data:")
            && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert!(
        !shown.body.contains(" onclick=") && !shown.body.contains(" onsubmit="),
        "no inline handlers"
    );
    let form = run_form("");
    let pairs = refs(&form);
    let forged = owner.post(&stack.url("/console/run"), &pairs[1..]).await;
    assert_eq!(
        forged.status,
        StatusCode::FORBIDDEN,
        "no token: {}",
        forged.body
    );
    let cross_site = reqwest::Client::new()
        .post(stack.url("/console/run"))
        .header("cookie", them_cookie(&mut owner, &stack).await)
        .header("origin", "http://evil.example")
        .form(&run_form(&csrf))
        .send()
        .await
        .unwrap();
    assert_eq!(
        cross_site.status(),
        StatusCode::FORBIDDEN,
        "a cross-site origin"
    );

    // A stale sign-in must confirm the password first.
    let mut db = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .unwrap();
    sqlx::query("UPDATE user_sessions SET authenticated_at = now() - interval '1 hour'")
        .execute(&mut db)
        .await
        .unwrap();
    let form = run_form(&csrf);
    let pairs = refs(&form);
    let stale = owner.post(&stack.url("/console/run"), &pairs).await;
    assert_eq!(stale.status, StatusCode::FORBIDDEN);
    assert!(
        stale.body.contains("Confirm your password"),
        "{}",
        stale.body
    );
    let wrong = owner
        .post(
            &stack.url("/console/confirm"),
            &[
                ("csrf", &csrf),
                ("conversation", &conversation),
                ("password", "wrong"),
            ],
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    let confirmed = owner
        .post(
            &stack.url("/console/confirm"),
            &[
                ("csrf", &csrf),
                ("conversation", &conversation),
                ("password", PASSWORD),
            ],
        )
        .await;
    assert_eq!(
        confirmed.status,
        StatusCode::SEE_OTHER,
        "{}",
        confirmed.body
    );
    let ran = owner.post(&stack.url("/console/run"), &pairs).await;
    assert_eq!(ran.status, StatusCode::OK, "{}", ran.body);
    assert!(ran.body.contains("event: done"), "{}", ran.body);

    // A user without the takeover role reads but cannot run.
    let reader = new_user(&stack, &stack.tenant).await;
    let (mut viewer, viewer_csrf) = signed_in(&stack, &reader).await;
    let read = viewer.get(&stack.url(&page)).await;
    assert_eq!(read.status, StatusCode::OK);
    assert!(read.body.contains("id=\"read-only\"") && !read.body.contains("id=\"run-form\""));
    let form = run_form(&viewer_csrf);
    let pairs = refs(&form);
    let refused = viewer.post(&stack.url("/console/run"), &pairs).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.body);

    // The person's interrupt stops the bot's running cell too, once it has printed; the bot is
    // told who did, and gets what the cell printed until then (so does the transcript).
    let mut slow_bot = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let (_, unused) = tokio::sync::mpsc::unbounded_channel();
    let mut progress = std::mem::replace(&mut slow_bot.progress, unused);
    let slow = {
        let conversation = conversation.clone();
        tokio::spawn(async move {
            slow_bot
                .call(
                    "execute_code",
                    json!({"conversation_id": conversation,
                           "code": "import time\nprint('half way through', flush=True)\ntime.sleep(120)"}),
                )
                .await
                .expect("the interrupted call answers")
        })
    };
    let mut streamed = String::new();
    tokio::time::timeout(Duration::from_secs(90), async {
        while !streamed.contains("half way through") {
            let p = progress
                .recv()
                .await
                .expect("progress notifications until the cell prints");
            streamed.push_str(p.message.as_deref().unwrap_or_default());
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the bot's cell streams its first line: {streamed:?}"));
    let cookie = owner.cookies();
    let http = reqwest::Client::new();
    eventually(
        Duration::from_secs(60),
        "the interrupt to end the bot's cell",
        || async {
            let stopped = http
                .post(stack.url("/console/interrupt"))
                .header("cookie", &cookie)
                .form(&[("csrf", &csrf), ("conversation", &conversation)])
                .send()
                .await
                .expect("the gateway answers");
            assert!(stopped.status().is_success() || stopped.status().is_redirection());
            slow.is_finished().then_some(())
        },
    )
    .await;
    let interrupted = slow.await.unwrap();
    assert!(
        interrupted
            .text
            .contains(&format!("a person ({}) interrupted", stack.email)),
        "the bot's result says a person interrupted it: {}",
        interrupted.text
    );
    assert_eq!(
        interrupted.structured["stdout"], "half way through\n",
        "the bot's result has what the cell printed before the interrupt: {:?}",
        interrupted.structured
    );
    // The transcript is written behind the answer: read the page until it has the entry.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let shown = owner.get(&stack.url(&page)).await;
        if shown.body.contains("half way through") && shown.body.contains("KeyboardInterrupt") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the interrupted cell's output is in the transcript: {}",
            shown.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The bot's variable was touched only by the owner's confirmed run.
    let seen = bot
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "secret"}),
        )
        .await;
    assert_eq!(
        seen.structured["result"]["text/plain"], "0",
        "{:?}",
        seen.structured
    );

    // Revoking the user's sessions signs them out everywhere.
    stack
        .gateway
        .cli(&["admin", "user", "revoke-sessions", "--email", &stack.email])
        .await;
    let out = owner.get(&stack.url(&page)).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER, "signed out");
    support::remove_containers_of(&stack.gateway.instance);
}

/// Every console URL of `conversation` as `browser`'s user: the run (which is also the stream),
/// interrupt, upload, download, password confirmation, fork and resume; each action's name,
/// status and body.
async fn every_action(
    browser: &mut HttpBrowser,
    stack: &Stack,
    csrf: &str,
    conversation: &str,
) -> Vec<(&'static str, StatusCode, String)> {
    let mut answers = Vec::new();
    let run = browser
        .post(
            &stack.url("/console/run"),
            &[
                ("csrf", csrf),
                ("conversation", conversation),
                ("kind", "cell"),
                ("code", "secret = 0"),
            ],
        )
        .await;
    answers.push(("run", run.status, run.body));
    for (action, path) in [
        ("interrupt", "/console/interrupt"),
        ("fork", "/console/fork"),
        ("resume", "/console/resume"),
    ] {
        let page = browser
            .post(
                &stack.url(path),
                &[("csrf", csrf), ("conversation", conversation)],
            )
            .await;
        answers.push((action, page.status, page.body));
    }
    let confirm = browser
        .post(
            &stack.url("/console/confirm"),
            &[
                ("csrf", csrf),
                ("conversation", conversation),
                ("password", PASSWORD),
            ],
        )
        .await;
    answers.push(("confirm", confirm.status, confirm.body));
    let upload = reqwest::Client::new()
        .post(stack.url(&format!(
            "/console/upload?conversation={}&name=x.txt",
            url_encode(conversation)
        )))
        .header("cookie", browser.cookies())
        .header("x-sandgate-csrf", csrf)
        .body("planted")
        .send()
        .await
        .unwrap();
    let status = upload.status();
    answers.push(("upload", status, upload.text().await.unwrap()));
    let download = browser
        .get(&stack.url(&format!(
            "/console/file?conversation={}&path=%2Fhome%2Fuser%2Fsecret.txt",
            url_encode(conversation)
        )))
        .await;
    answers.push(("file", download.status, download.body));
    answers
}

/// The browser's cookies as a `Cookie` header (for requests the helper does not make).
async fn them_cookie(browser: &mut HttpBrowser, _stack: &Stack) -> String {
    browser.cookies()
}

fn refs(form: &[(String, String)]) -> Vec<(&str, &str)> {
    form.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}
