//! Helpers of the OAuth end-to-end tests: a gateway with a tenant and a user, a PKCE pair, a
//! cookie-keeping browser, the authorization-code flow, and small servers that stand in for a
//! client's redirect URI and metadata document.

use crate::support::{self, Gateway};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::time::Duration;

pub const PASSWORD: &str = "correct horse battery staple";
pub const REDIRECT: &str = "http://127.0.0.1:9/callback";

/// A gateway with a tenant and a user who can log in.
pub struct Stack {
    pub gateway: Gateway,
    pub tenant: String,
    pub email: String,
    pub http: reqwest::Client,
}

impl Stack {
    pub async fn start(extra_env: &[(&str, &str)]) -> Stack {
        let database = support::fresh_database().await;
        let gateway = Gateway::start(&database, extra_env).await;
        let tenant = gateway.create_tenant().await;
        let email = format!(
            "ana-{}@example.com",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        gateway
            .cli_stdin(
                &[
                    "admin", "user", "create", "--tenant", &tenant, "--email", &email,
                ],
                &format!("{PASSWORD}\n"),
            )
            .await;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client");
        Stack {
            gateway,
            tenant,
            email,
            http,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway.base_url)
    }

    /// Registers a public client (RFC 7591) and returns the registration response.
    pub async fn register(&self, name: &str, redirect: &str) -> Value {
        let response = self
            .http
            .post(self.url("/oauth/register"))
            .json(&json!({
                "client_name": name,
                "redirect_uris": [redirect],
                "token_endpoint_auth_method": "none",
                "grant_types": ["authorization_code", "refresh_token"],
                "response_types": ["code"],
            }))
            .send()
            .await
            .expect("registration answers");
        assert_eq!(
            response.status(),
            StatusCode::CREATED,
            "registration succeeds"
        );
        response.json().await.expect("JSON registration")
    }

    /// Exchanges a code at the token endpoint; returns the status and JSON body.
    pub async fn exchange(
        &self,
        client_id: &str,
        code: &str,
        verifier: &str,
    ) -> (StatusCode, Value) {
        self.token_request(&[
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", REDIRECT),
            ("code_verifier", verifier),
            ("client_id", client_id),
            ("resource", &self.gateway.mcp_url()),
        ])
        .await
    }

    pub async fn token_request(&self, form: &[(&str, &str)]) -> (StatusCode, Value) {
        let response = self
            .http
            .post(self.url("/oauth/token"))
            .form(form)
            .send()
            .await
            .expect("the token endpoint answers");
        let status = response.status();
        assert_eq!(
            response
                .headers()
                .get("cache-control")
                .and_then(|v| v.to_str().ok()),
            Some("no-store"),
            "token responses are never cached"
        );
        (
            status,
            response.json().await.expect("a JSON token response"),
        )
    }

    /// The value of the `/metrics` series `series` (name and labels, e.g.
    /// `sandgate_http_refusals_total{reason="timeout"}`), 0 when absent.
    pub async fn metric(&self, series: &str) -> u64 {
        let text = self
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("/metrics answers")
            .text()
            .await
            .expect("metrics text");
        let prefix = format!("{series} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// A raw MCP request with a token: the status, the challenge header and the body.
    pub async fn mcp_status(&self, token: &str) -> (StatusCode, String, Value) {
        let response = self
            .http
            .post(self.gateway.mcp_url())
            .bearer_auth(token)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2026-07-28")
            .header("mcp-method", "tools/list")
            .json(
                &json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
                "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}}),
            )
            .send()
            .await
            .expect("/mcp answers");
        let status = response.status();
        let challenge = header(response.headers(), "www-authenticate");
        let body = response.json().await.unwrap_or(Value::Null);
        (status, challenge, body)
    }
}

pub fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A PKCE pair, computed here independently of the server's code.
pub struct Pkce {
    pub verifier: String,
    pub challenge: String,
}

impl Pkce {
    pub fn new() -> Pkce {
        let verifier = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let challenge = URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()));
        Pkce {
            verifier,
            challenge,
        }
    }
}

/// The authorization URL a client would send the browser to.
pub fn authorize_url(
    stack: &Stack,
    client_id: &str,
    redirect: &str,
    pkce: &Pkce,
    state: &str,
    scope: &str,
) -> String {
    let mut url = reqwest::Url::parse(&stack.url("/oauth/authorize")).expect("a URL");
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", client_id)
        .append_pair("redirect_uri", redirect)
        .append_pair("code_challenge", &pkce.challenge)
        .append_pair("code_challenge_method", "S256")
        .append_pair("state", state)
        .append_pair("scope", scope)
        .append_pair("resource", &stack.gateway.mcp_url());
    url.to_string()
}

/// A response as a browser sees it.
#[derive(Debug)]
pub struct Page {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
    /// The Location header, made absolute.
    pub location: Option<String>,
}

/// A cookie-keeping, non-redirecting HTTP client: a browser whose every step the test sees.
pub struct Browser {
    http: reqwest::Client,
    base: String,
    cookies: HashMap<String, String>,
}

impl Browser {
    /// A browser whose relative redirects resolve against `base` (a gateway's base URL). It
    /// sends every cookie it holds to every URL, whichever gateway set it.
    pub fn at(base: &str) -> Browser {
        Browser {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("an HTTP client"),
            base: base.to_owned(),
            cookies: HashMap::new(),
        }
    }

    pub fn new(stack: &Stack) -> Browser {
        Browser {
            http: stack.http.clone(),
            base: stack.gateway.base_url.clone(),
            cookies: HashMap::new(),
        }
    }

    /// The cookies held, as a `Cookie` header.
    pub fn cookies(&self) -> String {
        self.cookie_header()
    }

    fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    async fn finish(&mut self, response: reqwest::Response) -> Page {
        for set in response.headers().get_all("set-cookie") {
            let set = set.to_str().expect("ASCII cookie");
            let (pair, attributes) = set.split_once(';').unwrap_or((set, ""));
            let (name, value) = pair.split_once('=').expect("name=value");
            if value.is_empty() || attributes.contains("Max-Age=0") {
                self.cookies.remove(name);
            } else {
                self.cookies.insert(name.to_owned(), value.to_owned());
            }
        }
        let status = response.status();
        let headers = response.headers().clone();
        let location = headers
            .get("location")
            .and_then(|v| v.to_str().ok())
            .map(|l| {
                if l.starts_with('/') {
                    format!("{}{l}", self.base)
                } else {
                    l.to_owned()
                }
            });
        let body = response.text().await.unwrap_or_default();
        Page {
            status,
            headers,
            body,
            location,
        }
    }

    pub async fn get(&mut self, url: &str) -> Page {
        let response = self
            .http
            .get(url)
            .header("cookie", self.cookie_header())
            .send()
            .await
            .expect("the gateway answers");
        self.finish(response).await
    }

    pub async fn post(&mut self, url: &str, form: &[(&str, &str)]) -> Page {
        let response = self
            .http
            .post(url)
            .header("cookie", self.cookie_header())
            .form(form)
            .send()
            .await
            .expect("the gateway answers");
        self.finish(response).await
    }

    /// From a redirect to the login page: fills in the form and follows to where it leads.
    pub async fn log_in(&mut self, login_url: &str, email: &str, password: &str) -> Page {
        let form = self.get(login_url).await;
        assert_eq!(form.status, StatusCode::OK, "the login page loads");
        let csrf = hidden(&form.body, "csrf").expect("the login form has a CSRF token");
        let next = hidden(&form.body, "next").expect("the login form keeps where to go next");
        let done = self
            .post(
                &format!("{}/login", self.base),
                &[
                    ("email", email),
                    ("password", password),
                    ("csrf", &csrf),
                    ("next", &next),
                ],
            )
            .await;
        assert_eq!(
            done.status,
            StatusCode::SEE_OTHER,
            "login answers 303: {}",
            done.body
        );
        done
    }
}

/// The value of a hidden input named `name` in a page.
pub fn hidden(body: &str, name: &str) -> Option<String> {
    let marker = format!("name=\"{name}\" value=\"");
    let start = body.find(&marker)? + marker.len();
    let end = body[start..].find('"')? + start;
    Some(
        body[start..end]
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

/// The query parameters of a URL.
pub fn query_of(url: &str) -> HashMap<String, String> {
    reqwest::Url::parse(url)
        .expect("a URL")
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// Walks authorize → login → consent (approve) and returns the final redirect's query and the
/// consent page.
pub async fn connect(
    stack: &Stack,
    browser: &mut Browser,
    client_id: &str,
    pkce: &Pkce,
    scope: &str,
) -> (HashMap<String, String>, Page) {
    let start = browser
        .get(&authorize_url(
            stack, client_id, REDIRECT, pkce, "st-123", scope,
        ))
        .await;
    let consent = match start.status {
        StatusCode::SEE_OTHER
            if start
                .location
                .as_deref()
                .is_some_and(|l| l.contains("/login?")) =>
        {
            let after = browser
                .log_in(start.location.as_deref().unwrap(), &stack.email, PASSWORD)
                .await;
            browser
                .get(after.location.as_deref().expect("login redirects back"))
                .await
        }
        _ => start,
    };
    assert_eq!(
        consent.status,
        StatusCode::OK,
        "the consent page shows: {}",
        consent.body
    );
    let csrf = hidden(&consent.body, "csrf").expect("the consent form has a CSRF token");
    let mut fields: Vec<(String, String)> = [
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
    .filter_map(|k| hidden(&consent.body, k).map(|v| (k.to_string(), v)))
    .collect();
    fields.push(("csrf".into(), csrf));
    fields.push(("decision".into(), "approve".into()));
    let form: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let approved = browser.post(&stack.url("/oauth/authorize"), &form).await;
    assert_eq!(
        approved.status,
        StatusCode::SEE_OTHER,
        "approving answers 303: {}",
        approved.body
    );
    let location = approved.location.expect("a redirect to the client");
    assert!(
        location.starts_with(REDIRECT),
        "the redirect goes to the client: {location}"
    );
    (query_of(&location), consent)
}

pub fn url_encode(s: &str) -> String {
    reqwest::Url::parse_with_params("http://x/", &[("v", s)])
        .unwrap()
        .query()
        .unwrap()
        .trim_start_matches("v=")
        .to_owned()
}

/// Signs a token with the gateway's own key (read from its database, opened with the
/// development secret that a loopback gateway without `keys.secret` uses) but other claims.
pub async fn forge(stack: &Stack, audience: &str, ttl: Duration) -> String {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .unwrap();
    let (kid, sealed): (String, Vec<u8>) = sqlx::query_as(
        "SELECT kid, sealed_seed FROM signing_keys WHERE retired_at IS NULL ORDER BY created_at DESC LIMIT 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let sealer = sandgate_gateway::keys::SeedSealer::new(
        sandgate_gateway::config::DEVELOPMENT_SECRET.as_bytes(),
    );
    let seed = sealer
        .open(&kid, &sealed)
        .expect("the seed opens with the development secret");
    let key = sandgate_auth::KeyPair::from_seed(kid, seed);
    sandgate_auth::TokenIssuer::new(key, stack.gateway.base_url.clone())
        .issue(
            "u",
            stack.tenant.parse().unwrap(),
            &sandgate_auth::Scope::ALL,
            audience,
            ttl,
            None,
            None,
        )
        .unwrap()
        .0
}

/// A one-shot HTTP server on loopback standing in for the client's redirect endpoint: answers
/// every request with a small page and reports each request target.
pub async fn callback_server() -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                if let Some(target) = head.lines().next().and_then(|l| l.split(' ').nth(1)) {
                    let _ = tx.send(target.to_owned());
                }
                let body = "<!doctype html><title>Connected</title><h1>Connected</h1>";
                let _ = socket
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    (format!("http://{addr}/callback"), rx)
}

/// Serves `body` as JSON at every path on a loopback port; reports each request.
pub async fn document_server(
    body: String,
) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    document_server_answering("200 OK", body).await
}

/// A server that answers every request with `status` (e.g. `404 Not Found`) and `body`, and
/// reports each request line.
pub async fn document_server_answering(
    status: &'static str,
    body: String,
) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let tx = tx.clone();
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let _ = tx.send(head.lines().next().unwrap_or_default().to_owned());
                let _ = socket
                    .write_all(
                        format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    (format!("http://{addr}"), rx)
}
