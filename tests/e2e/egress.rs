//! Egress a tenant chooses (issue 29), the operator's side: `sandgate admin tenant egress` and
//! `sandgate admin tenant secret …`, the real binary against a database of its own (no gateway
//! needed: the commands work on Postgres alone).

use std::process::{Output, Stdio};

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
        input.write_all(stdin.as_bytes()).await.expect("stdin");
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
