//! Issue 24, hole 6, against the real binary: two addresses opening connections until refused
//! (and keeping them busy with `/healthz`) leave a third address served, and an anonymous
//! connection kept alive by requests is still closed at its age while an authenticated one is
//! not. The whole 127/8 is loopback, so each address is a different client.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{self, Gateway};

/// How long a request on a held connection may take before the test calls it "not served" (a
/// connection waiting in the listen backlog is never answered at all).
const HUNG: Duration = Duration::from_secs(15);

async fn connect_from(from: IpAddr, addr: &str) -> Option<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind((from, 0).into()).ok()?;
    socket.connect(addr.parse().ok()?).await.ok()
}

/// Sends `request` on `socket` and reads one response (its head, then its body by
/// `content-length`); `None` when the connection closed first or nothing came within [`HUNG`].
async fn exchange(socket: &mut TcpStream, request: &str) -> Option<String> {
    socket.write_all(request.as_bytes()).await.ok()?;
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = socket.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())
                            .flatten()
                    })
                    .unwrap_or(0);
                if buf.len() >= end + 4 + length {
                    return Some(text);
                }
            }
        }
    };
    tokio::time::timeout(HUNG, read).await.ok().flatten()
}

const HEALTHZ: &str = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

/// Opens connections from `from`, each answered once, until the gateway refuses one; the ones
/// it kept.
async fn hold_until_refused(from: IpAddr, addr: &str, most: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    while held.len() < most {
        let Some(mut socket) = connect_from(from, addr).await else {
            break;
        };
        match exchange(&mut socket, HEALTHZ).await {
            Some(answer) if answer.starts_with("HTTP/1.1 200") => held.push(socket),
            _ => break,
        }
    }
    held
}

#[tokio::test]
async fn two_addresses_opening_connections_until_refused_leave_a_third_served() {
    let database = support::fresh_database().await;
    // The default connection limits.
    let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let addr = gateway.base_url.trim_start_matches("http://").to_owned();
    let mut held = Vec::new();
    for last in [2, 3] {
        let from = IpAddr::V4(Ipv4Addr::new(127, 0, 24, last));
        let mine = hold_until_refused(from, &addr, 5000).await;
        assert!(!mine.is_empty(), "{from} got some connections");
        held.push((from, mine));
    }
    for (from, mine) in &held {
        assert!(
            mine.len() < 5000,
            "{from} was refused at its share ({} held)",
            mine.len()
        );
    }
    // The held connections are kept busy: each answers once more.
    for (_, mine) in &mut held {
        for socket in mine.iter_mut().take(8) {
            assert!(exchange(socket, HEALTHZ).await.is_some(), "still served");
        }
    }
    let third = IpAddr::V4(Ipv4Addr::new(127, 0, 24, 4));
    let mut socket = connect_from(third, &addr)
        .await
        .expect("a third address connects");
    let answer = exchange(&mut socket, HEALTHZ).await;
    assert!(
        answer
            .as_deref()
            .is_some_and(|a| a.starts_with("HTTP/1.1 200")),
        "a third address is served while two hold {} and {} connections: {answer:?}",
        held[0].1.len(),
        held[1].1.len()
    );
}

#[tokio::test]
async fn an_anonymous_connection_kept_busy_is_closed_at_its_age_and_an_authenticated_one_is_not() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_HTTP__ANONYMOUS_MAX_AGE_SECONDS", "1"),
        ],
    )
    .await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let addr = gateway.base_url.trim_start_matches("http://").to_owned();
    let authenticated_request =
        format!("GET /mcp HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n");
    let from = IpAddr::V4(Ipv4Addr::new(127, 0, 24, 10));
    let mut authenticated = connect_from(from, &addr).await.expect("connects");
    let first = exchange(&mut authenticated, &authenticated_request)
        .await
        .expect("an answer to an authenticated request");
    assert!(
        !first.starts_with("HTTP/1.1 401"),
        "the token is accepted: {first}"
    );

    // Opened after the authenticated one: once it is closed, both are past the age.
    let mut anonymous = connect_from(from, &addr).await.expect("connects");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut answered = 0;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "an anonymous connection sending /healthz again and again was never closed \
             ({answered} answers)"
        );
        match exchange(&mut anonymous, HEALTHZ).await {
            Some(_) => answered += 1,
            None => break,
        }
    }
    let again = exchange(&mut authenticated, &authenticated_request).await;
    assert!(
        again.is_some(),
        "a connection that carried an authenticated request is kept past the age"
    );
}
