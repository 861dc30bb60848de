//! Postgres over TLS (issue 25): the real binary against a Postgres of the test's own that
//! serves only TLS, with a certificate from a test CA for `localhost`. `sslmode=verify-full` with
//! that CA connects; another CA, or a host name the certificate does not carry, is refused with
//! an error that says the handshake failed and why; a plain connection is refused by the server.

use sandgate_node::test_pki::Pki;

use crate::support::own_postgres::{OwnPostgres, ServerTls};
use crate::support::sandgate_command;

/// Runs `sandgate migrate` against `url`; (success, stderr).
async fn migrate(url: &str) -> (bool, String) {
    let output = sandgate_command()
        .arg("migrate")
        .env("SANDGATE_DATABASE__URL", url)
        .env_remove("DATABASE_URL")
        .output()
        .await
        .expect("the binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn verify_full_connects_and_a_wrong_ca_or_host_is_refused() {
    let ca = Pki::new("postgres test CA");
    let (cert_pem, key_pem) = ca.leaf_pem_for(&["localhost"]);
    let server = OwnPostgres::start(Some(ServerTls { cert_pem, key_pem })).await;
    let bundle = server.dir().join("ca.pem");
    std::fs::write(&bundle, ca.ca_pem()).expect("the CA bundle");
    let other = server.dir().join("other-ca.pem");
    std::fs::write(&other, Pki::new("another CA").ca_pem()).expect("another CA");
    let tls = |host: &str, mode: &str, ca: &std::path::Path| {
        server.tcp_url(
            host,
            "postgres",
            &format!("sslmode={mode}&sslrootcert={}", ca.display()),
        )
    };

    let (ok, stderr) = migrate(&tls("localhost", "verify-full", &bundle)).await;
    assert!(
        ok,
        "verify-full with the server's CA connects and migrates: {stderr}"
    );

    let (ok, stderr) = migrate(&tls("localhost", "verify-full", &other)).await;
    assert!(
        !ok,
        "a CA that did not sign the server's certificate is refused"
    );
    assert!(
        stderr.contains("TLS handshake with Postgres failed") && stderr.contains("UnknownIssuer"),
        "the refusal says the certificate's issuer is not trusted: {stderr}"
    );

    let (ok, stderr) = migrate(&tls("127.0.0.1", "verify-full", &bundle)).await;
    assert!(
        !ok,
        "a host name the certificate does not carry is refused under verify-full"
    );
    assert!(
        stderr.contains("TLS handshake with Postgres failed")
            && stderr.contains("not valid for name \"127.0.0.1\""),
        "the refusal says the certificate is not valid for that name: {stderr}"
    );

    // verify-ca checks the chain only: the same address is then accepted.
    let (ok, stderr) = migrate(&tls("127.0.0.1", "verify-ca", &bundle)).await;
    assert!(
        ok,
        "verify-ca accepts the CA's certificate on another name: {stderr}"
    );

    let (ok, stderr) = migrate(&server.tcp_url("localhost", "postgres", "sslmode=disable")).await;
    assert!(!ok, "the server refuses a connection without TLS");
    assert!(
        stderr.contains("no encryption") || stderr.contains("pg_hba.conf"),
        "the server's refusal is shown: {stderr}"
    );
}
