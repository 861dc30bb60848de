//! A host outside the egress policy approved during a conversation (issue 29, its optional
//! part), end to end: off, a refused host is only refused; on, the refusal carries the link to
//! a request on the console's egress page; a person with the approver role approves it in
//! headless Chromium and that sandbox alone reaches the host. The attackers: the bot with its
//! access token, a reader without the role, another tenant's approver, a forged form, a name
//! that resolves to a private address (approved, still refused), an address literal (never a
//! request). Decisions are in `admin audit`; turning approvals off ends the approval.

use std::time::Duration;

use reqwest::StatusCode;

use crate::egress_secrets::{get_cell, https_server, run, sandbox_of};
use crate::mcp_client::{Client, Era};
use crate::support::eventually;
use crate::support::oauth::{Browser as HttpBrowser, PASSWORD, Stack, hidden};
use crate::webdriver::Browser;

async fn user_with_role(stack: &Stack, tenant: &str, role: &str) -> String {
    let email = format!(
        "approver-{}@example.com",
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
    let out = stack
        .gateway
        .cli(&["admin", "user", "role", "--email", &email, "--role", role])
        .await;
    assert!(out.contains(role), "the role is set: {out}");
    email
}

/// Signs `email` in over plain HTTP; the browser and the session's CSRF token.
async fn signed_in(stack: &Stack, email: &str) -> (HttpBrowser, String) {
    let mut browser = HttpBrowser::new(stack);
    let first = browser.get(&stack.url("/console/egress")).await;
    let login = first.location.expect("anonymous users log in first");
    browser.log_in(&login, email, PASSWORD).await;
    let page = browser.get(&stack.url("/console/egress")).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let apps = browser.get(&stack.url("/apps")).await;
    let csrf = hidden(&apps.body, "csrf").expect("a CSRF token");
    (browser, csrf)
}

/// The request id a refusal's link names.
fn request_id(refusal: &str) -> String {
    let at = refusal
        .find("/console/egress?id=")
        .unwrap_or_else(|| panic!("the refusal carries the request's link: {refusal}"));
    refusal[at + "/console/egress?id=".len()..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit() || *c == '-')
        .collect()
}

#[tokio::test]
async fn a_person_approves_a_host_for_one_sandbox_and_the_bot_cannot() {
    let pki = sandgate_node::test_pki::Pki::new("sandgate e2e approval test CA");
    let (port, seen) = https_server(&pki, &["shop.sandgate.test", "extra.sandgate.test"]).await;
    let dir = std::env::temp_dir().join(format!("sandgate-approval-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("test-ca.pem");
    std::fs::write(&ca_file, pki.ca_pem()).unwrap();
    let server = format!("127.0.0.1:{port}");
    let hosts = format!(
        "shop.sandgate.test={server},extra.sandgate.test={server},inner.sandgate.test=10.1.2.3"
    );
    let stack = Stack::start(&[
        ("SANDGATE_EGRESS__TEST_HOSTS", &hosts),
        ("SANDGATE_EGRESS__TEST_CA_FILE", ca_file.to_str().unwrap()),
    ])
    .await;
    let tenant = stack.tenant.clone();
    let rule = format!("shop.sandgate.test:{port}");
    let policy = stack
        .gateway
        .cli(&["admin", "tenant", "egress", &tenant, "--allow", &rule])
        .await;
    assert!(
        policy.contains("approvals: off"),
        "off by default: {policy}"
    );
    // A secret bound to the host that will be approved: an approval never sends it.
    let value = format!("extra_{}", uuid::Uuid::new_v4().simple());
    stack
        .gateway
        .cli_stdin(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &tenant,
                "EXTRA_TOKEN",
                "--host",
                "extra.sandgate.test",
                "--header",
                "authorization",
            ],
            &value,
        )
        .await;
    let token = stack.gateway.token(&tenant).await;
    let bot = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("the bot connects");
    let a = sandbox_of(&bot, "ticket-a").await;
    let b = sandbox_of(&bot, "ticket-b").await;
    let extra = format!("https://extra.sandgate.test:{port}/");
    // A plain tunnel: the TLS is the test server's own, under the test's CA, which the sandbox
    // does not hold.
    let fetch = |url: &str| get_cell(url, "{}", "False");

    // Off: a host outside the policy is only refused.
    let refused = run(&bot, &a, &fetch(&extra)).await;
    assert!(
        refused.contains("403")
            && refused.contains("not in this tenant's egress policy")
            && !refused.contains("/console/egress"),
        "with approvals off, no request: {refused}"
    );

    let policy = stack
        .gateway
        .cli(&["admin", "tenant", "egress", &tenant, "--approvals", "on"])
        .await;
    assert!(policy.contains("approvals: on"), "{policy}");

    // On: the refusal names the request; asking again names the same one.
    let refused = run(&bot, &a, &fetch(&extra)).await;
    assert!(
        refused.contains("403"),
        "still refused until approved: {refused}"
    );
    let id = request_id(&refused);
    let again = run(&bot, &a, &fetch(&extra)).await;
    assert_eq!(request_id(&again), id, "one request per sandbox and host");
    let inner = run(
        &bot,
        &a,
        &fetch(&format!("https://inner.sandgate.test:{port}/")),
    )
    .await;
    let inner_id = request_id(&inner);
    let literal = run(&bot, &a, &fetch(&format!("https://10.1.2.3:{port}/"))).await;
    assert!(
        literal.contains("is an address") && !literal.contains("/console/egress"),
        "an address is never a request: {literal}"
    );
    let other_port = run(&bot, &a, &fetch("https://extra.sandgate.test:8443/")).await;
    assert!(
        other_port.contains("can approve port 443 and the ports of this tenant's rules only")
            && !other_port.contains("/console/egress"),
        "a port no rule names is never a request: {other_port}"
    );
    let link = format!("/console/egress?id={id}");

    // The bot: its access token opens no page and decides nothing.
    let with_token = stack
        .http
        .get(stack.url(&link))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(with_token.status(), StatusCode::SEE_OTHER, "to the login");
    let posted = stack
        .http
        .post(stack.url("/console/egress/decide"))
        .bearer_auth(&token)
        .form(&[("id", id.as_str()), ("decision", "approve")])
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), StatusCode::SEE_OTHER, "to the login");
    assert!(
        posted
            .headers()
            .get("location")
            .and_then(|l| l.to_str().ok())
            .is_some_and(|l| l.starts_with("/login")),
        "{posted:?}"
    );

    // A reader of the tenant sees the request, cannot decide it.
    let (mut reader, reader_csrf) = signed_in(&stack, &stack.email).await;
    let page = reader.get(&stack.url(&link)).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body.contains(&format!("extra.sandgate.test:{port}"))
            && page.body.contains("id=\"read-only\"")
            && !page.body.contains("class=\"primary approve\""),
        "{}",
        page.body
    );
    let form = [
        ("csrf", reader_csrf.as_str()),
        ("id", id.as_str()),
        ("decision", "approve"),
    ];
    let denied = reader
        .post(&stack.url("/console/egress/decide"), &form)
        .await;
    assert_eq!(denied.status, StatusCode::FORBIDDEN, "{}", denied.body);
    assert!(denied.body.contains("Not an approver"), "{}", denied.body);

    // Another tenant's approver: the same page as for no request at all.
    let other_tenant = stack.gateway.create_tenant().await;
    let intruder = user_with_role(&stack, &other_tenant, "approver").await;
    let (mut them, their_csrf) = signed_in(&stack, &intruder).await;
    let theirs = them.get(&stack.url(&link)).await;
    let nowhere = them
        .get(&stack.url(&format!("/console/egress?id={}", uuid::Uuid::new_v4())))
        .await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(
        theirs.body, nowhere.body,
        "foreign and missing look the same"
    );
    let form = [
        ("csrf", their_csrf.as_str()),
        ("id", id.as_str()),
        ("decision", "approve"),
    ];
    let decided = them.post(&stack.url("/console/egress/decide"), &form).await;
    assert_eq!(decided.status, StatusCode::NOT_FOUND, "{}", decided.body);
    let listing = them.get(&stack.url("/console/egress")).await;
    assert!(
        listing.body.contains("id=\"no-requests\"") && !listing.body.contains(&id),
        "another tenant lists none of them: {}",
        listing.body
    );

    // The tenant's approver: a form without the session's token, or from another site, is
    // refused.
    let approver = user_with_role(&stack, &tenant, "approver").await;
    let (mut own, own_csrf) = signed_in(&stack, &approver).await;
    let forged = own
        .post(
            &stack.url("/console/egress/decide"),
            &[("id", id.as_str()), ("decision", "approve")],
        )
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    assert!(forged.body.contains("Form expired"), "{}", forged.body);
    let cross_site = stack
        .http
        .post(stack.url("/console/egress/decide"))
        .header("cookie", own.cookies())
        .header("origin", "https://evil.example.test")
        .form(&[
            ("csrf", own_csrf.as_str()),
            ("id", id.as_str()),
            ("decision", "approve"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(
        cross_site.status(),
        StatusCode::FORBIDDEN,
        "a cross-site form"
    );
    let still = run(&bot, &a, &fetch(&extra)).await;
    assert!(still.contains("403"), "nothing approved it yet: {still}");

    // The approver follows the link in a real browser, signs in and approves.
    let chromium = Browser::start().await;
    chromium.goto(&stack.url(&link)).await;
    chromium.type_into("#email", &approver).await;
    chromium.type_into("#password", PASSWORD).await;
    chromium.click("#sign-in").await;
    let shown = chromium.text("#request").await;
    assert!(
        shown.contains(&format!("extra.sandgate.test:{port}"))
            && shown.contains("ticket-a")
            && shown.contains("pending"),
        "the request is on top: {shown}"
    );
    chromium.click("#request button.approve").await;
    eventually(Duration::from_secs(30), "the approval to show", || async {
        chromium
            .text_now("#request td.state")
            .await
            .filter(|s| s.contains("approved"))
    })
    .await;
    chromium.quit().await;

    // That sandbox reaches the host; the other sandbox of the conversation's tenant does not.
    let through = run(
        &bot,
        &a,
        &get_cell(
            &extra,
            "{'Authorization': 'Bearer ' + os.environ['EXTRA_TOKEN']}",
            "False",
        ),
    )
    .await;
    assert!(through.starts_with("STATUS 200"), "approved: {through}");
    let head = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(
        head.to_lowercase().contains("authorization: bearer sgp_") && !head.contains(&value),
        "a connection an approval admitted carries no secret: {head}"
    );
    let other_sandbox = run(&bot, &b, &fetch(&extra)).await;
    assert!(
        other_sandbox.contains("403") && request_id(&other_sandbox) != id,
        "another sandbox has a request of its own: {other_sandbox}"
    );
    // A decision is made once.
    let twice = own
        .post(
            &stack.url("/console/egress/decide"),
            &[
                ("csrf", own_csrf.as_str()),
                ("id", id.as_str()),
                ("decision", "deny"),
            ],
        )
        .await;
    assert_eq!(twice.status, StatusCode::CONFLICT, "{}", twice.body);

    // A name that resolves to a private address, approved, is still refused.
    let approved_inner = own
        .post(
            &stack.url("/console/egress/decide"),
            &[
                ("csrf", own_csrf.as_str()),
                ("id", inner_id.as_str()),
                ("decision", "approve"),
            ],
        )
        .await;
    assert_eq!(approved_inner.status, StatusCode::SEE_OTHER);
    let inner = run(
        &bot,
        &a,
        &fetch(&format!("https://inner.sandgate.test:{port}/")),
    )
    .await;
    assert!(
        inner.contains("403") && inner.contains("10.1.2.3"),
        "an approved name is still checked: {inner}"
    );

    // The decisions and the connections are in the audit trail.
    eventually(Duration::from_secs(30), "the audit rows", || async {
        let trail = stack
            .gateway
            .cli(&["admin", "audit", "--tenant", &tenant])
            .await;
        (trail.contains("console_egress_approve")
            && trail.contains(&format!("user:{approver}"))
            && trail.contains(&format!(
                "approved extra.sandgate.test:{port} for sandbox {a}"
            ))
            && trail.contains(&format!("extra.sandgate.test:{port} via"))
            && trail.contains(&format!("approved for this sandbox by user:{approver}")))
        .then_some(())
    })
    .await;

    // Off again: the approval ends with it.
    let policy = stack
        .gateway
        .cli(&["admin", "tenant", "egress", &tenant, "--approvals", "off"])
        .await;
    assert!(policy.contains("approvals: off"), "{policy}");
    let after = run(&bot, &a, &fetch(&extra)).await;
    assert!(
        after.contains("403") && !after.contains("/console/egress"),
        "turned off, the approval is gone: {after}"
    );
    crate::support::remove_containers_of(&stack.gateway.instance);
    let _ = std::fs::remove_dir_all(&dir);
}
