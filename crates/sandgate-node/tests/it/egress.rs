//! The egress relay over the node RPC: a client in a sandbox on a remote node CONNECTs through
//! the agent's proxy, the node relays it on the call's own stream, and the gateway's handler
//! (here the test's, as the service's egress component would be) decides and dials it. And a
//! rogue node cannot get a connection served on a call that did not ask for egress.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use prost::Message;
use sandgate_node::proto;
use sandgate_node::{RemoteNode, RemoteSandbox, SandboxHandle};
use sandgate_sandbox::{
    CommandOptions, EgressEnd, EgressEnv, EgressHandler, EgressRefusal, EgressTally,
    EgressUpstream, ExecOptions,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{TestNode, profile, within};

/// The gateway's side in these tests: `shop.test:443` and `limited.test:443` (at most 20 000
/// bytes a connection) reach the test server, `sink.test:443` a server that never reads, every
/// other target is refused; every CONNECT asked and every connection's tally recorded.
#[derive(Default)]
struct TestEgress {
    server: Option<SocketAddr>,
    sink: Option<SocketAddr>,
    asked: Mutex<Vec<String>>,
    tallies: Arc<Mutex<Vec<(String, EgressTally)>>>,
}

const REFUSED: &str = "is not in this test's egress policy";

impl TestEgress {
    fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("asked").clone()
    }

    fn tallies(&self) -> Vec<(String, EgressTally)> {
        self.tallies.lock().expect("tallies").clone()
    }

    async fn open_checked(&self, authority: &str) -> Result<EgressUpstream, EgressRefusal> {
        self.asked.lock().expect("asked").push(authority.to_owned());
        let (server, byte_limit) = match authority {
            "shop.test:443" => (self.server, None),
            "limited.test:443" => (self.server, Some(20_000)),
            "sink.test:443" => (self.sink, None),
            _ => {
                return Err(EgressRefusal {
                    status: 403,
                    text: format!("{authority} {REFUSED}"),
                });
            }
        };
        let server = server.expect("a test server");
        let io = tokio::net::TcpStream::connect(server)
            .await
            .map_err(|err| EgressRefusal {
                status: 502,
                text: format!("the test server did not accept: {err}"),
            })?;
        let tallies = self.tallies.clone();
        let authority = authority.to_owned();
        Ok(EgressUpstream {
            io: Box::new(io),
            byte_limit,
            budget: None,
            on_close: Box::new(move |tally| {
                tallies.lock().expect("tallies").push((authority, tally));
            }),
        })
    }
}

impl EgressHandler for TestEgress {
    fn open<'a>(
        &'a self,
        authority: &'a str,
    ) -> BoxFuture<'a, Result<EgressUpstream, EgressRefusal>> {
        Box::pin(self.open_checked(authority))
    }
}

/// An HTTP/1.1 server on loopback: `GET /hello` answers a line naming the request, `GET /big`
/// 1 MiB, `POST /count` how many body bytes it read.
async fn test_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = vec![0u8; 65536];
                let end = loop {
                    if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                };
                let text = String::from_utf8_lossy(&head[..end]).into_owned();
                let line = text.lines().next().unwrap_or("").to_owned();
                let length: usize = text
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap_or(0))
                    })
                    .unwrap_or(0);
                let mut read = head.len() - end;
                while read < length {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read += n,
                    }
                }
                let body = if line.starts_with("GET /big") {
                    "x".repeat(1 << 20)
                } else if line.starts_with("POST /count") {
                    format!("read {read} bytes")
                } else {
                    format!("hello from the test server: {line}")
                };
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(answer.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    addr
}

/// A server on loopback that accepts connections and never reads from them (they stay open
/// until the test ends).
async fn sink_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    addr
}

/// Python: `fetch(host, path, body=None)` through the proxy HTTPS_PROXY names (a CONNECT
/// tunnel, then plain HTTP in it): `BODY <length> <first 60 bytes>` or `ERROR <why>`.
const FETCH: &str = r"import http.client, os, urllib.parse, concurrent.futures
proxy = urllib.parse.urlsplit(os.environ.get('HTTPS_PROXY') or 'http://127.0.0.1:3128')
def fetch(host, path, body=None):
    conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=60)
    conn.set_tunnel(host, 443)
    try:
        conn.request('POST' if body else 'GET', path, body=body)
        data = conn.getresponse().read()
        return f'BODY {len(data)} {data[:60].decode()}'
    except Exception as err:
        return f'ERROR {err}'
    finally:
        conn.close()
";

fn exec_options() -> ExecOptions {
    ExecOptions {
        timeout: Duration::from_secs(120),
        ..ExecOptions::default()
    }
}

async fn cell(sandbox: &SandboxHandle, code: &str) -> String {
    let outcome = within(
        Duration::from_secs(180),
        "a cell",
        sandbox.exec(&format!("{FETCH}{code}"), exec_options(), None),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell ran: {outcome:?}");
    outcome.stdout.trim().to_owned()
}

#[tokio::test]
async fn a_sandbox_on_a_remote_node_reaches_a_server_through_the_gateways_egress_and_nothing_else()
{
    let node = TestNode::start("egress-relay").await;
    let remote = within(
        Duration::from_secs(180),
        "a sandbox launch",
        node.client().launch(&profile()),
    )
    .await
    .expect("the node starts a sandbox");
    let sandbox = SandboxHandle::Remote(remote.clone());
    let handler = Arc::new(TestEgress {
        server: Some(test_server().await),
        ..TestEgress::default()
    });

    // The variables, through the node: the proxy and a placeholder.
    let env = EgressEnv {
        proxy: true,
        ca_pem: None,
        placeholders: BTreeMap::from([("SHOP_TOKEN".to_owned(), "sgp_placeholder".to_owned())]),
    };
    let info = sandbox
        .set_egress_env(&env)
        .await
        .expect("the node passes egress_env on");
    assert!(info.proxy, "the proxy is on: {info:?}");
    assert_eq!(info.placeholders, ["SHOP_TOKEN"]);
    let seen = cell(
        &sandbox,
        "print(os.environ.get('HTTPS_PROXY'), os.environ.get('SHOP_TOKEN'))",
    )
    .await;
    assert_eq!(seen, "http://127.0.0.1:3128 sgp_placeholder");

    // Through the relay: a small answer, a large one, a large upload, a refusal naming the
    // rule, and a connection past its byte limit ended by the gateway's side.
    let code = "print(fetch('shop.test', '/hello'))\n\
                print(fetch('shop.test', '/big'))\n\
                print(fetch('shop.test', '/count', b'u' * 300000))\n\
                print(fetch('other.test', '/hello'))\n\
                print(fetch('limited.test', '/big'))\n";
    let out = sandbox
        .with_egress(handler.clone(), cell(&sandbox, code))
        .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "one line per fetch: {out}");
    assert!(
        lines[0].starts_with("BODY ")
            && lines[0].ends_with("hello from the test server: GET /hello HTTP/1.1"),
        "the allowed host answers through the node and the gateway: {}",
        lines[0]
    );
    assert!(
        lines[1].starts_with(&format!("BODY {} xxx", 1 << 20)),
        "1 MiB comes back whole: {}",
        lines[1]
    );
    assert!(
        lines[2].starts_with("BODY ") && lines[2].ends_with("read 300000 bytes"),
        "300 kB go up whole: {}",
        lines[2]
    );
    assert!(
        lines[3].starts_with("ERROR Tunnel connection failed: 403")
            && lines[3].contains(&format!("other.test:443 {REFUSED}")),
        "the gateway's refusal reaches the client: {}",
        lines[3]
    );
    assert!(
        lines[4].starts_with("ERROR"),
        "past its byte limit the connection ends: {}",
        lines[4]
    );
    assert_eq!(
        handler.asked(),
        [
            "shop.test:443",
            "shop.test:443",
            "shop.test:443",
            "other.test:443",
            "limited.test:443"
        ],
        "every CONNECT reached the gateway's handler once, in order"
    );

    // Many at once on one call's stream; and a command gets the relay too.
    let many = sandbox
        .with_egress(
            handler.clone(),
            cell(
                &sandbox,
                "with concurrent.futures.ThreadPoolExecutor(24) as pool:\n    \
                 got = list(pool.map(lambda i: fetch('shop.test', f'/hello?{i}'), range(48)))\n\
                 print(sum(g.startswith('BODY ') for g in got), [g for g in got if not g.startswith('BODY ')][:3])\n",
            ),
        )
        .await;
    assert_eq!(many, "48 []", "48 connections, 24 at once, all answered");
    let command = format!(
        "python3 -c \"{}\nprint(fetch('shop.test', '/from-a-command'))\"",
        FETCH.replace('"', "\\\"")
    );
    let options = CommandOptions {
        timeout: Duration::from_secs(120),
        ..CommandOptions::default()
    };
    let outcome = sandbox
        .with_egress(handler.clone(), sandbox.command(&command, options, None))
        .await
        .expect("the command runs");
    assert!(
        outcome
            .stdout
            .contains("hello from the test server: GET /from-a-command"),
        "a command reaches the server: {outcome:?}"
    );

    // Each admitted connection's tally reached the gateway's side: bytes each way, how it
    // ended.
    let tallies = within(Duration::from_secs(30), "every tally", async {
        loop {
            let tallies = handler.tallies();
            // The first cell's four admitted connections, the 48, the command's one.
            let admitted = 4 + 48 + 1;
            if tallies.len() >= admitted {
                return tallies;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let big = tallies
        .iter()
        .find(|(a, t)| a == "shop.test:443" && t.received > 1 << 20)
        .expect("the 1 MiB answer's tally");
    assert!(
        big.1.sent > 0 && big.1.end != EgressEnd::ByteLimit,
        "{big:?}"
    );
    assert!(
        tallies
            .iter()
            .any(|(a, t)| a == "shop.test:443" && t.sent >= 300_000),
        "the upload's bytes are counted: {tallies:?}"
    );
    let limited = tallies
        .iter()
        .find(|(a, _)| a == "limited.test:443")
        .expect("the limited connection's tally");
    assert_eq!(limited.1.end, EgressEnd::ByteLimit, "{limited:?}");
    assert!(
        limited.1.received < 1 << 20,
        "it carried less than the answer: {limited:?}"
    );

    // A call that did not ask for egress relays nothing: the handler is not asked.
    let before = handler.asked().len();
    let out = cell(&sandbox, "print(fetch('shop.test', '/hello'))").await;
    assert!(
        out.starts_with("ERROR Tunnel connection failed"),
        "outside a relaying call the proxy refuses: {out}"
    );
    assert_eq!(handler.asked().len(), before, "the handler was not asked");

    // Off again: the variables are gone.
    let off = sandbox
        .set_egress_env(&EgressEnv::default())
        .await
        .expect("the node passes egress_env on");
    assert!(!off.proxy, "{off:?}");
    let seen = cell(
        &sandbox,
        "print(sorted(k for k in os.environ if 'proxy' in k.lower() or k == 'SHOP_TOKEN'))",
    )
    .await;
    assert_eq!(seen, "[]");

    node.cleanup().await;
}

#[tokio::test]
async fn a_connection_whose_server_never_reads_stalls_only_itself() {
    let node = TestNode::start("egress-stall").await;
    let remote = within(
        Duration::from_secs(180),
        "a sandbox launch",
        node.client().launch(&profile()),
    )
    .await
    .expect("the node starts a sandbox");
    let sandbox = SandboxHandle::Remote(remote);
    let handler = Arc::new(TestEgress {
        server: Some(test_server().await),
        sink: Some(sink_server().await),
        ..TestEgress::default()
    });
    let env = EgressEnv {
        proxy: true,
        ..EgressEnv::default()
    };
    sandbox.set_egress_env(&env).await.expect("egress_env");
    // A thread pushes 64 MiB at a server that never reads: far more than every buffer and
    // window on the way holds, so that connection stalls. Meanwhile another connection of the
    // same call fetches twice, output keeps coming, and the cell's outcome comes back while
    // the stalled upload still waits.
    let code = r"import socket, threading, time, sys
stuck = {'sent': 0, 'error': None}
def push():
    s = socket.create_connection(('127.0.0.1', 3128), timeout=120)
    s.sendall(b'CONNECT sink.test:443 HTTP/1.1\r\nHost: sink.test:443\r\n\r\n')
    head = s.recv(4096)
    if b' 200 ' not in head.split(b'\r\n')[0]:
        stuck['error'] = head
        return
    chunk = b'z' * (1 << 20)
    try:
        for _ in range(64):
            s.sendall(chunk)
            stuck['sent'] += 1
    except OSError as err:
        stuck['error'] = err
threading.Thread(target=push, daemon=True).start()
time.sleep(0)
while stuck['sent'] < 2 and stuck['error'] is None:
    time.sleep(0.05)
print('pushing', flush=True)
print(fetch('shop.test', '/hello'), flush=True)
print(fetch('shop.test', '/big'), flush=True)
print('stuck after', stuck['sent'], 'MiB', stuck['error'])
";
    let outcome = within(
        Duration::from_secs(170),
        "the cell beside a stalled connection",
        sandbox.with_egress(
            handler.clone(),
            sandbox.exec(&format!("{FETCH}{code}"), exec_options(), None),
        ),
    )
    .await
    .expect("the cell's outcome comes back");
    let out = outcome.stdout.trim().to_owned();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{outcome:?}");
    assert!(
        lines[1].ends_with("hello from the test server: GET /hello HTTP/1.1"),
        "another connection of the call is answered while one stalls: {out}"
    );
    assert!(
        lines[2].starts_with(&format!("BODY {} ", 1 << 20)),
        "and a large answer flows: {out}"
    );
    let sent: u64 = lines[3]
        .strip_prefix("stuck after ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(
        sent < 64 && lines[3].ends_with("MiB None"),
        "the upload to the server that never reads is still stalled, not failed: {out}"
    );
    assert!(
        handler.asked().contains(&"sink.test:443".to_owned()),
        "{:?}",
        handler.asked()
    );
    node.cleanup().await;
}

/// A gRPC message frame: not compressed, its length, its bytes.
fn grpc_frame(message: &impl Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + body.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(body.len()).expect("a small message"));
    frame.put_slice(&body);
    frame.freeze()
}

/// What the rogue node saw of one `Exec` call.
#[derive(Debug, Default, Clone)]
struct RogueSaw {
    /// Whether the request asked for egress.
    egress_asked: bool,
    /// The egress messages the gateway sent it.
    egress_in: Vec<proto::EgressIn>,
}

/// What the rogue node does on an `Exec` call.
#[derive(Debug, Clone)]
enum Rogue {
    /// A CONNECT of its own to this target, with bytes, before the outcome, which it sends once
    /// the gateway's side of the stream said something more or ended.
    Connect(&'static str),
    /// A CONNECT to this target; once admitted, one data message far past the flow control's
    /// bounds; then it reads the gateway's side until that connection is closed.
    Flood(&'static str),
}

/// A rogue node: answers `Adopt` for any container, and every `Exec` as `script` says. Records
/// what each call asked and got.
async fn rogue_node(saw: Arc<Mutex<Vec<RogueSaw>>>, script: Arc<Mutex<Rogue>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let saw = saw.clone();
            let script = script.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((request, respond))) = conn.accept().await {
                    let script = script.lock().expect("script").clone();
                    tokio::spawn(rogue_call(request, respond, saw.clone(), script));
                }
            });
        }
    });
    addr
}

async fn rogue_call(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    saw: Arc<Mutex<Vec<RogueSaw>>>,
    script: Rogue,
) {
    let path = request.uri().path().to_owned();
    let mut body = request.into_body();
    let mut inputs = BytesMut::new();
    let mut next_message = async || -> Option<Bytes> {
        loop {
            if inputs.len() >= 5 {
                let len = u32::from_be_bytes(inputs[1..5].try_into().expect("4 bytes")) as usize;
                if inputs.len() >= 5 + len {
                    inputs.advance(5);
                    return Some(inputs.split_to(len).freeze());
                }
            }
            let chunk = body.data().await?.ok()?;
            let _ = body.flow_control().release_capacity(chunk.len());
            inputs.extend_from_slice(&chunk);
        }
    };
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .expect("a response head");
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let mut replies = Vec::new();
    if path.ends_with("/Adopt") {
        let adopt = next_message()
            .await
            .and_then(|m| proto::AdoptRequest::decode(m).ok())
            .unwrap_or_default();
        replies.push(grpc_frame(&proto::SandboxRef {
            sandbox_id: "sbx_rogue".into(),
            container_id: adopt.container_id,
            profile: "default".into(),
        }));
    } else if path.ends_with("/Exec") {
        let start = next_message()
            .await
            .and_then(|m| proto::ExecInput::decode(m).ok());
        let mut seen = RogueSaw {
            egress_asked: matches!(
                start.and_then(|s| s.input),
                Some(proto::exec_input::Input::Start(r)) if r.egress
            ),
            ..RogueSaw::default()
        };
        let egress_event = |what| {
            grpc_frame(&proto::ExecEvent {
                event: Some(proto::exec_event::Event::Egress(proto::EgressOut {
                    cid: 7,
                    what: Some(what),
                })),
            })
        };
        let mut next_egress = async || -> Option<proto::EgressIn> {
            match proto::ExecInput::decode(next_message().await?) {
                Ok(proto::ExecInput {
                    input: Some(proto::exec_input::Input::Egress(e)),
                }) => Some(e),
                _ => None,
            }
        };
        match script {
            Rogue::Connect(target) => {
                let open = proto::egress_out::What::Open(target.into());
                let data =
                    proto::egress_out::What::Data(Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n"));
                let _ = send.send_data(egress_event(open), false);
                let _ = send.send_data(egress_event(data), false);
                // The gateway's side says something more (its answer to the CONNECT), or ends
                // (it relays nothing for this call).
                if let Some(e) = next_egress().await {
                    seen.egress_in.push(e);
                }
            }
            Rogue::Flood(target) => {
                let open = proto::egress_out::What::Open(target.into());
                let _ = send.send_data(egress_event(open), false);
                if let Some(e) = next_egress().await {
                    seen.egress_in.push(e);
                }
                let flood = proto::egress_out::What::Data(Bytes::from(vec![b'f'; 600 << 10]));
                let _ = send.send_data(egress_event(flood), false);
                let closed = tokio::time::timeout(Duration::from_secs(60), async {
                    while let Some(e) = next_egress().await {
                        let close = matches!(e.what, Some(proto::egress_in::What::Close(_)));
                        seen.egress_in.push(e);
                        if close {
                            break;
                        }
                    }
                });
                let _ = closed.await;
            }
        }
        saw.lock().expect("saw").push(seen);
        replies.push(grpc_frame(&proto::ExecEvent {
            event: Some(proto::exec_event::Event::Outcome(proto::ExecOutcome {
                stdout: "done".into(),
                ..proto::ExecOutcome::default()
            })),
        }));
    }
    for reply in replies {
        let _ = send.send_data(reply, false);
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = send.send_trailers(trailers);
}

#[tokio::test]
async fn a_rogue_node_gets_no_connection_without_egress_nor_past_the_flow_control() {
    let saw = Arc::new(Mutex::new(Vec::new()));
    let script = Arc::new(Mutex::new(Rogue::Connect("evil.test:443")));
    let addr = rogue_node(saw.clone(), script.clone()).await;
    let node = RemoteNode::connect_lazy_cleartext(&format!("http://{addr}"))
        .expect("a cleartext client of loopback");
    let sandbox: RemoteSandbox = within(
        Duration::from_secs(30),
        "adopt",
        node.adopt("rogue-container"),
    )
    .await
    .expect("the rogue node adopts");
    let handler = Arc::new(TestEgress {
        server: Some(test_server().await),
        ..TestEgress::default()
    });
    let run = || async {
        within(
            Duration::from_secs(30),
            "a call to the rogue node",
            sandbox.exec("print(1)", exec_options(), None),
        )
        .await
        .expect("the call ends with the rogue node's outcome")
    };

    // A call made outside any egress relay.
    assert_eq!(run().await.stdout, "done");
    // A call made under the relay of another sandbox.
    let other = node.adopt("another-container").await.expect("adopted");
    let outcome = other.with_egress(handler.clone(), run()).await;
    assert_eq!(outcome.stdout, "done");
    assert!(
        handler.asked().is_empty(),
        "the rogue node's CONNECT on calls without egress reached the handler: {:?}",
        handler.asked()
    );
    let calls = saw.lock().expect("saw").clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    for call in &calls {
        assert!(!call.egress_asked, "no egress was asked: {call:?}");
        assert!(call.egress_in.is_empty(), "nothing was answered: {call:?}");
    }

    // The same node on a call that asked for egress: its CONNECT is decided by the handler
    // (here refused), so the two calls above would have shown one.
    let outcome = sandbox.with_egress(handler.clone(), run()).await;
    assert_eq!(outcome.stdout, "done");
    assert_eq!(handler.asked(), ["evil.test:443"]);
    let last = saw
        .lock()
        .expect("saw")
        .last()
        .cloned()
        .expect("a third call");
    assert!(last.egress_asked, "{last:?}");
    assert!(
        matches!(
            last.egress_in.first().and_then(|e| e.what.as_ref()),
            Some(proto::egress_in::What::Refused(r)) if r.status == 403 && r.text.contains(REFUSED)
        ),
        "the handler's refusal went back to the node: {last:?}"
    );

    // A node that floods an admitted connection with one message past the flow control's
    // bounds: the gateway ends that connection (and tells the node) without writing the bytes,
    // and the call ends as usual.
    *script.lock().expect("script") = Rogue::Flood("shop.test:443");
    let outcome = sandbox.with_egress(handler.clone(), run()).await;
    assert_eq!(outcome.stdout, "done");
    let last = saw
        .lock()
        .expect("saw")
        .last()
        .cloned()
        .expect("a fourth call");
    let said: Vec<_> = last.egress_in.iter().map(|e| e.what.clone()).collect();
    assert!(
        matches!(
            said.as_slice(),
            [
                Some(proto::egress_in::What::Accepted(_)),
                ..,
                Some(proto::egress_in::What::Close(_))
            ]
        ),
        "admitted, then closed over the flood: {said:?}"
    );
    let tallies = within(
        Duration::from_secs(30),
        "the flooded connection's tally",
        async {
            loop {
                let tallies = handler.tallies();
                if !tallies.is_empty() {
                    return tallies;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    assert_eq!(tallies.len(), 1, "{tallies:?}");
    assert_eq!(
        (tallies[0].1.sent, tallies[0].1.end),
        (0, EgressEnd::ClientGone),
        "none of the flood reached the server: {tallies:?}"
    );
}
