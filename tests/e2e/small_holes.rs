//! Issue 24, hole 10 (the small ones), against the real binary where a binary shows them: the
//! public development secret off a loopback listener, the security headers of `/transcripts`.
//! The others have their tests beside their code: `/metrics` naming no node (placement.rs and
//! sandgate-service's metrics tests), notebook file names (sandgate-transcript's notebook
//! tests), link tokens in request spans (sandgate-gateway's `logged_path` test).

use crate::support::{self, Gateway};

#[tokio::test]
async fn the_development_secret_is_refused_when_the_listener_is_not_loopback_even_if_the_public_url_is()
 {
    let output = support::sandgate_command()
        .arg("serve")
        .env("SANDGATE_LISTEN", "0.0.0.0:0")
        .env("SANDGATE_PUBLIC_URL", "http://127.0.0.1:8080")
        .env_remove("SANDGATE_KEYS__SECRET")
        .env_remove("SANDGATE_OAUTH__COOKIE_SECRET")
        .env(
            "SANDGATE_DATABASE__URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .output()
        .await
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "serve must refuse to run on 0.0.0.0 with the public development secret: {stderr}"
    );
    assert!(
        stderr.contains("listen address is not loopback")
            && stderr.contains("SANDGATE_KEYS__SECRET"),
        "the error says why and which setting to set: {stderr}"
    );
}

#[tokio::test]
async fn the_transcripts_page_carries_the_oauth_pages_security_headers() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = client
        .get(format!(
            "{}/transcripts?conversation_id=x",
            gateway.base_url
        ))
        .send()
        .await
        .expect("/transcripts answers");
    let headers = response.headers();
    for (name, value) in [
        ("x-frame-options", "DENY"),
        ("referrer-policy", "no-referrer"),
        ("x-content-type-options", "nosniff"),
        ("cache-control", "no-store"),
        ("cross-origin-opener-policy", "same-origin"),
    ] {
        assert_eq!(
            headers.get(name).and_then(|v| v.to_str().ok()),
            Some(value),
            "/transcripts sends {name}: {headers:?}"
        );
    }
    assert!(
        headers
            .get("content-security-policy")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("frame-ancestors 'none'")),
        "/transcripts sends the pages' CSP: {headers:?}"
    );
}
