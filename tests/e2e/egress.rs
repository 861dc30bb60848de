//! Egress a tenant chooses (issue 29): the operator's side (`sandgate admin tenant egress` and
//! `sandgate admin tenant secret …`, the real binary against a database of its own, no gateway
//! needed) and the plain relay end to end (a cell's CONNECT through the agent's proxy, relayed
//! to the gateway, which reaches a test server on loopback under a test name).

use std::process::{Output, Stdio};
use std::time::Duration;

use sandgate_service::egress::{DEVELOPMENT_SECRETS_KEY, SecretSealer};
use sqlx::Connection;
use tokio::io::AsyncWriteExt;

use crate::support;

/// The CLI of one deployment: its database and environment, every command at `RUST_LOG=debug`
/// so its logs can be searched for what must never be in them.
struct Cli {
    env: Vec<(String, String)>,
    /// Everything every command wrote to standard error (its logs).
    logs: String,
}

impl Cli {
    fn new(database_url: &str, extra: &[(&str, &str)]) -> Cli {
        let mut env = vec![
            ("SANDGATE_DATABASE__URL".to_owned(), database_url.to_owned()),
            ("SANDGATE_LOG__FORMAT".to_owned(), "json".to_owned()),
            ("RUST_LOG".to_owned(), "debug".to_owned()),
        ];
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        Cli {
            env,
            logs: String::new(),
        }
    }

    /// Runs `sandgate <args>` with `stdin` as its standard input.
    async fn run(&mut self, args: &[&str], stdin: &str) -> Output {
        let mut child = support::sandgate_command()
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sandgate binary runs");
        let mut input = child.stdin.take().expect("stdin is piped");
        // A command refused before it reads its input (a bad setting) may have exited already.
        match input.write_all(stdin.as_bytes()).await {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(err) => panic!("writing the command's standard input: {err}"),
        }
        drop(input);
        let output = child.wait_with_output().await.expect("it finishes");
        self.logs.push_str(&String::from_utf8_lossy(&output.stderr));
        output
    }

    /// Runs a command that must succeed; its standard output, trimmed.
    async fn ok(&mut self, args: &[&str], stdin: &str) -> String {
        let output = self.run(args, stdin).await;
        assert!(
            output.status.success(),
            "sandgate {args:?} should succeed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Runs a command that must fail; its error (the `sandgate: …` line of its standard error,
    /// else all of it).
    async fn fails(&mut self, args: &[&str], stdin: &str) -> String {
        let output = self.run(args, stdin).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "sandgate {args:?} should fail");
        stderr
            .lines()
            .find(|l| l.starts_with("sandgate: "))
            .unwrap_or(&stderr)
            .to_owned()
    }
}

/// `args` as the `&str`s the CLI helper takes.
fn argv(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A value no other test or row holds.
fn unique_value(what: &str) -> String {
    format!("{what}_{}", uuid::Uuid::new_v4().simple())
}

async fn sealed_row(database_url: &str, tenant: &str, name: &str) -> Option<(i32, Vec<u8>)> {
    let mut conn = sqlx::PgConnection::connect(database_url)
        .await
        .expect("the test database");
    sqlx::query_as(
        "SELECT version, sealed FROM tenant_secrets WHERE tenant_id = $1::uuid AND name = $2",
    )
    .bind(tenant)
    .bind(name)
    .fetch_optional(&mut conn)
    .await
    .expect("the secrets table")
}

#[tokio::test]
async fn a_secret_is_stored_sealed_listed_without_its_value_and_never_logged() {
    let database = support::fresh_database().await;
    let mut cli = Cli::new(&database, &[]);
    let acme = cli
        .ok(&["admin", "tenant", "create", "egress-acme"], "")
        .await;
    let other = cli
        .ok(&["admin", "tenant", "create", "egress-other"], "")
        .await;
    let value = unique_value("shpat");

    // Set: the value comes from standard input; while the command holds it, its argv and
    // environment do not.
    let mut child = support::sandgate_command()
        .args(["admin", "tenant", "secret", "set", &acme, "SHOP_TOKEN"])
        .args(["--host", "api.shop.test", "--host", "*.cdn.shop.test"])
        .args(["--header", "Authorization"])
        .envs(cli.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut input = child.stdin.take().expect("stdin is piped");
    input
        .write_all(format!("{value}\n").as_bytes())
        .await
        .expect("stdin");
    let pid = child.id().expect("it runs until its stdin closes");
    for what in ["cmdline", "environ"] {
        let seen = std::fs::read(format!("/proc/{pid}/{what}")).expect("/proc of the child");
        assert!(
            !String::from_utf8_lossy(&seen).contains(&value),
            "the value is not in the process's {what}"
        );
    }
    drop(input);
    let output = child.wait_with_output().await.expect("it finishes");
    cli.logs.push_str(&String::from_utf8_lossy(&output.stderr));
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "set succeeds: {}", cli.logs);
    assert!(
        said.contains("SHOP_TOKEN") && said.contains("version 1") && !said.contains(&value),
        "set names the secret and its version, not the value: {said}"
    );

    // A value on the command line is refused: there is no argument for it.
    let err = cli
        .fails(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &acme,
                "OTHER",
                "a-value-in-argv",
                "--host",
                "api.shop.test",
                "--header",
                "x-api-key",
            ],
            "",
        )
        .await;
    assert!(err.contains("unexpected argument"), "{err}");
    assert!(sealed_row(&database, &acme, "OTHER").await.is_none());

    // Stored sealed: not the plaintext; opens only for its tenant, name and version.
    let (version, sealed) = sealed_row(&database, &acme, "SHOP_TOKEN")
        .await
        .expect("a row");
    assert_eq!(version, 1);
    assert!(
        !sealed.windows(value.len()).any(|w| w == value.as_bytes()),
        "the stored form is not the value"
    );
    let sealer = SecretSealer::new(DEVELOPMENT_SECRETS_KEY.as_bytes());
    let acme_id: uuid::Uuid = acme.parse().expect("a tenant id");
    let other_id: uuid::Uuid = other.parse().expect("a tenant id");
    let opened = sealer
        .open(acme_id, "SHOP_TOKEN", 1, &sealed)
        .expect("it opens for its tenant, name and version");
    assert_eq!(opened.as_slice(), value.as_bytes());
    assert!(
        sealer.open(other_id, "SHOP_TOKEN", 1, &sealed).is_err(),
        "not under another tenant"
    );
    assert!(
        sealer.open(acme_id, "OTHER_TOKEN", 1, &sealed).is_err(),
        "not under another name"
    );

    // Listed by name, hosts, headers, version and dates, never the value; another tenant's list
    // is its own.
    let listed = cli
        .ok(&["admin", "tenant", "secret", "list", &acme], "")
        .await;
    assert!(
        listed.contains("SHOP_TOKEN")
            && listed.contains("api.shop.test,*.cdn.shop.test")
            && listed.contains("authorization")
            && !listed.contains(&value),
        "the list shows the secret without its value: {listed}"
    );
    let theirs = cli
        .ok(&["admin", "tenant", "secret", "list", &other], "")
        .await;
    assert!(!theirs.contains("SHOP_TOKEN"), "{theirs}");

    // Rotated: a new value from standard input, the version raised, the bindings kept; the old
    // sealed value does not open as the new version.
    let rotated_value = unique_value("shpat_rotated");
    let rotated = cli
        .ok(
            &["admin", "tenant", "secret", "rotate", &acme, "SHOP_TOKEN"],
            &rotated_value,
        )
        .await;
    assert!(rotated.contains("version 2"), "{rotated}");
    let (version, resealed) = sealed_row(&database, &acme, "SHOP_TOKEN")
        .await
        .expect("a row");
    assert_eq!(version, 2);
    assert_eq!(
        sealer
            .open(acme_id, "SHOP_TOKEN", 2, &resealed)
            .expect("the new value opens")
            .as_slice(),
        rotated_value.as_bytes()
    );
    assert!(
        sealer.open(acme_id, "SHOP_TOKEN", 2, &sealed).is_err(),
        "the old sealed value is not the current one"
    );
    let listed = cli
        .ok(&["admin", "tenant", "secret", "list", &acme], "")
        .await;
    assert!(
        listed.contains("api.shop.test,*.cdn.shop.test") && !listed.contains(&rotated_value),
        "{listed}"
    );

    // Another tenant cannot rotate or delete it by naming it.
    let refused = cli
        .fails(
            &["admin", "tenant", "secret", "delete", &other, "SHOP_TOKEN"],
            "",
        )
        .await;
    assert!(
        refused.contains("has no secret named SHOP_TOKEN"),
        "{refused}"
    );
    assert!(sealed_row(&database, &acme, "SHOP_TOKEN").await.is_some());

    cli.ok(
        &["admin", "tenant", "secret", "delete", &acme, "SHOP_TOKEN"],
        "",
    )
    .await;
    assert!(sealed_row(&database, &acme, "SHOP_TOKEN").await.is_none());

    // Every change is in the audit trail, without a value.
    let trail = cli.ok(&["admin", "audit", "--tenant", &acme], "").await;
    for action in [
        "admin_tenant_secret_set",
        "admin_tenant_secret_rotate",
        "admin_tenant_secret_delete",
    ] {
        assert!(
            trail
                .lines()
                .any(|l| l.contains(action) && l.contains("SHOP_TOKEN")),
            "{action} is audited: {trail}"
        );
    }
    assert!(
        !trail.contains(&value) && !trail.contains(&rotated_value),
        "{trail}"
    );
    let theirs = cli.ok(&["admin", "audit", "--tenant", &other], "").await;
    assert!(!theirs.contains("SHOP_TOKEN"), "{theirs}");

    // Nothing any command logged at debug level holds a value.
    assert!(
        cli.logs.contains("\"level\":\"DEBUG\""),
        "the commands logged at debug level"
    );
    assert!(
        !cli.logs.contains(&value) && !cli.logs.contains(&rotated_value),
        "a secret value was logged"
    );
}

#[tokio::test]
async fn an_egress_policy_takes_names_and_refuses_addresses_with_clear_errors() {
    let database = support::fresh_database().await;
    let mut cli = Cli::new(&database, &[]);
    let acme = cli
        .ok(&["admin", "tenant", "create", "egress-policy"], "")
        .await;
    let egress = |extra: &[&str]| {
        let mut args = vec!["admin", "tenant", "egress", acme.as_str()];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };

    let shown = cli.ok(&argv(&egress(&["--show"])), "").await;
    assert!(shown.contains("no route out"), "off by default: {shown}");

    let set = cli
        .ok(
            &argv(&egress(&[
                "--allow",
                "API.Shop.test",
                "--allow",
                "*.cdn.shop.test:8443",
                "--connections-per-minute",
                "30",
                "--bytes-per-day",
                "1000000",
            ])),
            "",
        )
        .await;
    for expected in [
        "api.shop.test",
        "443",
        "*.cdn.shop.test",
        "8443",
        "30",
        "1000000",
    ] {
        assert!(set.contains(expected), "{expected} in {set}");
    }

    // Every address form is refused, and nothing of the command is stored.
    for literal in [
        "127.0.0.1",
        "2130706433",
        "0x7f.1",
        "0177.0.0.1",
        "127.1",
        "[::ffff:127.0.0.1]",
        "169.254.169.254:80",
        "localhost",
    ] {
        let err = cli
            .fails(
                &argv(&egress(&["--allow", "ok.shop.test", "--allow", literal])),
                "",
            )
            .await;
        assert!(err.contains("is not an allowed host"), "{literal}: {err}");
    }
    let err = cli
        .fails(&argv(&egress(&["--allow", "shop.test:0"])), "")
        .await;
    assert!(err.contains("is not a port"), "{err}");
    let shown = cli.ok(&argv(&egress(&[])), "").await;
    assert!(
        !shown.contains("ok.shop.test"),
        "a refused command stores nothing: {shown}"
    );

    // Clear errors: an unknown tenant, a bad name, a bad host, a header that frames requests.
    let nobody = uuid::Uuid::new_v4().to_string();
    let err = cli
        .fails(
            &["admin", "tenant", "egress", &nobody, "--allow", "a.test"],
            "",
        )
        .await;
    assert!(
        err.contains(&format!("no tenant with id {nobody}")),
        "{err}"
    );
    let set_secret = |tenant: &str, name: &str, host: &str, header: &str| {
        [
            "admin", "tenant", "secret", "set", tenant, name, "--host", host, "--header", header,
        ]
        .map(str::to_owned)
    };
    for (args, expected) in [
        (
            set_secret(&nobody, "TOKEN", "api.shop.test", "authorization"),
            "no tenant with id",
        ),
        (
            set_secret(&acme, "shop-token", "api.shop.test", "authorization"),
            "is not a secret name",
        ),
        (
            set_secret(&acme, "TOKEN", "10.0.0.1", "authorization"),
            "is not an allowed host",
        ),
        (
            set_secret(&acme, "TOKEN", "api.shop.test", "host"),
            "cannot carry a secret",
        ),
    ] {
        let err = cli.fails(&argv(&args), "a-value\n").await;
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    let err = cli
        .fails(
            &argv(&set_secret(
                &acme,
                "TOKEN",
                "api.shop.test",
                "authorization",
            )),
            "two\nlines\n",
        )
        .await;
    assert!(err.contains("the secret's value"), "{err}");

    // Taking a rule out, then every rule: no route out again; each change audited.
    let shown = cli
        .ok(&argv(&egress(&["--remove", "api.shop.test"])), "")
        .await;
    assert!(
        !shown.contains("api.shop.test ") && shown.contains("*.cdn.shop.test"),
        "{shown}"
    );
    let shown = cli.ok(&argv(&egress(&["--deny-all"])), "").await;
    assert!(shown.contains("no route out"), "{shown}");
    let trail = cli.ok(&["admin", "audit", "--tenant", &acme], "").await;
    for change in [
        "allow api.shop.test:443",
        "allow *.cdn.shop.test:8443",
        "remove api.shop.test:443",
        "deny all",
    ] {
        assert!(
            trail
                .lines()
                .any(|l| l.contains("admin_tenant_egress") && l.contains(change)),
            "{change} is audited: {trail}"
        );
    }
    assert_eq!(
        trail
            .lines()
            .filter(|l| l.contains("admin_tenant_egress"))
            .count(),
        3,
        "one event per change, none for a refused command or a --show: {trail}"
    );
}

#[tokio::test]
async fn off_loopback_secrets_need_a_key_of_their_own() {
    let database = support::fresh_database().await;
    let public = [
        ("SANDGATE_PUBLIC_URL", "https://sandgate.example"),
        (
            "SANDGATE_KEYS__SECRET",
            "a keys secret of the egress test, 32+ chars",
        ),
    ];
    let mut cli = Cli::new(&database, &public);
    let acme = cli
        .ok(&["admin", "tenant", "create", "egress-public"], "")
        .await;
    let set = [
        "admin",
        "tenant",
        "secret",
        "set",
        &acme,
        "SHOP_TOKEN",
        "--host",
        "api.shop.test",
        "--header",
        "authorization",
    ];
    // No key: the development key is not used off loopback; the refusal names the setting.
    let err = cli.fails(&set, "value\n").await;
    assert!(
        err.contains("egress.secrets_key") && err.contains("SANDGATE_EGRESS__SECRETS_KEY"),
        "{err}"
    );
    assert!(sealed_row(&database, &acme, "SHOP_TOKEN").await.is_none());
    // The development key written out is refused at start.
    let mut dev = Cli::new(
        &database,
        &[
            public[0],
            public[1],
            ("SANDGATE_EGRESS__SECRETS_KEY", DEVELOPMENT_SECRETS_KEY),
        ],
    );
    let err = dev.fails(&set, "value\n").await;
    assert!(err.contains("egress.secrets_key"), "{err}");
    // A key of its own: the value is sealed under it, not under the development key.
    let key = "an egress secrets key of this test, 32+ characters";
    let mut keyed = Cli::new(
        &database,
        &[public[0], public[1], ("SANDGATE_EGRESS__SECRETS_KEY", key)],
    );
    keyed.ok(&set, "value\n").await;
    let (version, sealed) = sealed_row(&database, &acme, "SHOP_TOKEN")
        .await
        .expect("stored");
    let tenant: uuid::Uuid = acme.parse().expect("an id");
    assert!(
        SecretSealer::new(key.as_bytes())
            .open(tenant, "SHOP_TOKEN", version, &sealed)
            .is_ok()
    );
    assert!(
        SecretSealer::new(DEVELOPMENT_SECRETS_KEY.as_bytes())
            .open(tenant, "SHOP_TOKEN", version, &sealed)
            .is_err(),
        "not sealed under the development key"
    );
    assert!(
        SecretSealer::new(public[1].1.as_bytes())
            .open(tenant, "SHOP_TOKEN", version, &sealed)
            .is_err(),
        "nor under keys.secret"
    );
}

/// A TCP server on loopback that answers every connection with one HTTP response naming the
/// request line it read (a plain server reached through a CONNECT tunnel); counts connections.
async fn answering_server() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_owned();
                let body = format!("hello from the test server: {line}");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(answer.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (addr, count)
}

/// A cell that GETs `/hello` from `host:port` through the proxy HTTPS_PROXY names (a CONNECT
/// tunnel, then plain HTTP in it) and prints the body, or the error.
fn tunnel_cell(host: &str, port: u16) -> String {
    format!(
        "import http.client, os, urllib.parse\n\
         proxy = urllib.parse.urlsplit(os.environ.get('HTTPS_PROXY') or 'http://127.0.0.1:3128')\n\
         conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=60)\n\
         conn.set_tunnel('{host}', {port})\n\
         try:\n    conn.request('GET', '/hello')\n    print('BODY', conn.getresponse().read().decode())\n\
         except OSError as err:\n    print('ERROR', err)\n"
    )
}

#[tokio::test]
async fn a_cell_reaches_an_allowed_host_through_the_relay_and_nothing_else() {
    use crate::mcp_client::{Client, Era};
    use serde_json::json;

    let (server, connections) = answering_server().await;
    let port = server.port();
    let database = support::fresh_database().await;
    let hosts = format!("shop.sandgate.test={server},budget.sandgate.test={server}");
    let gateway =
        support::Gateway::start(&database, &[("SANDGATE_EGRESS__TEST_HOSTS", &hosts)]).await;
    let acme = gateway.create_tenant().await;
    let other = gateway.create_tenant().await;
    let allow = format!("shop.sandgate.test:{port}");
    gateway
        .cli(&["admin", "tenant", "egress", &acme, "--allow", &allow])
        .await;
    let budget = format!("budget.sandgate.test:{port}");
    gateway
        .cli(&[
            "admin",
            "tenant",
            "egress",
            &acme,
            "--allow",
            &budget,
            "--connections-per-minute",
            "1",
        ])
        .await;

    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&acme).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let sandbox = client
        .ok("create_sandbox", json!({"conversation_id": "egress-1"}))
        .await
        .structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = |code: String| {
        let client = &client;
        let sandbox = sandbox.clone();
        async move {
            let out = client
                .ok(
                    "execute_code",
                    json!({"sandbox_id": sandbox, "code": code, "timeout_seconds": 120}),
                )
                .await;
            out.structured["stdout"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .to_owned()
        }
    };

    // The proxy variables are there, for the kernel; loopback stays direct.
    let env = run("import os\nprint(os.environ.get('HTTPS_PROXY'), os.environ.get('http_proxy'), os.environ.get('NO_PROXY'))".into()).await;
    assert_eq!(
        env, "http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1,::1",
        "a tenant with a policy gets the proxy variables"
    );

    // The allowed name reaches the test server through the tunnel.
    let got = run(tunnel_cell("shop.sandgate.test", port)).await;
    assert_eq!(
        got, "BODY hello from the test server: GET /hello HTTP/1.1",
        "the allowed host answers through the relay"
    );
    // urllib through HTTPS_PROXY: a plain http:// URL is refused by the proxy with why.
    let plain = run(format!(
        "import urllib.request\ntry:\n    urllib.request.urlopen('http://shop.sandgate.test:{port}/', timeout=30)\nexcept Exception as err:\n    print('ERROR', err)\n"
    ))
    .await;
    assert!(
        plain.starts_with("ERROR HTTP Error 403") && plain.contains("HTTPS only"),
        "plain http is refused with a reason: {plain}"
    );

    // A terminal command gets the variables and the relay too.
    let command = client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": format!("python3 -c \"{}\"", tunnel_cell("shop.sandgate.test", port).replace('"', "\\\"")), "timeout_seconds": 120}),
        )
        .await;
    assert!(
        command.structured["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("BODY hello from the test server"),
        "a command reaches the allowed host too: {}",
        command.text
    );
    let reached = connections.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        reached, 2,
        "the test server saw the cell's and the command's connections"
    );

    // A host not on the list: refused before any lookup, naming what to allow.
    let denied = run(tunnel_cell("other.sandgate.test", port)).await;
    assert!(
        denied.starts_with("ERROR Tunnel connection failed: 403")
            && denied.contains(&format!("other.sandgate.test:{port} is not in this tenant's egress policy (refused before any DNS lookup)")),
        "a host off the list is refused with a clear error: {denied}"
    );
    // An address literal, even of the reachable test server.
    let literal = run(tunnel_cell("127.0.0.1", port)).await;
    assert!(
        literal.starts_with("ERROR Tunnel connection failed: 403")
            && literal.contains("is an address"),
        "an address literal is refused: {literal}"
    );
    // The per-minute budget of a rule: one connection, then 429 (three tries: a minute boundary
    // between two of them resets the count once at most).
    let mut refused = 0;
    for _ in 0..3 {
        let out = run(tunnel_cell("budget.sandgate.test", port)).await;
        if out.contains("429") && out.contains("connections per minute") {
            refused += 1;
        } else {
            assert!(out.starts_with("BODY "), "under budget it connects: {out}");
        }
    }
    assert!(
        refused >= 1,
        "the connections-per-minute budget refuses past it"
    );
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        reached + 3 - refused,
        "refused connections never reach the server"
    );

    // Another tenant, without a policy: no variables, and the proxy refuses a CONNECT itself.
    let theirs = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&other).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let their_sandbox = theirs
        .ok("create_sandbox", json!({"conversation_id": "egress-2"}))
        .await
        .structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let code = format!(
        "import os\nprint(sorted(k for k in os.environ if 'proxy' in k.lower()))\n{}",
        tunnel_cell("shop.sandgate.test", port)
    );
    let out = theirs
        .ok(
            "execute_code",
            json!({"sandbox_id": their_sandbox, "code": code, "timeout_seconds": 120}),
        )
        .await;
    let out = out.structured["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        out.starts_with("[]\nERROR Tunnel connection failed: 403")
            && out.contains("no egress policy"),
        "a tenant without policy gets nothing: {out}"
    );

    // Every connection is in the audit trail, with target, outcome and bytes; none in the
    // other tenant's.
    let trail = support::eventually(
        Duration::from_secs(30),
        "egress connections audited",
        || async {
            let trail = gateway.cli(&["admin", "audit", "--tenant", &acme]).await;
            (trail.matches("egress_connect").count() >= 7).then_some(trail)
        },
    )
    .await;
    // How it ended depends on who noticed first: both sides closing (`closed`) or the call
    // ending while the client's socket was still being closed (`relay_closed`, seen under gVisor).
    assert!(
        (trail.contains(&format!("shop.sandgate.test:{port} via {server} closed: "))
            || trail.contains(&format!(
                "shop.sandgate.test:{port} via {server} relay_closed: "
            )))
            && trail.contains("bytes sent"),
        "an open connection is audited with its bytes: {trail}"
    );
    assert!(
        trail.contains(&format!("other.sandgate.test:{port} refused: ")),
        "a refusal is audited: {trail}"
    );
    assert!(
        trail.contains(&format!("127.0.0.1:{port} refused: ")),
        "{trail}"
    );
    let their_trail = gateway.cli(&["admin", "audit", "--tenant", &other]).await;
    assert!(!their_trail.contains("egress_connect"), "{their_trail}");
}
