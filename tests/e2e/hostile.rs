//! The anonymous internet against the real binary (issue 11): login floods from one and from
//! many addresses, account lockout, the bounded password-hashing queue, registration floods and
//! the cap on unused clients, metadata-document fetch limits, hostile `next=` values, slow
//! clients, the scheduled purge, oversized ids in tool arguments, and refusals counted in
//! `/metrics` and audited. Each test plays the attacker *and* shows the legitimate path still
//! working.
//!
//! Different client addresses are real: the test's sockets bind loopback addresses 127.0.0.x
//! (all of 127/8 is loopback on Linux), so the gateway sees different peers.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::Connection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::login_form::LoginForm;
use crate::mcp_client::{Client, Era};
use crate::support::eventually;
use crate::support::oauth::{
    Browser, PASSWORD, Pkce, REDIRECT, Stack, authorize_url, connect, document_server_answering,
    header, hidden,
};

/// A loopback address other than 127.0.0.1: `127.0.<hi>.<lo>`.
fn loopback(hi: u8, lo: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, hi, lo))
}

/// A non-redirecting HTTP client whose connections come from `from`.
fn client_from(from: IpAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .local_address(from)
        .build()
        .expect("an HTTP client")
}

/// What a sign-in attempt got back.
#[derive(Debug)]
struct Attempt {
    status: StatusCode,
    retry_after: Option<u64>,
    location: String,
    body: String,
}

/// Loads the login form (for its CSRF cookie and token) and posts `email`/`password` from
/// `from`, with `next`.
async fn sign_in(stack: &Stack, from: IpAddr, email: &str, password: &str, next: &str) -> Attempt {
    let http = client_from(from);
    let base = &stack.gateway.base_url;
    let form = LoginForm::load(&http, base)
        .await
        .expect("the login page loads");
    let response = form
        .submit(&http, base, email, password, next)
        .await
        .expect("the login endpoint answers");
    Attempt::read(response).await
}

impl Attempt {
    async fn read(response: reqwest::Response) -> Attempt {
        Attempt {
            status: response.status(),
            retry_after: response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok()),
            location: header(response.headers(), "location"),
            body: response.text().await.unwrap_or_default(),
        }
    }
}

/// Wrong-password sign-ins for `email`, one from each of `from`, all posted at once (each
/// after its form is loaded).
async fn attempts(stack: &Stack, from: Vec<IpAddr>, email: &str) -> Vec<Attempt> {
    let base = stack.gateway.base_url.clone();
    let mut forms = Vec::new();
    for ip in from {
        let http = client_from(ip);
        let form = LoginForm::load(&http, &base)
            .await
            .expect("the login page loads");
        forms.push((http, form));
    }
    let posts = forms.iter().map(|(http, form)| async {
        let response = form
            .submit(http, &base, email, "wrong", "/apps")
            .await
            .expect("the login endpoint answers");
        Attempt::read(response).await
    });
    futures::future::join_all(posts).await
}

fn statuses(attempts: &[Attempt]) -> Vec<u16> {
    attempts.iter().map(|a| a.status.as_u16()).collect()
}

fn nobody() -> String {
    format!("nobody-{}@example.com", uuid::Uuid::new_v4().simple())
}

/// The value of `sandgate_http_refusals_total{reason="<reason>"}`, 0 when absent.
async fn refusals(stack: &Stack, reason: &str) -> u64 {
    stack
        .metric(&format!(
            "sandgate_http_refusals_total{{reason=\"{reason}\"}}"
        ))
        .await
}

#[tokio::test]
async fn login_floods_are_limited_per_address_per_account_and_by_the_hashing_queue() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_OAUTH__LIMITS__LOGIN_PER_ADDRESS_PER_MINUTE", "3"),
        ("SANDGATE_OAUTH__LIMITS__LOGIN_PER_ACCOUNT_PER_MINUTE", "5"),
        ("SANDGATE_OAUTH__LIMITS__PASSWORD_HASH_CONCURRENCY", "1"),
        ("SANDGATE_OAUTH__LIMITS__PASSWORD_HASH_QUEUE", "0"),
        ("SANDGATE_OAUTH__LIMITS__PASSWORD_HASH_WAIT_MS", "1"),
    ])
    .await;

    // One address, six tries at once: beyond three, 429 with Retry-After and a page that says
    // why (at once, so no token refills meanwhile however slow the machine).
    let attacker = loopback(1, 10);
    let tries = attempts(&stack, vec![attacker; 6], &nobody()).await;
    let limited: Vec<&Attempt> = tries
        .iter()
        .filter(|a| a.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert!(limited.len() >= 2, "{:?}", statuses(&tries));
    assert!(
        limited
            .iter()
            .all(|a| a.retry_after.is_some_and(|s| s >= 1))
    );
    assert!(
        limited[0]
            .body
            .contains("Too many sign-in attempts from your network"),
        "{}",
        limited[0].body
    );
    // The user, from their own address, gets in.
    let a = sign_in(&stack, loopback(1, 11), &stack.email, PASSWORD, "/apps").await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);

    // One account from ten addresses at once: beyond five, 429 for that account.
    let target = nobody();
    let tries = attempts(&stack, (0..10).map(|i| loopback(2, i)).collect(), &target).await;
    let limited: Vec<&Attempt> = tries
        .iter()
        .filter(|a| a.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert!(limited.len() >= 4, "{:?}", statuses(&tries));
    assert!(
        limited[0].body.contains("for this account"),
        "{}",
        limited[0].body
    );
    assert!(limited.iter().all(|a| a.retry_after.is_some()));
    let a = sign_in(
        &stack,
        loopback(2, 20),
        &target.to_uppercase(),
        "wrong",
        "/apps",
    )
    .await;
    assert_eq!(
        a.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the account limit ignores case"
    );

    // Many addresses at once: one hash at a time and no queue, so concurrent attempts beyond
    // the slot get 503 + Retry-After instead of piling up argon2 memory.
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..24u8 {
        let http = client_from(loopback(3, i));
        let base = stack.gateway.base_url.clone();
        let form = LoginForm::load(&http, &base)
            .await
            .expect("the login page loads");
        flood.spawn(async move {
            let response = form
                .submit(&http, &base, &nobody(), "wrong", "/apps")
                .await
                .expect("answers");
            (
                response.status(),
                response.headers().contains_key("retry-after"),
            )
        });
    }
    let results = flood.join_all().await;
    let busy = results
        .iter()
        .filter(|(s, retry)| *s == StatusCode::SERVICE_UNAVAILABLE && *retry)
        .count();
    let wrong = results
        .iter()
        .filter(|(s, _)| *s == StatusCode::UNAUTHORIZED)
        .count();
    assert!(busy >= 1, "the hashing queue refused some: {results:?}");
    assert!(
        wrong >= 1,
        "some were hashed and refused as wrong: {results:?}"
    );
    assert_eq!(busy + wrong, results.len(), "nothing else: {results:?}");
    // After the flood the user still signs in.
    let a = sign_in(&stack, loopback(1, 12), &stack.email, PASSWORD, "/apps").await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);

    assert!(refusals(&stack, "rate_limited").await >= 3);
    assert!(refusals(&stack, "overloaded").await >= 1);
}

#[tokio::test]
async fn repeated_failures_lock_the_account_and_the_page_says_until_when() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_OAUTH__LIMITS__LOCKOUT_AFTER_FAILURES", "3"),
        // Long enough that the next step surely comes before it ends, on a loaded machine too.
        ("SANDGATE_OAUTH__LIMITS__LOCKOUT_SECONDS", "10"),
        ("SANDGATE_OAUTH__LIMITS__LOCKOUT_MAX_SECONDS", "10"),
        (
            "SANDGATE_OAUTH__LIMITS__LOGIN_PER_ACCOUNT_PER_MINUTE",
            "1000",
        ),
        (
            "SANDGATE_OAUTH__LIMITS__LOGIN_PER_ADDRESS_PER_MINUTE",
            "1000",
        ),
    ])
    .await;
    for i in 0..2u8 {
        let a = sign_in(&stack, loopback(4, i), &stack.email, "wrong", "/apps").await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED);
        assert!(!a.body.contains("locked"), "not locked yet: {}", a.body);
    }
    let a = sign_in(&stack, loopback(4, 2), &stack.email, "wrong", "/apps").await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert!(a.body.contains("This account is locked"), "{}", a.body);
    assert!(a.retry_after.is_some());
    // Locked: even the right password is refused, without hashing, saying so.
    let a = sign_in(&stack, loopback(4, 3), &stack.email, PASSWORD, "/apps").await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.body);
    assert!(a.body.contains("This account is locked"), "{}", a.body);
    assert!(a.retry_after.is_some_and(|s| s <= 10), "{a:?}");
    // When the lock ends, the owner gets in (and the count starts again).
    let mut n = 10u8;
    eventually(Duration::from_secs(30), "the lock to end", || {
        n += 1;
        let from = loopback(4, n);
        let stack = &stack;
        async move {
            let a = sign_in(stack, from, &stack.email, PASSWORD, "/apps").await;
            (a.status == StatusCode::SEE_OTHER).then_some(())
        }
    })
    .await;
    let a = sign_in(&stack, loopback(5, 1), &stack.email, "wrong", "/apps").await;
    assert!(
        !a.body.contains("locked"),
        "a success reset the count: {}",
        a.body
    );
}

#[tokio::test]
async fn after_login_only_same_origin_paths_are_followed() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let from = loopback(6, 1);
    for hostile in [
        "/\t/evil.example",
        "/\n/evil.example",
        "//evil.example",
        "/\\evil.example",
        "https://evil.example",
        "javascript:alert(1)",
        "http://evil.example/apps",
    ] {
        let a = sign_in(&stack, from, &stack.email, PASSWORD, hostile).await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
        assert_eq!(
            a.location, "/apps",
            "next={hostile:?} must fall back to /apps"
        );
    }
    let local = "/oauth/authorize?client_id=x&state=a%20b";
    let a = sign_in(&stack, from, &stack.email, PASSWORD, local).await;
    assert_eq!(a.location, local, "a local path is followed");
    // The login page itself never carries a hostile next.
    let page = stack
        .http
        .get(stack.url("/login?next=%2F%09%2Fevil.example"))
        .send()
        .await
        .expect("login page")
        .text()
        .await
        .expect("text");
    assert_eq!(hidden(&page, "next").as_deref(), Some("/apps"));
}

/// Registers a public client from `from`; the status and body.
async fn register_from(
    stack: &Stack,
    from: IpAddr,
    body: &Value,
) -> (StatusCode, Option<String>, Value) {
    let response = client_from(from)
        .post(stack.url("/oauth/register"))
        .json(body)
        .send()
        .await
        .expect("registration answers");
    let status = response.status();
    let retry = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (status, retry, response.json().await.unwrap_or(Value::Null))
}

fn registration(name: &str) -> Value {
    json!({
        "client_name": name,
        "redirect_uris": [REDIRECT],
        "token_endpoint_auth_method": "none",
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
    })
}

#[tokio::test]
async fn registration_floods_are_limited_and_cannot_evict_an_approved_client() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_OAUTH__LIMITS__REGISTER_PER_ADDRESS_PER_HOUR", "3"),
        ("SANDGATE_OAUTH__LIMITS__MAX_UNUSED_DYNAMIC_CLIENTS", "3"),
    ])
    .await;
    // Per address: three, then 429 with Retry-After; another address still registers.
    let flooder = loopback(7, 1);
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, _, body) =
            register_from(&stack, flooder, &registration(&format!("flood {i}"))).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        ids.push(body["client_id"].as_str().unwrap().to_owned());
    }
    let (status, retry, body) = register_from(&stack, flooder, &registration("one more")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(retry.is_some(), "Retry-After is set");
    assert!(
        body["error_description"]
            .as_str()
            .unwrap()
            .contains("retry in"),
        "{body}"
    );

    // A real app registers and the user approves it: it completed a flow.
    let (status, _, real) = register_from(&stack, loopback(7, 2), &registration("Real app")).await;
    assert_eq!(status, StatusCode::CREATED);
    let real_id = real["client_id"].as_str().unwrap().to_owned();
    let mut browser = Browser::new(&stack);
    let (query, _) = connect(&stack, &mut browser, &real_id, &Pkce::new(), "sandbox").await;
    assert!(query.contains_key("code"), "the real app got a code");

    // A flood from many addresses: the cap (3 unused) evicts the oldest unused ones, never
    // the approved one.
    for i in 0..6u8 {
        let (status, _, body) = register_from(
            &stack,
            loopback(8, i),
            &registration(&format!("flood b{i}")),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .expect("db");
    let unused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM oauth_clients c WHERE kind = 'dcr'
         AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.client_id = c.id)",
    )
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert!(
        unused <= 3,
        "at most 3 unused clients are kept, found {unused}"
    );
    let oldest: i64 = sqlx::query_scalar("SELECT count(*) FROM oauth_clients WHERE id = $1")
        .bind(&ids[0])
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(oldest, 0, "the oldest unused client was evicted");
    // The approved app connects again (consent skipped: connect once).
    let pkce = Pkce::new();
    let again = browser
        .get(&authorize_url(
            &stack, &real_id, REDIRECT, &pkce, "s2", "sandbox",
        ))
        .await;
    assert_eq!(again.status, StatusCode::SEE_OTHER, "{}", again.body);
    assert!(again.location.unwrap_or_default().starts_with(REDIRECT));

    // Attacker-chosen strings have limits with clear errors.
    let long_uri = format!("{REDIRECT}?{}", "a".repeat(3000));
    let mut body = registration("x");
    body["redirect_uris"] = json!([long_uri]);
    let (status, _, answer) = register_from(&stack, loopback(9, 1), &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer["error_description"]
            .as_str()
            .unwrap()
            .contains("at most 2000"),
        "{answer}"
    );
    let (status, _, answer) =
        register_from(&stack, loopback(9, 2), &registration(&"n".repeat(101))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer["error_description"]
            .as_str()
            .unwrap()
            .contains("at most 100"),
        "{answer}"
    );
}

#[tokio::test]
async fn metadata_document_fetches_are_limited_per_address_and_failures_are_cached() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        (
            "SANDGATE_OAUTH__CLIENT_METADATA__ALLOW_PRIVATE_ADDRESSES",
            "true",
        ),
        (
            "SANDGATE_OAUTH__LIMITS__METADATA_FETCH_PER_ADDRESS_PER_MINUTE",
            "1",
        ),
    ])
    .await;
    let (server, mut fetched) = document_server_answering("404 Not Found", String::new()).await;
    let authorize = |client_id: &str| {
        let pkce = Pkce::new();
        authorize_url(&stack, client_id, REDIRECT, &pkce, "s", "sandbox")
    };
    let attacker = client_from(loopback(10, 1));
    let first = format!("{server}/client-1.json");
    for _ in 0..3 {
        let page = attacker
            .get(authorize(&first))
            .send()
            .await
            .expect("answers");
        assert_eq!(page.status(), StatusCode::BAD_REQUEST);
        assert!(page.text().await.unwrap().contains("HTTP 404"));
    }
    assert!(fetched.recv().await.is_some(), "fetched once");
    assert!(
        fetched.try_recv().is_err(),
        "the failure was remembered: no second fetch of the same URL"
    );
    // A new URL costs a fetch, and this address has used its one per minute: 429.
    let page = attacker
        .get(authorize(&format!("{server}/client-2.json")))
        .send()
        .await
        .unwrap();
    let status = page.status();
    let retry_after = page.headers().contains_key("retry-after");
    let body = page.text().await.unwrap();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(retry_after);
    assert!(body.contains("retry in"), "{body}");
    // Another address is not held back by the first one's limit.
    let page = client_from(loopback(10, 2))
        .get(authorize(&format!("{server}/client-4.json")))
        .send()
        .await
        .unwrap();
    assert_eq!(
        page.status(),
        StatusCode::BAD_REQUEST,
        "fetched (and failed) normally"
    );
}

/// Opens a connection from `from` that sends an unfinished request head and then one header
/// byte every 300 ms, for at most `drip_for`; returns whether the server closed it (or answered)
/// before that.
async fn slowloris(from: IpAddr, addr: String, drip_for: Duration) -> bool {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind((from, 0).into())
        .expect("binds a loopback address");
    let Ok(mut socket) = socket.connect(addr.parse().expect("an address")).await else {
        return true;
    };
    if socket
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .is_err()
    {
        return true;
    }
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 512];
    while started.elapsed() < drip_for {
        tokio::select! {
            _ = socket.read(&mut buf) => {
                // The server answered (408) or closed: it did not wait for us.
                return true;
            }
            () = tokio::time::sleep(Duration::from_millis(300)) => {
                if socket.write_all(b"a").await.is_err() {
                    return true;
                }
            }
        }
    }
    false
}

#[tokio::test]
async fn slow_clients_cannot_pin_the_gateway() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_HTTP__MAX_CONNECTIONS", "32"),
        ("SANDGATE_HTTP__MAX_CONNECTIONS_PER_ADDRESS", "8"),
        ("SANDGATE_HTTP__HEADER_READ_TIMEOUT_SECONDS", "2"),
        ("SANDGATE_HTTP__BODY_READ_TIMEOUT_SECONDS", "2"),
    ])
    .await;
    let addr = stack
        .gateway
        .base_url
        .trim_start_matches("http://")
        .to_owned();
    // One address cannot take every slot: beyond 8, its connections are closed at once.
    let mut greedy = tokio::task::JoinSet::new();
    for _ in 0..12 {
        greedy.spawn(slowloris(
            loopback(11, 1),
            addr.clone(),
            Duration::from_secs(60),
        ));
    }
    let first = greedy.join_next().await.expect("a result").expect("joins");
    assert!(
        first,
        "a connection over the per-address cap is closed at once"
    );
    greedy.shutdown().await;
    // More slow connections than the gateway takes at once, from six addresses (8 each),
    // each dripping its headers.
    let mut slow = tokio::task::JoinSet::new();
    for i in 0..48u8 {
        slow.spawn(slowloris(
            loopback(12, i / 8),
            addr.clone(),
            Duration::from_secs(60),
        ));
    }
    // A normal request is still answered: the slow ones are cut off at the header deadline
    // and free their slots.
    eventually(
        Duration::from_secs(60),
        "/healthz to answer during the flood",
        || async {
            let response = reqwest::Client::new()
                .get(stack.url("/healthz"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .ok()?;
            response.status().is_success().then_some(())
        },
    )
    .await;
    let closed = slow.join_all().await;
    assert!(
        closed.iter().all(|c| *c),
        "every slow connection was closed by the gateway: {closed:?}"
    );

    // A body that never finishes: 408 at the body deadline, not a handler held forever.
    let mut socket = TcpStream::connect(&addr).await.expect("connects");
    socket
        .write_all(b"POST /oauth/register HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"client_name\":")
        .await
        .expect("writes");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), socket.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the gateway answered a stalled body");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(refusals(&stack, "timeout").await >= 1);
}

/// Reads from `socket` until the gateway closes (or resets) it: what was read, or `None` when it
/// is still open after `within`.
async fn until_closed(socket: &mut TcpStream, within: Duration) -> Option<String> {
    let mut read = Vec::new();
    tokio::time::timeout(within, socket.read_to_end(&mut read))
        .await
        .ok()
        .map(|_| String::from_utf8_lossy(&read).into_owned())
}

/// With rmcp's client in `era`: an `execute_code` cell and a `run_terminal_command` that each
/// sleep `sleep` seconds without output are answered.
async fn silent_calls_are_answered(mcp_url: &str, token: &str, era: Era, sleep: u64) {
    let client = Client::connect(mcp_url, token, era)
        .await
        .unwrap_or_else(|e| panic!("{era:?}: connects: {e}"));
    let conversation = format!("long-{era:?}-{}", uuid::Uuid::new_v4().simple());
    let cell = client
        .ok(
            "execute_code",
            json!({
                "conversation_id": conversation,
                "code": format!("import time\ntime.sleep({sleep})\n'slept'"),
            }),
        )
        .await;
    assert_eq!(
        cell.structured["result"]["text/plain"], "'slept'",
        "{era:?}: the {sleep} s cell's value comes back: {}",
        cell.text
    );
    let command = client
        .ok(
            "run_terminal_command",
            json!({"conversation_id": conversation, "command": format!("sleep {sleep}; echo slept")}),
        )
        .await;
    assert_eq!(
        command.structured["stdout"], "slept\n",
        "{era:?}: the {sleep} s command's output comes back: {}",
        command.text
    );
}

/// The idle timeout closes connections on which nothing is happening, not those with a request
/// being answered: a stateless (2026-07-28) call is answered with one JSON body when it ends and
/// nothing moves on its connection meanwhile, so before this a call longer than the idle timeout
/// lost its answer ("Server disconnected without sending a response" in the Python SDK). The
/// 2025-11-25 era answers on an SSE stream whose keep-alives move bytes. Plays the attacker too:
/// a connection that sends nothing, one kept alive after its answer, and one holding a request
/// "in flight" with a body that never ends are each still closed.
#[tokio::test]
async fn calls_longer_than_the_idle_timeout_are_answered_and_idle_connections_still_close() {
    // Idle 3 s, SSE keep-alive 1 s: the configuration allows 2 s (it must exceed the keep-alive);
    // 3 leaves a loaded machine a margin between keep-alives. Headers may take 100 s (the
    // default) and bodies 20 s, so a connection closed well before those was closed by the idle
    // timeout. Every call sleeps past two idle timeouts.
    const IDLE_SECONDS: u64 = 3;
    let stack = Stack::start(&[
        (
            "SANDGATE_HTTP__IDLE_TIMEOUT_SECONDS",
            &IDLE_SECONDS.to_string(),
        ),
        ("SANDGATE_MCP__SSE_KEEP_ALIVE_SECONDS", "1"),
        ("SANDGATE_HTTP__HEADER_READ_TIMEOUT_SECONDS", "100"),
        ("SANDGATE_HTTP__BODY_READ_TIMEOUT_SECONDS", "20"),
    ])
    .await;
    let sleep = IDLE_SECONDS * 2 + 1;
    let token = stack.gateway.token(&stack.tenant).await;
    let mcp_url = stack.gateway.mcp_url();
    let addr = stack
        .gateway
        .base_url
        .trim_start_matches("http://")
        .to_owned();
    let python = crate::python_sdk::python();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/python/long_call.py"
    );
    // rmcp's client in both eras, and the official Python SDK: `auto` is its default (2026-07-28,
    // what the benchmark hit) and `legacy` 2025-11-25. All at once; each failure is reported.
    let mut calls = tokio::task::JoinSet::new();
    for era in [Era::Stateless, Era::Sessions] {
        let (mcp_url, token) = (mcp_url.clone(), token.clone());
        calls.spawn(async move { silent_calls_are_answered(&mcp_url, &token, era, sleep).await });
    }
    for mode in ["auto", "legacy"] {
        let (python, mcp_url, token) = (python.clone(), mcp_url.clone(), token.clone());
        calls.spawn(async move {
            let sleep = sleep.to_string();
            let args = ["--mode", mode, "--sleep", &sleep];
            let within = Duration::from_secs(240);
            let stdout =
                crate::python_sdk::run_python(&python, script, &args, &mcp_url, &token, within)
                    .await;
            assert!(stdout.contains(&format!("ok ({mode}")), "{mode}: {stdout}");
        });
    }
    let mut failed = Vec::new();
    while let Some(joined) = calls.join_next().await {
        if let Err(panicked) = joined {
            failed.push(panicked.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "every call longer than the idle timeout is answered; failed: {failed:#?}"
    );

    // A connection that never sends a byte is closed.
    let mut silent = TcpStream::connect(&addr).await.expect("connects");
    assert!(
        until_closed(&mut silent, Duration::from_secs(30))
            .await
            .is_some(),
        "a connection that sends nothing is closed by the idle timeout"
    );
    // A kept-alive connection after its answer is closed: the answered request no longer holds it.
    let mut kept = TcpStream::connect(&addr).await.expect("connects");
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("writes");
    let answer = until_closed(&mut kept, Duration::from_secs(30))
        .await
        .expect("a kept-alive connection is closed by the idle timeout after its answer");
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "answered first: {answer}"
    );
    // A request held "in flight" by a body that never ends keeps its connection only until the
    // body deadline: answered 408, not held for as long as the client keeps it open.
    let mut stalled = TcpStream::connect(&addr).await.expect("connects");
    stalled
        .write_all(b"POST /mcp HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"jsonrpc\":")
        .await
        .expect("writes");
    let answer = until_closed(&mut stalled, Duration::from_secs(90))
        .await
        .expect("a request whose body never ends is answered at the body deadline");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // An HTTP/2 connection (cleartext, prior knowledge) answered once and then left alone is
    // closed as well. Its client is a well-behaved one that answers any ping the server sends:
    // were the server to ping (HTTP/2 keep-alive), the acknowledgements would move bytes and the
    // connection would never count as idle.
    let tcp = TcpStream::connect(&addr).await.expect("connects");
    let (h2, connection) = h2::client::handshake(tcp)
        .await
        .expect("an HTTP/2 handshake");
    let connection = tokio::spawn(connection);
    let mut h2 = h2.ready().await.expect("the connection takes a request");
    let request = http::Request::get(format!("http://{addr}/healthz"))
        .body(())
        .expect("a request");
    let (response, _) = h2.send_request(request, true).expect("sent");
    let response = response.await.expect("answered");
    assert_eq!(response.status(), http::StatusCode::OK);
    drop(response);
    assert!(
        tokio::time::timeout(Duration::from_secs(30), connection)
            .await
            .is_ok(),
        "an HTTP/2 connection with nothing to do is closed by the idle timeout"
    );
    drop(h2);
}

#[tokio::test]
async fn expired_codes_sessions_tokens_and_unused_clients_are_purged() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_OAUTH__LIMITS__PURGE_INTERVAL_SECONDS", "1"),
        // Long enough for the real app to finish its flow; the unused one is made old below.
        ("SANDGATE_OAUTH__LIMITS__UNUSED_CLIENT_TTL_SECONDS", "600"),
    ])
    .await;
    // A real connection: a grant, a live session, a live refresh token.
    let real = stack.register("Real app", REDIRECT).await;
    let real_id = real["client_id"].as_str().unwrap().to_owned();
    let mut browser = Browser::new(&stack);
    let pkce = Pkce::new();
    let (query, _) = connect(&stack, &mut browser, &real_id, &pkce, "sandbox").await;
    let (status, tokens) = stack
        .exchange(&real_id, &query["code"], &pkce.verifier)
        .await;
    assert_eq!(status, StatusCode::OK, "{tokens}");
    // A client nobody approved.
    let unused = stack.register("Never used", REDIRECT).await;
    let unused_id = unused["client_id"].as_str().unwrap().to_owned();
    // Expired rows beside the live ones, and the unused client made older than its TTL.
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .expect("db");
    sqlx::query("UPDATE oauth_clients SET created_at = now() - interval '1 hour' WHERE id = $1")
        .bind(&unused_id)
        .execute(&mut conn)
        .await
        .expect("an old unused client");
    let grant: uuid::Uuid = sqlx::query_scalar("SELECT id FROM grants WHERE client_id = $1")
        .bind(&real_id)
        .fetch_one(&mut conn)
        .await
        .expect("a grant");
    let user: uuid::Uuid = sqlx::query_scalar("SELECT id FROM users LIMIT 1")
        .fetch_one(&mut conn)
        .await
        .expect("a user");
    sqlx::query(
        "INSERT INTO auth_codes (code_hash, grant_id, client_id, redirect_uri, code_challenge, resource, scopes, expires_at)
         VALUES ('\\x01', $1, $2, 'x', 'x', 'x', 'sandbox', now() - interval '1 hour')",
    )
    .bind(grant)
    .bind(&real_id)
    .execute(&mut conn)
    .await
    .expect("an expired code");
    sqlx::query(
        "INSERT INTO user_sessions (id_hash, user_id, csrf_token, expires_at)
         VALUES ('\\x02', $1, 'x', now() - interval '1 hour')",
    )
    .bind(user)
    .execute(&mut conn)
    .await
    .expect("an expired session");
    sqlx::query(
        "INSERT INTO refresh_tokens (token_hash, family_id, grant_id, client_id, scopes, resource, expires_at)
         VALUES ('\\x03', gen_random_uuid(), $1, $2, 'sandbox', 'x', now() - interval '1 hour')",
    )
    .bind(grant)
    .bind(&real_id)
    .execute(&mut conn)
    .await
    .expect("an expired refresh token");

    let count = |sql: &'static str| {
        let url = stack.gateway.database_url.clone();
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&mut conn)
                .await
                .expect("count")
        }
    };
    eventually(Duration::from_secs(30), "the purge", || async {
        let expired = count(
            "SELECT (SELECT count(*) FROM auth_codes WHERE expires_at < now())
                  + (SELECT count(*) FROM user_sessions WHERE expires_at < now())
                  + (SELECT count(*) FROM refresh_tokens WHERE expires_at < now())",
        )
        .await;
        let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
            .await
            .ok()?;
        let unused_left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM oauth_clients WHERE id = $1")
                .bind(&unused_id)
                .fetch_one(&mut conn)
                .await
                .ok()?;
        (expired == 0 && unused_left == 0).then_some(())
    })
    .await;
    // What is live stays: the approved client, the session, the refresh token, which works.
    assert_eq!(
        count("SELECT count(*) FROM user_sessions WHERE expires_at > now()").await,
        1
    );
    let refreshed = stack
        .token_request(&[
            ("grant_type", "refresh_token"),
            ("refresh_token", tokens["refresh_token"].as_str().unwrap()),
            ("client_id", &real_id),
        ])
        .await;
    assert_eq!(refreshed.0, StatusCode::OK, "{}", refreshed.1);
    let page = browser.get(&stack.url("/apps")).await;
    assert!(
        page.body.contains("Real app"),
        "the session and the app are still there"
    );
}

#[tokio::test]
async fn oversized_ids_in_tool_arguments_are_invalid_params() {
    let stack = Stack::start(&[]).await;
    let token = stack.gateway.token(&stack.tenant).await;
    let client = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let long = "c".repeat(4096);
    let err = client
        .call("create_sandbox", json!({"conversation_id": long}))
        .await
        .expect_err("a protocol error");
    let text = err.to_string();
    assert!(
        text.contains("-32602") || text.contains("nvalid params"),
        "{text}"
    );
    assert!(
        text.contains("conversation_id is 4096 bytes") && text.contains("256"),
        "{text}"
    );
    let err = client
        .call(
            "execute_code",
            json!({"sandbox_id": "s".repeat(1000), "code": "1"}),
        )
        .await
        .expect_err("a protocol error");
    assert!(
        err.to_string().contains("sandbox_id is 1000 bytes"),
        "{err}"
    );
    // At the limit it works.
    let ok = client
        .ok(
            "create_sandbox",
            json!({"conversation_id": "c".repeat(256)}),
        )
        .await;
    assert!(ok.structured["sandbox_id"].as_str().is_some());
}

#[tokio::test]
async fn refused_requests_are_counted_by_reason_and_authenticated_ones_audited() {
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "0"),
        ("SANDGATE_MCP__MAX_REQUEST_BYTES", "4096"),
    ])
    .await;
    // 401: no token.
    let (status, _, _) = stack.mcp_status("not-a-token").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // 403: a token without the execute scope calls execute_code.
    let narrow = stack
        .gateway
        .cli(&[
            "admin",
            "token",
            "issue",
            "--tenant",
            &stack.tenant,
            "--scopes",
            "files:read",
        ])
        .await;
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "execute_code", "arguments": {"code": "1"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}});
    let response = stack
        .http
        .post(stack.gateway.mcp_url())
        .bearer_auth(&narrow)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .json(&call)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    // 413: a body over the limit with a valid token (audited), and without one (401: the
    // size of an anonymous body is nobody's business).
    let big = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "list_files", "arguments": {"path": "x".repeat(8192)}}});
    let response = stack
        .http
        .post(stack.gateway.mcp_url())
        .bearer_auth(&narrow)
        .header("accept", "application/json, text/event-stream")
        .json(&big)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let response = stack
        .http
        .post(stack.gateway.mcp_url())
        .header("accept", "application/json, text/event-stream")
        .json(&big)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    // A legitimate call with the same token still works.
    let client = Client::connect(&stack.gateway.mcp_url(), &narrow, Era::Stateless)
        .await
        .expect("connects");
    let tools = client.service.list_all_tools().await.expect("tools/list");
    assert!(tools.iter().any(|t| t.name == "list_files"));

    assert!(refusals(&stack, "unauthenticated").await >= 2);
    assert!(refusals(&stack, "insufficient_scope").await >= 1);
    assert!(refusals(&stack, "too_large").await >= 1);
    let rows: Vec<(String, String)> = eventually(Duration::from_secs(10), "the audit rows", || async {
        let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url).await.ok()?;
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT tool, coalesce(error_kind, '') FROM audit_events WHERE outcome = 'refused' ORDER BY at",
        )
        .fetch_all(&mut conn)
        .await
        .ok()?;
        (rows.len() >= 2).then_some(rows)
    })
    .await;
    assert!(
        rows.contains(&("execute_code".into(), "insufficient_scope".into())),
        "{rows:?}"
    );
    assert!(
        rows.contains(&("mcp".into(), "request_too_large".into())),
        "{rows:?}"
    );
}

/// Hostile code, through MCP: a fork bomb in one tenant's terminal runs into its sandbox's
/// process limit and its timeout. Meanwhile another tenant's calls are answered; afterwards the
/// bomber's own conversation goes on, its variables kept.
#[tokio::test]
async fn a_fork_bomb_through_the_terminal_is_contained_and_other_tenants_are_untouched() {
    let stack = Stack::start(&[]).await;
    let connect = |tenant: String| {
        let gateway = &stack.gateway;
        async move {
            Client::connect(
                &gateway.mcp_url(),
                &gateway.token(&tenant).await,
                Era::Stateless,
            )
            .await
            .expect("connects")
        }
    };
    let bomber = connect(stack.tenant.clone()).await;
    let bystander = connect(stack.gateway.create_tenant().await).await;
    // The data stack is imported first, so that the kernel's own start is not part of the test
    // (a kernel that dies of the bomb while importing is the sandbox crate's test).
    let first = bomber
        .ok(
            "execute_code",
            json!({"conversation_id": "bomb", "code": "import numpy, pandas, matplotlib.pyplot\nx = 41"}),
        )
        .await;
    let sandbox = first.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox")
        .to_owned();
    let other = bystander
        .ok(
            "execute_code",
            json!({"conversation_id": "calm", "code": "y = 1"}),
        )
        .await;
    let other_sandbox = other.structured["sandbox_id"].as_str().unwrap().to_owned();

    let bomb = bomber.call(
        "run_terminal_command",
        json!({
            "sandbox_id": sandbox,
            "command": "bomb(){ bomb|bomb& }; bomb; end=$((SECONDS+10)); while [ $SECONDS -lt $end ]; do :; done",
            "timeout_seconds": 5,
        }),
    );
    // While the bomb runs (five seconds), the other tenant works: a call every half second.
    let calm = async {
        for n in 2..10 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let step = bystander
                .ok(
                    "execute_code",
                    json!({"sandbox_id": other_sandbox, "code": "y += 1\ny"}),
                )
                .await;
            assert_eq!(step.structured["result"]["text/plain"], n.to_string());
        }
    };
    let (bombed, ()) = tokio::join!(bomb, calm);
    let bombed = bombed.expect("a tool result");
    assert_eq!(
        bombed.structured["timed_out"], true,
        "the bomb ran to its timeout: {}",
        bombed.text
    );
    assert!(
        bombed.structured["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("Resource temporarily unavailable")),
        "the bomb ran into the process limit"
    );
    let after = bomber
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox, "code": "x + 1"}),
        )
        .await;
    assert_eq!(
        after.structured["result"]["text/plain"], "42",
        "the bomber's kernel and its variables survived: {}",
        after.text
    );
}
