//! Download links and admin tokens as an attacker with a stolen link or token would try them
//! (issue 11): opaque, sealed, bound to the token that made them, audited, rate-limited,
//! streamed, and without effect on the sandbox's idle time; admin tokens capped, listed,
//! revocable, surviving a key rotation; signing-key seeds never in clear in Postgres.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::{Connection, Row};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};

/// The deployment secret every gateway of these tests shares (as replicas would).
const SECRET: &str = "links-e2e-secret-0123456789-abcdefghijklmnop";

async fn db(gateway: &Gateway) -> sqlx::PgConnection {
    sqlx::PgConnection::connect(&gateway.database_url)
        .await
        .expect("the test database accepts connections")
}

/// The id of the one admin token `admin token list` shows for `tenant`.
async fn admin_token_id(gateway: &Gateway, tenant: &str) -> String {
    let listed = gateway
        .cli(&["admin", "token", "list", "--tenant", tenant])
        .await;
    let line = listed
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("a token is listed: {listed}"));
    assert!(line.contains(tenant) && line.contains("active"), "{listed}");
    line.split_whitespace().next().unwrap().to_owned()
}

/// A sandbox with `path` written (`size` random bytes), and the sha256 computed inside it.
async fn sandbox_with_file(client: &Client, path: &str, size: usize) -> (String, String) {
    let made = client
        .ok(
            "execute_code",
            json!({"code": format!(
                "import os, hashlib\nos.makedirs(os.path.dirname('/home/user/{path}'), exist_ok=True)\n\
                 data = os.urandom({size})\nopen('/home/user/{path}', 'wb').write(data)\n\
                 hashlib.sha256(data).hexdigest()"
            )}),
        )
        .await;
    let sandbox = made.structured["sandbox_id"].as_str().unwrap().to_owned();
    let sha = made.structured["result"]["text/plain"]
        .as_str()
        .unwrap()
        .trim_matches('\'')
        .to_owned();
    (sandbox, sha)
}

async fn link_for(client: &Client, sandbox: &str, path: &str) -> String {
    let got = client
        .ok("get_file", json!({"sandbox_id": sandbox, "path": path}))
        .await;
    got.structured["download_url"].as_str().unwrap().to_owned()
}

async fn idle_clock(
    conn: &mut sqlx::PgConnection,
    sandbox: &str,
) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query("SELECT last_used_at FROM sandboxes WHERE id = $1")
        .bind(sandbox)
        .fetch_one(conn)
        .await
        .unwrap()
        .get("last_used_at")
}

/// A fresh database, a gateway on it with the shared secret and `extra_env`, a tenant, and a
/// client connected with an admin token of the tenant.
async fn stack(extra_env: &[(&str, &str)]) -> (String, Gateway, String, Client) {
    let database = support::fresh_database().await;
    let mut env = vec![("SANDGATE_KEYS__SECRET", SECRET)];
    env.extend_from_slice(extra_env);
    let gateway = Gateway::start(&database, &env).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    (database, gateway, tenant, client)
}

#[tokio::test]
async fn a_link_is_opaque_works_on_every_replica_is_audited_and_dies_with_its_token() {
    let env = [("SANDGATE_KEYS__SECRET", SECRET)];
    let (database, gateway, tenant, client) = stack(&[]).await;
    let path = "reports/q3-confidential.bin";
    let (sandbox, sha) = sandbox_with_file(&client, path, 4096).await;
    let link = link_for(&client, &sandbox, path).await;
    let token_part = link.rsplit('/').next().unwrap().to_owned();

    // Opaque: nothing of who or what can be read from it.
    let simple = tenant.replace('-', "");
    for secret in [
        tenant.as_str(),
        simple.as_str(),
        sandbox.as_str(),
        "q3-confidential",
        "/home/user",
        "reports",
    ] {
        assert!(!link.contains(secret), "the link shows {secret}: {link}");
    }

    // Opening it serves the file byte for byte, and does not count as use of the sandbox.
    // The get_file call itself refreshes the clock when it ends (in the background): take the
    // value once it has stopped moving.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let before = support::eventually(Duration::from_secs(10), "the idle clock to settle", || {
        let seen = seen.clone();
        let (gateway, sandbox) = (&gateway, &sandbox);
        async move {
            let now = idle_clock(&mut db(gateway).await, sandbox).await;
            let previous = seen.lock().unwrap().replace(now);
            (previous == Some(now)).then_some(now)
        }
    })
    .await;
    let mut conn = db(&gateway).await;
    let http = reqwest::Client::new();
    let response = http.get(&link).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["content-disposition"],
        "attachment; filename=\"q3-confidential.bin\""
    );
    let body = response.bytes().await.unwrap();
    assert_eq!(
        format!("{:x}", Sha256::digest(&body)),
        sha,
        "the file the sandbox hashed"
    );
    assert_eq!(
        idle_clock(&mut conn, &sandbox).await,
        before,
        "opening a link leaves the sandbox's idle clock alone"
    );

    // Tampered or truncated: refused.
    let mut tampered = token_part.clone().into_bytes();
    let mid = tampered.len() / 2;
    tampered[mid] = if tampered[mid] == b'A' { b'B' } else { b'A' };
    for bad in [
        String::from_utf8(tampered).unwrap(),
        token_part[..token_part.len() - 1].to_owned(),
        token_part[..20].to_owned(),
    ] {
        let response = http
            .get(format!("{}/files/{bad}", gateway.base_url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{bad}");
    }

    // Another process on the same database and configuration (a replica, or the next start)
    // opens it too.
    let replica = Gateway::start_gateway_only(&database, &gateway.instance, &env).await;
    let response = http
        .get(format!("{}/files/{token_part}", replica.base_url))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "a replica opens the link"
    );
    assert_eq!(response.bytes().await.unwrap(), body);

    // Every opening is audited: tenant, sandbox, path, outcome (the tampered ones name nobody).
    let rows = support::eventually(Duration::from_secs(10), "the openings audited", || async {
        let rows = sqlx::query(
            "SELECT sandbox_id, path, outcome, bytes FROM download_events WHERE tenant_id = $1::uuid ORDER BY id",
        )
        .bind(&tenant)
        .fetch_all(&mut db(&gateway).await)
        .await
        .unwrap();
        (rows.len() >= 2).then_some(rows)
    })
    .await;
    for row in &rows {
        assert_eq!(
            row.get::<Option<String>, _>("sandbox_id").as_deref(),
            Some(sandbox.as_str())
        );
        assert_eq!(
            row.get::<Option<String>, _>("path").as_deref(),
            Some(format!("/home/user/{path}").as_str())
        );
        assert_eq!(row.get::<String, _>("outcome"), "ok");
        assert_eq!(row.get::<Option<i64>, _>("bytes"), Some(4096));
    }

    // Revoking the token that made the link ends the link at once, on every replica.
    let id = admin_token_id(&gateway, &tenant).await;
    let revoked = gateway.cli(&["admin", "token", "revoke", &id]).await;
    assert!(revoked.contains(&id), "{revoked}");
    for base in [&gateway.base_url, &replica.base_url] {
        let response = http
            .get(format!("{base}/files/{token_part}"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            StatusCode::GONE,
            "a revoked token's link is gone"
        );
    }
    let reason = support::eventually(Duration::from_secs(10), "the refusal audited", || async {
        refused_reason(&gateway, &tenant).await
    })
    .await;
    assert_eq!(reason, "revoked");
}

async fn refused_reason(gateway: &Gateway, tenant: &str) -> Option<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT reason FROM download_events WHERE tenant_id = $1::uuid AND outcome = 'refused' ORDER BY id LIMIT 1",
    )
    .bind(tenant)
    .fetch_optional(&mut db(gateway).await)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_large_file_streams_through_byte_for_byte() {
    let (_, _gateway, _, client) = stack(&[]).await;
    // 20 MB: the largest file the default limits move, 80 agent chunks.
    let size = 20 * 1024 * 1024;
    let (sandbox, sha) = sandbox_with_file(&client, "big/blob.bin", size).await;
    let link = link_for(&client, &sandbox, "big/blob.bin").await;
    let mut response = reqwest::get(&link).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers().get("content-length").is_none(),
        "streamed (chunked), not buffered into a sized body"
    );
    let mut hasher = Sha256::new();
    let mut received = 0usize;
    while let Some(chunk) = response.chunk().await.expect("the body streams to its end") {
        received += chunk.len();
        hasher.update(&chunk);
    }
    assert_eq!(received, size);
    assert_eq!(
        format!("{:x}", hasher.finalize()),
        sha,
        "the sandbox's own checksum"
    );
}

#[tokio::test]
async fn opening_links_too_often_is_refused_with_retry_after() {
    let (_, gateway, tenant, client) = stack(&[
        ("SANDGATE_LINKS__PER_LINK_PER_MINUTE", "2"),
        ("SANDGATE_LINKS__PER_TENANT_PER_MINUTE", "3"),
    ])
    .await;
    let (sandbox, _) = sandbox_with_file(&client, "a.bin", 10).await;
    let first = link_for(&client, &sandbox, "a.bin").await;
    let second = link_for(&client, &sandbox, "a.bin").await;
    let status = |url: String| async move { reqwest::get(&url).await.unwrap() };
    assert_eq!(status(first.clone()).await.status(), StatusCode::OK);
    assert_eq!(status(first.clone()).await.status(), StatusCode::OK);
    let limited = status(first.clone()).await;
    assert_eq!(
        limited.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the third opening of one link"
    );
    let retry: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert!(limited.text().await.unwrap().contains("opened too often"));
    // Another link of the same tenant has its own count, up to the tenant's.
    assert_eq!(status(second.clone()).await.status(), StatusCode::OK);
    let tenant_limited = status(second).await;
    assert_eq!(
        tenant_limited.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the tenant's fourth opening"
    );
    assert!(
        tenant_limited
            .text()
            .await
            .unwrap()
            .contains("Too many downloads")
    );
    let reason = support::eventually(Duration::from_secs(10), "the limit audited", || async {
        refused_reason(&gateway, &tenant).await
    })
    .await;
    assert_eq!(reason, "rate_limited");
}

async fn mcp_request(gateway: &Gateway, token: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(gateway.mcp_url())
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .send()
        .await
        .unwrap()
}

async fn mcp_status(gateway: &Gateway, token: &str) -> StatusCode {
    mcp_request(gateway, token).await.status()
}

#[tokio::test]
async fn admin_tokens_are_capped_listed_revocable_and_survive_a_key_rotation() {
    let database = support::fresh_database().await;
    let env = [("SANDGATE_KEYS__SECRET", SECRET)];
    let gateway = Gateway::start(&database, &env).await;
    let tenant = gateway.create_tenant().await;

    // The lifetime is capped.
    let refused = gateway
        .cli_fails(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "31d",
        ])
        .await;
    assert!(
        refused.contains("keys.admin_token_max_ttl_seconds") && refused.contains("2592000"),
        "{refused}"
    );
    let token = gateway
        .cli(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "30d",
        ])
        .await;
    let id = admin_token_id(&gateway, &tenant).await;

    // A rotation, and the old key retired two days ago (past the 24 h that OAuth tokens need):
    // once the gateway has reloaded its keys, it still verifies the 30-day token.
    gateway.cli(&["admin", "keys", "rotate"]).await;
    let mut conn = db(&gateway).await;
    let moved = sqlx::query(
        "UPDATE signing_keys SET retired_at = now() - interval '2 days' WHERE retired_at IS NOT NULL",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(moved.rows_affected(), 1, "one retired key");
    // A token naming a key id the gateway does not know makes it reload its keys from Postgres
    // (as it does for a rotation by another replica).
    let unknown_kid = {
        use base64::Engine;
        let b64 = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.{}",
            b64(json!({"alg": "EdDSA", "typ": "at+jwt", "kid": "k_not_loaded_yet"})),
            b64(json!({"sub": "nobody"})),
            "A".repeat(86)
        )
    };
    assert_eq!(
        mcp_status(&gateway, &unknown_kid).await,
        StatusCode::UNAUTHORIZED
    );
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .unwrap_or_else(|e| panic!("the admin token outlives the rotation: {e}"));
    assert!(!client.service.list_all_tools().await.unwrap().is_empty());

    // Revoked: refused at once, with a clear message.
    gateway.cli(&["admin", "token", "revoke", &id]).await;
    let response = mcp_request(&gateway, &token).await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        body["error_description"],
        "the access token was revoked or its app was disconnected"
    );
    let listed = gateway
        .cli(&["admin", "token", "list", "--tenant", &tenant])
        .await;
    assert!(
        listed.contains(&id) && listed.contains("revoked"),
        "{listed}"
    );
    let unknown = gateway
        .cli_fails(&["admin", "token", "revoke", "no-such-token"])
        .await;
    assert!(unknown.contains("admin token list"), "{unknown}");
}

#[tokio::test]
async fn signing_key_seeds_are_sealed_at_rest_and_clear_ones_are_sealed_at_start() {
    let database = support::fresh_database().await;
    let env = [("SANDGATE_KEYS__SECRET", SECRET)];
    let gateway = Gateway::start(&database, &env).await;
    // A key stored in clear by an older version (long retired, so nothing verifies with it).
    let legacy_seed = [0x5a_u8; 32];
    let mut conn = db(&gateway).await;
    sqlx::query(
        "INSERT INTO signing_keys (kid, seed, public_key, created_at, retired_at)
         VALUES ('k_legacy', $1, $2, now() - interval '800 days', now() - interval '700 days')",
    )
    .bind(legacy_seed.as_slice())
    .bind([7u8; 32].as_slice())
    .execute(&mut conn)
    .await
    .unwrap();
    drop(gateway);
    let gateway = Gateway::start(&database, &env).await;
    let rows = sqlx::query("SELECT kid, seed, sealed_seed FROM signing_keys")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert!(rows.len() >= 2, "the gateway's key and the legacy one");
    for row in &rows {
        let kid: String = row.get("kid");
        assert!(
            row.get::<Option<Vec<u8>>, _>("seed").is_none(),
            "{kid}'s seed is not in clear"
        );
        let sealed: Vec<u8> = row
            .get::<Option<Vec<u8>>, _>("sealed_seed")
            .expect("sealed");
        assert!(
            !sealed.windows(32).any(|w| w == legacy_seed),
            "{kid}'s sealed form does not contain the seed"
        );
    }
    drop(gateway);

    // Another secret cannot open them: the gateway refuses to start, saying why.
    let output = support::sandgate_command()
        .arg("serve")
        .env("SANDGATE_LISTEN", "127.0.0.1:0")
        .env("SANDGATE_DATABASE__URL", &database)
        .env(
            "SANDGATE_KEYS__SECRET",
            "another-secret-0123456789-abcdefghijklmnop",
        )
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot be decrypted with keys.secret"),
        "{stderr}"
    );

    // Without a secret outside loopback it refuses to start and says how to set one.
    let output = support::sandgate_command()
        .arg("serve")
        .env("SANDGATE_LISTEN", "127.0.0.1:0")
        .env("SANDGATE_PUBLIC_URL", "https://sandgate.example.com")
        .env("SANDGATE_DATABASE__URL", &database)
        .env_remove("SANDGATE_KEYS__SECRET")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("keys.secret") && stderr.contains("SANDGATE_KEYS__SECRET"),
        "{stderr}"
    );
}
