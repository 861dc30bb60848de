//! "Connect once" end to end: the OAuth 2.1 authorization server of the real binary, driven the
//! way an MCP client and a person with a browser drive it (discovery, registration, login,
//! consent, PKCE, tokens on /mcp, refresh rotation, disconnect), plus the refusals each step
//! owes an attacker, with the exact errors.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::support::oauth::*;
use crate::support::{self, eventually};

#[tokio::test]
async fn an_mcp_client_connects_once_with_pkce_and_refresh_tokens_rotate() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    // Discovery: 401 → protected-resource metadata → authorization-server metadata.
    let (status, challenge, _) = stack.mcp_status("").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(challenge.contains("resource_metadata="), "{challenge}");
    let prm: Value = stack
        .http
        .get(stack.url("/.well-known/oauth-protected-resource/mcp"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(prm["authorization_servers"][0], stack.gateway.base_url);
    let meta: Value = stack
        .http
        .get(stack.url("/.well-known/oauth-authorization-server"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(meta["issuer"], stack.gateway.base_url);
    assert_eq!(meta["code_challenge_methods_supported"], json!(["S256"]));
    assert_eq!(meta["authorization_response_iss_parameter_supported"], true);
    for endpoint in [
        "authorization_endpoint",
        "token_endpoint",
        "registration_endpoint",
        "revocation_endpoint",
        "jwks_uri",
    ] {
        assert!(
            meta[endpoint]
                .as_str()
                .is_some_and(|u| u.starts_with(&stack.gateway.base_url)),
            "{endpoint} is advertised: {meta}"
        );
    }
    let jwks: Value = stack
        .http
        .get(meta["jwks_uri"].as_str().unwrap())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(jwks["keys"][0]["kty"], "OKP");

    let registered = stack.register("Support Copilot", REDIRECT).await;
    let client_id = registered["client_id"]
        .as_str()
        .expect("a client id")
        .to_owned();
    assert!(
        registered.get("client_secret").is_none(),
        "a public client gets no secret"
    );

    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, consent) =
        connect(&stack, &mut browser, &client_id, &pkce, "sandbox execute").await;
    assert!(
        consent.body.contains("Support Copilot"),
        "the consent page names the client"
    );
    assert!(
        consent
            .body
            .contains("Run Python code and shell commands in them"),
        "scopes in plain words"
    );
    assert!(
        consent.body.contains("127.0.0.1:9"),
        "the redirect host is shown"
    );
    assert_eq!(query["state"], "st-123", "state round-trips");
    assert_eq!(query["iss"], stack.gateway.base_url, "RFC 9207 iss");
    let code = &query["code"];

    let (status, tokens) = stack.exchange(&client_id, code, &pkce.verifier).await;
    assert_eq!(status, StatusCode::OK, "{tokens}");
    assert_eq!(tokens["token_type"], "Bearer");
    assert_eq!(tokens["scope"], "sandbox execute");
    let access = tokens["access_token"].as_str().unwrap().to_owned();
    let claims: Value = serde_json::from_slice(
        &URL_SAFE_NO_PAD
            .decode(access.split('.').nth(1).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        claims["aud"],
        stack.gateway.mcp_url(),
        "resource is bound into aud"
    );
    assert_eq!(claims["client_id"], client_id.as_str());
    assert!(claims["grant"].is_string(), "the token names its grant");

    // The token works on /mcp and shows exactly the granted tools.
    let client = Client::connect(&stack.gateway.mcp_url(), &access, Era::Stateless)
        .await
        .expect("the OAuth token opens /mcp");
    let mut tools: Vec<String> = client
        .service
        .list_all_tools()
        .await
        .expect("tools/list")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    tools.sort();
    assert_eq!(
        tools,
        [
            "close_sandbox",
            "create_sandbox",
            "execute_code",
            "fork_sandbox",
            "install_packages",
            "kill_job",
            "list_jobs",
            "list_sandboxes",
            "pause_sandbox",
            "run_terminal_command"
        ],
        "the token's scopes decide the tools"
    );

    // Connect once: the same client asking for the same scopes skips the consent screen.
    let again = Pkce::new();
    let skipped = browser
        .get(&authorize_url(
            &stack,
            &client_id,
            REDIRECT,
            &again,
            "st-2",
            "sandbox execute",
        ))
        .await;
    assert_eq!(
        skipped.status,
        StatusCode::SEE_OTHER,
        "no consent page the second time"
    );
    let second = query_of(skipped.location.as_deref().unwrap());
    assert!(
        second.contains_key("code"),
        "straight back with a code: {second:?}"
    );
    let (status, _) = stack
        .exchange(&client_id, &second["code"], &again.verifier)
        .await;
    assert_eq!(status, StatusCode::OK);

    // Refresh rotation: each refresh token works once; reusing one revokes the family.
    let first_refresh = tokens["refresh_token"]
        .as_str()
        .expect("a refresh token")
        .to_owned();
    let refresh = |token: String| {
        let stack = &stack;
        let client_id = client_id.clone();
        async move {
            stack
                .token_request(&[
                    ("grant_type", "refresh_token"),
                    ("refresh_token", &token),
                    ("client_id", &client_id),
                ])
                .await
        }
    };
    let (status, rotated) = refresh(first_refresh.clone()).await;
    assert_eq!(status, StatusCode::OK, "{rotated}");
    let second_refresh = rotated["refresh_token"].as_str().unwrap().to_owned();
    assert_ne!(second_refresh, first_refresh, "refresh tokens rotate");
    let (status, reused) = refresh(first_refresh).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reused,
        json!({"error": "invalid_grant", "error_description": "the refresh token was already used; every refresh token of this sign-in is revoked"})
    );
    let (status, family) = refresh(second_refresh).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        family,
        json!({"error": "invalid_grant", "error_description": "the refresh token was revoked"}),
        "the newest token of the family is dead too"
    );
}

#[tokio::test]
async fn the_authorization_code_flow_refuses_what_an_attacker_tries() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let client_id = stack.register("Ticket Bot", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut browser = Browser::new(&stack);

    // Redirect URI variants never get a redirect: a page says no, and no Location leaks the code.
    for variant in [
        "http://127.0.0.1:9/callback/",
        "http://127.0.0.1:9/CALLBACK",
        "http://127.0.0.1:9/callback?extra=1",
        "http://user@127.0.0.1:9/callback",
        "http://127.0.0.2:9/callback",
        "https://evil.example/callback",
    ] {
        let page = browser
            .get(&authorize_url(
                &stack,
                &client_id,
                variant,
                &Pkce::new(),
                "s",
                "sandbox",
            ))
            .await;
        assert_eq!(page.status, StatusCode::BAD_REQUEST, "{variant}");
        assert!(page.location.is_none(), "{variant} is not redirected to");
        assert!(
            page.body
                .contains("The redirect URI does not exactly match one registered for this app"),
            "{variant}: {}",
            page.body
        );
    }

    // `plain` and a missing challenge go back to the (genuine) client as errors.
    let pkce = Pkce::new();
    let mut plain = authorize_url(&stack, &client_id, REDIRECT, &pkce, "s-plain", "sandbox");
    plain = plain.replace("code_challenge_method=S256", "code_challenge_method=plain");
    let refused = browser.get(&plain).await;
    assert_eq!(refused.status, StatusCode::SEE_OTHER);
    let q = query_of(refused.location.as_deref().unwrap());
    assert_eq!(q["error"], "invalid_request");
    assert_eq!(q["error_description"], "code_challenge_method must be S256");
    assert_eq!(q["state"], "s-plain");
    assert_eq!(q["iss"], stack.gateway.base_url);
    let no_challenge = authorize_url(&stack, &client_id, REDIRECT, &pkce, "s", "sandbox")
        .replace(&format!("code_challenge={}", pkce.challenge), "");
    let refused = browser.get(&no_challenge).await;
    let q = query_of(refused.location.as_deref().unwrap());
    assert_eq!(
        q["error_description"],
        "code_challenge is required (PKCE with S256)"
    );

    // A foreign resource is refused (RFC 8707).
    let foreign = authorize_url(&stack, &client_id, REDIRECT, &pkce, "s", "sandbox").replace(
        &url_encode(&stack.gateway.mcp_url()),
        &url_encode("https://other.example/mcp"),
    );
    let refused = browser.get(&foreign).await;
    let q = query_of(refused.location.as_deref().expect("an error redirect"));
    assert_eq!(q["error"], "invalid_target");

    // Wrong verifier: refused, and the code is burnt.
    let (query, _) = connect(&stack, &mut browser, &client_id, &pkce, "sandbox").await;
    let (status, body) = stack
        .exchange(&client_id, &query["code"], &Pkce::new().verifier)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body,
        json!({"error": "invalid_grant", "error_description": "code_verifier does not match the code_challenge"})
    );
    let (_, body) = stack
        .exchange(&client_id, &query["code"], &pkce.verifier)
        .await;
    assert_eq!(
        body,
        json!({"error": "invalid_grant", "error_description": "the authorization code is invalid"}),
        "a code that failed once cannot be retried"
    );

    // Replay: the second redemption is refused and the first one's tokens stop working.
    let pkce = Pkce::new();
    let skipped = browser
        .get(&authorize_url(
            &stack, &client_id, REDIRECT, &pkce, "s", "sandbox",
        ))
        .await;
    let code = query_of(skipped.location.as_deref().unwrap())["code"].clone();
    let (status, tokens) = stack.exchange(&client_id, &code, &pkce.verifier).await;
    assert_eq!(status, StatusCode::OK);
    let access = tokens["access_token"].as_str().unwrap();
    let client = Client::connect(&stack.gateway.mcp_url(), access, Era::Stateless)
        .await
        .expect("the token works before the replay");
    client
        .service
        .list_all_tools()
        .await
        .expect("tools/list works before the replay");
    let (status, body) = stack.exchange(&client_id, &code, &pkce.verifier).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body,
        json!({"error": "invalid_grant", "error_description": "the authorization code was already used; the tokens issued with it are revoked"})
    );
    let (status, challenge, body) = stack.mcp_status(access).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the replayed code's token is revoked"
    );
    assert!(
        challenge.contains(r#"error="invalid_token""#),
        "{challenge}"
    );
    assert_eq!(
        body["error_description"],
        "the access token was revoked or its app was disconnected"
    );
    let (status, body) = stack
        .token_request(&[
            ("grant_type", "refresh_token"),
            ("refresh_token", tokens["refresh_token"].as_str().unwrap()),
            ("client_id", &client_id),
        ])
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error_description"], "the refresh token was revoked");
}

#[tokio::test]
async fn the_consent_page_cannot_be_framed_or_forged() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let client_id = stack.register("Frame Test", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let start = browser
        .get(&authorize_url(
            &stack,
            &client_id,
            REDIRECT,
            &pkce,
            "st",
            "files:read",
        ))
        .await;
    let login = start.location.clone().expect("sent to log in first");
    assert!(login.contains("/login?next="), "{login}");
    let cookie_page = browser.get(&login).await;
    let set_cookie = header(&cookie_page.headers, "set-cookie");
    assert!(
        set_cookie.starts_with("__Host-"),
        "loopback gets __Host- cookies: {set_cookie}"
    );
    assert!(
        set_cookie.contains("Secure")
            && set_cookie.contains("HttpOnly")
            && set_cookie.contains("SameSite=Lax"),
        "{set_cookie}"
    );

    // Wrong password: refused without saying which part was wrong.
    let csrf = hidden(&cookie_page.body, "csrf").unwrap();
    let wrong = browser
        .post(
            &stack.url("/login"),
            &[
                ("email", &stack.email),
                ("password", "not the password"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.body.contains("Wrong email or password."));

    let after = browser.log_in(&login, &stack.email, PASSWORD).await;
    let consent = browser.get(after.location.as_deref().unwrap()).await;
    assert_eq!(consent.status, StatusCode::OK);
    assert_eq!(header(&consent.headers, "x-frame-options"), "DENY");
    assert!(
        header(&consent.headers, "content-security-policy").contains("frame-ancestors 'none'"),
        "CSP forbids framing"
    );
    assert_eq!(header(&consent.headers, "cache-control"), "no-store");
    assert!(
        consent.body.contains("Read and list files in them"),
        "{}",
        consent.body
    );
    assert!(
        consent.body.contains("name=\"viewport\""),
        "readable on a phone"
    );

    let field = |k: &str| hidden(&consent.body, k).unwrap_or_default();
    let base: Vec<(String, String)> = [
        "response_type",
        "client_id",
        "redirect_uri",
        "code_challenge",
        "code_challenge_method",
        "scope",
        "resource",
        "state",
    ]
    .iter()
    .map(|k| (k.to_string(), field(k)))
    .collect();
    let post = |extra: Vec<(&'static str, String)>| {
        let mut form = base.clone();
        form.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
        form
    };
    // No CSRF token, and a wrong one: 403, no code.
    for form in [
        post(vec![("decision", "approve".into())]),
        post(vec![
            ("decision", "approve".into()),
            ("csrf", "sgx_forged".into()),
        ]),
    ] {
        let refs: Vec<(&str, &str)> = form.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let forged = browser.post(&stack.url("/oauth/authorize"), &refs).await;
        assert_eq!(forged.status, StatusCode::FORBIDDEN);
        assert!(forged.location.is_none());
        assert!(
            forged
                .body
                .contains("This form expired or did not come from sandgate"),
            "{}",
            forged.body
        );
    }
    // Deny: 303 back to the client with access_denied, state and iss.
    let form = post(vec![("decision", "deny".into()), ("csrf", field("csrf"))]);
    let refs: Vec<(&str, &str)> = form.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let denied = browser.post(&stack.url("/oauth/authorize"), &refs).await;
    assert_eq!(denied.status, StatusCode::SEE_OTHER);
    let q = query_of(denied.location.as_deref().unwrap());
    assert_eq!(q["error"], "access_denied");
    assert_eq!(q["state"], "st");
    assert_eq!(q["iss"], stack.gateway.base_url);
}

#[tokio::test]
async fn tokens_for_other_resources_expired_or_short_of_scope_are_refused() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let foreign = forge(
        &stack,
        "https://other.example/mcp",
        Duration::from_secs(600),
    )
    .await;
    let (status, challenge, body) = stack.mcp_status(&foreign).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(challenge.contains(r#"error="invalid_token""#));
    assert_eq!(
        body["error_description"],
        "the access token was issued for another resource"
    );

    let short = forge(&stack, &stack.gateway.mcp_url(), Duration::from_secs(1)).await;
    let body = eventually(
        Duration::from_secs(5),
        "the 1 s token to expire",
        || async {
            let (status, _, body) = stack.mcp_status(&short).await;
            (status == StatusCode::UNAUTHORIZED).then_some(body)
        },
    )
    .await;
    assert_eq!(body["error_description"], "the access token has expired");

    // A token with only `sandbox`: tools/list hides the rest, and calling one is 403.
    let token = stack
        .gateway
        .cli(&[
            "admin",
            "token",
            "issue",
            "--tenant",
            &stack.tenant,
            "--scopes",
            "sandbox",
        ])
        .await;
    let client = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let tools = client.service.list_all_tools().await.expect("tools/list");
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "close_sandbox",
            "create_sandbox",
            "fork_sandbox",
            "list_sandboxes",
            "pause_sandbox"
        ],
        "only the sandbox tools are listed"
    );
    for (era, headers) in [
        ("2025-11-25", vec![]),
        (
            "2026-07-28",
            vec![("mcp-method", "tools/call"), ("mcp-name", "execute_code")],
        ),
    ] {
        let mut request = stack
            .http
            .post(stack.gateway.mcp_url())
            .bearer_auth(&token)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", era)
            .json(&json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                          "params": {"name": "execute_code", "arguments": {"code": "1+1"}}}));
        for (k, v) in headers {
            request = request.header(k, v);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{era}");
        let challenge = header(response.headers(), "www-authenticate");
        assert!(
            challenge.starts_with(r#"Bearer error="insufficient_scope", scope="sandbox execute""#)
                && challenge.contains("resource_metadata="),
            "{era}: {challenge}"
        );
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"], "insufficient_scope");
        assert_eq!(
            body["error_description"],
            "calling execute_code needs the execute scope, which this token does not hold"
        );
    }
}

#[tokio::test]
async fn disconnecting_an_app_stops_its_tokens_and_closes_its_sandboxes() {
    let stack = Stack::start(&[]).await;
    let client_id = stack.register("Disconnect Me", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, _) = connect(&stack, &mut browser, &client_id, &pkce, "sandbox execute").await;
    let (_, tokens) = stack
        .exchange(&client_id, &query["code"], &pkce.verifier)
        .await;
    let access = tokens["access_token"].as_str().unwrap().to_owned();
    let client = Client::connect(&stack.gateway.mcp_url(), &access, Era::Stateless)
        .await
        .expect("connects");
    let created = client
        .ok("create_sandbox", json!({"conversation_id": "c-1"}))
        .await;
    let sandbox_id = created.structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    client
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox_id, "code": "x = 1"}),
        )
        .await;

    let apps = browser.get(&stack.url("/apps")).await;
    assert_eq!(apps.status, StatusCode::OK);
    assert!(apps.body.contains("Disconnect Me"), "{}", apps.body);
    assert!(
        apps.body
            .contains("run Python code and shell commands in them")
    );
    assert!(
        !apps.body.contains("last used never"),
        "the app's use is shown"
    );
    assert_eq!(header(&apps.headers, "x-frame-options"), "DENY");
    let grant = hidden(&apps.body, "grant_id").unwrap();
    let csrf = hidden(&apps.body, "csrf").unwrap();
    let done = browser
        .post(
            &stack.url("/apps/disconnect"),
            &[("csrf", &csrf), ("grant_id", &grant)],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    let apps = browser.get(&stack.url("/apps")).await;
    assert!(
        !apps.body.contains("Disconnect Me"),
        "the app is gone from the list"
    );

    let (status, _, body) = stack.mcp_status(&access).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the next MCP call is refused"
    );
    assert_eq!(
        body["error_description"],
        "the access token was revoked or its app was disconnected"
    );

    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .unwrap();
    let (state, reason, container): (String, Option<String>, String) =
        sqlx::query_as("SELECT state, close_reason, container_id FROM sandboxes WHERE id = $1")
            .bind(&sandbox_id)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), reason.as_deref()),
        ("closed", Some("disconnected"))
    );
    eventually(
        Duration::from_secs(20),
        "the sandbox's container to be removed",
        || async {
            (!support::containers_of(&stack.gateway.instance).contains(&container)).then_some(())
        },
    )
    .await;
    let (status, body) = stack
        .token_request(&[
            ("grant_type", "refresh_token"),
            ("refresh_token", tokens["refresh_token"].as_str().unwrap()),
            ("client_id", &client_id),
        ])
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error_description"], "the refresh token was revoked");
}

#[tokio::test]
async fn a_person_connects_an_app_in_a_real_browser() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let (redirect, mut hits) = callback_server().await;
    let client_id = stack.register("Acme Support Copilot", &redirect).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pkce = Pkce::new();
    let browser = crate::webdriver::Browser::start().await;
    browser
        .goto(&authorize_url(
            &stack,
            &client_id,
            &redirect,
            &pkce,
            "browser-state",
            "sandbox execute files:read",
        ))
        .await;
    // Sent to the login page first.
    browser.type_into("#email", &stack.email).await;
    browser.type_into("#password", PASSWORD).await;
    browser.click("#sign-in").await;
    // The consent page, with who asks and for what.
    let title = browser.text("#title").await;
    assert_eq!(
        title,
        "Acme Support Copilot wants to use your sandgate account"
    );
    let scopes = browser.text("#scopes").await;
    for words in [
        "Create and close sandboxes",
        "Run Python code and shell commands in them",
        "Read and list files in them",
    ] {
        assert!(
            scopes.contains(words),
            "the consent page lists {words:?}: {scopes}"
        );
    }
    assert!(
        browser
            .text("#redirect-host")
            .await
            .starts_with("127.0.0.1:")
    );
    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    let path = crate::webdriver::artifacts_dir().join("oauth-consent.png");
    std::fs::write(&path, &png).expect("the screenshot is saved");
    println!("consent page screenshot: {}", path.display());

    browser.click("#approve").await;
    let target = tokio::time::timeout(Duration::from_secs(20), hits.recv())
        .await
        .expect("the browser arrives at the client's redirect URI")
        .expect("a request");
    let landed = browser.url().await;
    assert!(
        landed.starts_with(&redirect),
        "the browser ends at the client: {landed}"
    );
    let query = query_of(&format!("http://x{target}"));
    assert_eq!(query["state"], "browser-state");
    assert_eq!(query["iss"], stack.gateway.base_url);
    browser.quit().await;

    let (status, tokens) = stack
        .token_request(&[
            ("grant_type", "authorization_code"),
            ("code", &query["code"]),
            ("redirect_uri", &redirect),
            ("code_verifier", &pkce.verifier),
            ("client_id", &client_id),
        ])
        .await;
    assert_eq!(status, StatusCode::OK, "{tokens}");
    let client = Client::connect(
        &stack.gateway.mcp_url(),
        tokens["access_token"].as_str().unwrap(),
        Era::Sessions,
    )
    .await
    .expect("the browser-approved token opens /mcp");
    let tools = client.service.list_all_tools().await.expect("tools/list");
    assert_eq!(
        tools.len(),
        13,
        "sandbox, execute and files:read open thirteen tools: {tools:?}"
    );
}

#[tokio::test]
async fn the_python_sdk_oauth_provider_connects_and_calls_a_tool() {
    let stack = Stack::start(&[]).await;
    let python = std::env::var("SANDGATE_TEST_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/python/oauth_connect.py"
    );
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&python)
            .arg(script)
            .arg(stack.gateway.mcp_url())
            .env("SANDGATE_TEST_EMAIL", &stack.email)
            .env("SANDGATE_TEST_PASSWORD", PASSWORD)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the Python client finishes within 120 s")
    .unwrap_or_else(|e| {
        panic!("{python} runs (set SANDGATE_TEST_PYTHON to a Python with the `mcp` package): {e}")
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the Python SDK flow succeeds:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("a JSON report ({e}): {stdout}"));
    // The SDK asks for the scopes the 401 challenge names (MCP spec scope selection), i.e. all.
    assert_eq!(
        report["tools"],
        json!([
            "close_sandbox",
            "create_sandbox",
            "execute_code",
            "export_transcript",
            "fork_sandbox",
            "get_file",
            "install_packages",
            "kill_job",
            "list_files",
            "list_jobs",
            "list_sandboxes",
            "pause_sandbox",
            "run_terminal_command",
            "upload_file"
        ])
    );
    assert_eq!(
        report["consent_mentions_client"], true,
        "the SDK's person saw the consent page"
    );
    assert_eq!(report["has_refresh_token"], true);
    assert_eq!(report["create_error"], false);
    assert_eq!(report["result"], "45", "the tool ran in the sandbox");

    // The sandbox records the grant the SDK's token came from.
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .unwrap();
    let (client_id,): (String,) = sqlx::query_as(
        "SELECT g.client_id FROM sandboxes s JOIN grants g ON g.id = s.grant_id WHERE s.id = $1",
    )
    .bind(report["sandbox_id"].as_str().expect("a sandbox id"))
    .fetch_one(&mut conn)
    .await
    .expect("the sandbox names its grant");
    assert_eq!(report["client_id"], client_id.as_str());
}

#[tokio::test]
async fn client_id_metadata_documents_are_fetched_cached_and_guarded() {
    // A gateway allowed to fetch from loopback (tests only) uses the document.
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        (
            "SANDGATE_OAUTH__CLIENT_METADATA__ALLOW_PRIVATE_ADDRESSES",
            "true",
        ),
    ])
    .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let client_id = format!("http://127.0.0.1:{port}/oauth/client.json");
    let document = json!({
        "client_id": client_id,
        "client_name": "Metadata Agent",
        "redirect_uris": [REDIRECT],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
    })
    .to_string();
    let (base, mut fetches) = {
        // Bind the document server on the port the client id names.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let body = document.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buf = vec![0u8; 8192];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(
                    String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                );
                let _ = socket
                    .write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len()).as_bytes())
                    .await;
            }
        });
        (format!("http://127.0.0.1:{port}"), rx)
    };
    assert!(client_id.starts_with(&base));
    let meta: Value = stack
        .http
        .get(stack.url("/.well-known/oauth-authorization-server"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(meta["client_id_metadata_document_supported"], true);

    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, consent) = connect(&stack, &mut browser, &client_id, &pkce, "sandbox").await;
    assert!(
        consent.body.contains("Metadata Agent"),
        "the document's name is shown"
    );
    assert!(
        consent
            .body
            .contains("App identity verified by its web address"),
        "{}",
        consent.body
    );
    let (status, tokens) = stack
        .exchange(&client_id, &query["code"], &pkce.verifier)
        .await;
    assert_eq!(status, StatusCode::OK, "{tokens}");
    assert_eq!(
        fetches.recv().await.unwrap(),
        "GET /oauth/client.json HTTP/1.1"
    );
    assert!(
        fetches.try_recv().is_err(),
        "the document was fetched once and then cached"
    );

    // A document whose client_id is not its own URL is refused.
    let (liar, _) = document_server(document.clone()).await;
    let page = browser
        .get(&authorize_url(
            &stack,
            &format!("{liar}/other.json"),
            REDIRECT,
            &Pkce::new(),
            "s",
            "sandbox",
        ))
        .await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST);
    assert!(
        page.body.contains("client_id must be its own URL"),
        "{}",
        page.body
    );
    // An oversized document is refused.
    let huge = json!({"client_id": "x", "padding": "a".repeat(20_000)}).to_string();
    let (big, _) = document_server(huge).await;
    let page = browser
        .get(&authorize_url(
            &stack,
            &format!("{big}/c.json"),
            REDIRECT,
            &Pkce::new(),
            "s",
            "sandbox",
        ))
        .await;
    assert!(
        page.body.contains("it is larger than 16384 bytes"),
        "{}",
        page.body
    );

    // With the default configuration, loopback and private targets are never fetched.
    let guarded = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let (_, mut untouched) = document_server(document).await;
    let mut browser = Browser::new(&guarded);
    for (id, why) in [
        (
            format!("https://127.0.0.1:{port}/oauth/client.json"),
            "its address is not a public one",
        ),
        (
            format!("https://localhost:{port}/oauth/client.json"),
            "resolves to no public address",
        ),
        (
            "https://169.254.169.254/latest/meta-data.json".to_owned(),
            "its address is not a public one",
        ),
    ] {
        let page = browser
            .get(&authorize_url(
                &guarded,
                &id,
                REDIRECT,
                &Pkce::new(),
                "s",
                "sandbox",
            ))
            .await;
        assert_eq!(page.status, StatusCode::BAD_REQUEST, "{id}");
        assert!(page.body.contains(why), "{id}: {}", page.body);
    }
    assert!(
        untouched.try_recv().is_err(),
        "nothing reached a loopback server"
    );
    assert!(
        fetches.try_recv().is_err(),
        "nothing reached the loopback document server"
    );
}

#[tokio::test]
async fn confidential_clients_use_client_credentials_and_tokens_can_be_revoked() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let created = stack
        .gateway
        .cli(&[
            "admin",
            "client",
            "create",
            "--tenant",
            &stack.tenant,
            "--name",
            "Nightly Reports",
            "--scopes",
            "sandbox files:read",
        ])
        .await;
    let field = |k: &str| {
        created
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} printed: {created}"))
            .to_owned()
    };
    let (id, secret) = (field("client_id"), field("client_secret"));
    let credentials = |id: &str, secret: &str| {
        stack
            .http
            .post(stack.url("/oauth/token"))
            .basic_auth(id.to_owned(), Some(secret.to_owned()))
            .form(&[("grant_type", "client_credentials")])
            .send()
    };
    let response = credentials(&id, &secret).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let tokens: Value = response.json().await.unwrap();
    assert_eq!(tokens["scope"], "sandbox files:read");
    assert!(
        tokens.get("refresh_token").is_none(),
        "no refresh token for client credentials"
    );
    let access = tokens["access_token"].as_str().unwrap().to_owned();
    let client = Client::connect(&stack.gateway.mcp_url(), &access, Era::Stateless)
        .await
        .expect("connects");
    assert_eq!(
        client.service.list_all_tools().await.unwrap().len(),
        8,
        "sandbox + files:read tools"
    );

    let wrong = credentials(&id, "sgk_wrongwrongwrongwrongwrongwrongwrongwrongwro")
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        wrong.json::<Value>().await.unwrap(),
        json!({"error": "invalid_client", "error_description": "client authentication failed"})
    );
    let public = stack.register("Public", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, body) = stack
        .token_request(&[("grant_type", "client_credentials"), ("client_id", &public)])
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"], "unauthorized_client");

    // RFC 7009: revoking the access token stops it at once.
    let revoked = stack
        .http
        .post(stack.url("/oauth/revoke"))
        .basic_auth(id.clone(), Some(secret.clone()))
        .form(&[
            ("token", access.as_str()),
            ("token_type_hint", "access_token"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), StatusCode::OK);
    let (status, _, body) = stack.mcp_status(&access).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        body["error_description"],
        "the access token was revoked or its app was disconnected"
    );

    // Revoking a refresh token ends its family.
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, _) = connect(&stack, &mut browser, &public, &pkce, "sandbox").await;
    let (_, tokens) = stack
        .exchange(&public, &query["code"], &pkce.verifier)
        .await;
    let refresh = tokens["refresh_token"].as_str().unwrap();
    let (status, _) = {
        let r = stack
            .http
            .post(stack.url("/oauth/revoke"))
            .form(&[("token", refresh), ("client_id", &public)])
            .send()
            .await
            .unwrap();
        (r.status(), ())
    };
    assert_eq!(status, StatusCode::OK);
    let (status, body) = stack
        .token_request(&[
            ("grant_type", "refresh_token"),
            ("refresh_token", refresh),
            ("client_id", &public),
        ])
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error_description"], "the refresh token was revoked");
}

#[tokio::test]
async fn tokens_signed_before_a_key_rotation_keep_working() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let public = stack.register("Rotation", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, _) = connect(&stack, &mut browser, &public, &pkce, "sandbox").await;
    let (_, tokens) = stack
        .exchange(&public, &query["code"], &pkce.verifier)
        .await;
    let old = tokens["access_token"].as_str().unwrap().to_owned();
    let kid = |token: &str| -> String {
        let header: Value = serde_json::from_slice(
            &URL_SAFE_NO_PAD
                .decode(token.split('.').next().unwrap())
                .unwrap(),
        )
        .unwrap();
        header["kid"].as_str().unwrap().to_owned()
    };
    let new_kid = stack.gateway.cli(&["admin", "keys", "rotate"]).await;
    assert_ne!(new_kid, kid(&old));
    // A token signed with the new key (by another process) is accepted: the ring reloads.
    let fresh = stack.gateway.token(&stack.tenant).await;
    assert_eq!(kid(&fresh), new_kid);
    Client::connect(&stack.gateway.mcp_url(), &fresh, Era::Stateless)
        .await
        .expect("the new key verifies");
    // The old key still verifies the tokens it signed.
    let client = Client::connect(&stack.gateway.mcp_url(), &old, Era::Stateless)
        .await
        .expect("the old key still verifies");
    client
        .service
        .list_all_tools()
        .await
        .expect("tools/list with the old token");
    let jwks: Value = stack
        .http
        .get(stack.url("/oauth/jwks"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let kids: Vec<&str> = jwks["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kid"].as_str().unwrap())
        .collect();
    assert!(
        kids.contains(&new_kid.as_str()) && kids.contains(&kid(&old).as_str()),
        "JWKS publishes both: {kids:?}"
    );
}

#[tokio::test]
async fn a_confidential_client_of_another_tenant_cannot_be_connected() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let other_tenant = stack.gateway.create_tenant().await;
    let created = stack
        .gateway
        .cli(&[
            "admin",
            "client",
            "create",
            "--tenant",
            &other_tenant,
            "--name",
            "Other Account's Bot",
            "--redirect-uri",
            REDIRECT,
        ])
        .await;
    let client_id = created
        .lines()
        .find_map(|l| l.strip_prefix("client_id="))
        .unwrap_or_else(|| panic!("client_id printed: {created}"))
        .to_owned();
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let start = browser
        .get(&authorize_url(
            &stack, &client_id, REDIRECT, &pkce, "st-9", "sandbox",
        ))
        .await;
    let login = start.location.as_deref().expect("to the login page");
    let after = browser.log_in(login, &stack.email, PASSWORD).await;
    let refused = browser
        .get(after.location.as_deref().expect("login redirects back"))
        .await;
    assert_eq!(refused.status, StatusCode::SEE_OTHER, "{}", refused.body);
    let location = refused.location.expect("redirected to the client");
    assert!(
        location.starts_with(REDIRECT) && location.contains("error=access_denied"),
        "a user of another tenant is refused, not shown a consent page: {location}"
    );
    assert!(
        location.contains("state=st-9"),
        "state round-trips: {location}"
    );
}
