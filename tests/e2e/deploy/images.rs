//! The two images the build scripts make, from an attacker's and a careless operator's side:
//! the gateway/node image runs as a non-root user with nothing but the binary (no shell to land
//! in), and the Postgres image refuses to initialise a cluster from bad settings, trusts nobody
//! without a password, and runs as `postgres`.

use std::time::{Duration, Instant};

use super::{gateway_image, postgres_image, run};

const DEADLINE: Duration = Duration::from_secs(120);

async fn docker(args: &[&str]) -> std::process::Output {
    run("docker", args, DEADLINE).await
}

fn text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test]
async fn the_gateway_image_is_the_binary_as_a_non_root_user_and_nothing_else() {
    let image = gateway_image().await;
    let user = docker(&["image", "inspect", "-f", "{{.Config.User}}", &image]).await;
    assert_eq!(text(&user).trim(), "10001:10001", "the image's user");

    let version = docker(&["run", "--rm", &image, "--version"]).await;
    assert!(
        version.status.success() && text(&version).starts_with("sandgate "),
        "the entrypoint is sandgate: {}",
        text(&version)
    );
    // Someone who gets code running in the container finds no shell and no package manager.
    for tool in [
        "/bin/sh",
        "/bin/bash",
        "/usr/bin/apt-get",
        "/usr/bin/dpkg",
        "/usr/bin/perl",
    ] {
        let attempt = docker(&["run", "--rm", "--entrypoint", tool, &image]).await;
        assert!(
            !attempt.status.success() && text(&attempt).contains("no such file or directory"),
            "{tool} is not in the image: {}",
            text(&attempt)
        );
    }
    // Off loopback the gateway refuses to start without the deployment's secret (the image
    // listens on 0.0.0.0), and says which setting is missing.
    let unconfigured = docker(&[
        "run",
        "--rm",
        "-e",
        "SANDGATE_DATABASE__URL=postgres://nobody@127.0.0.1:1/none",
        "-e",
        "SANDGATE_PUBLIC_URL=https://mcp.example.com",
        &image,
    ])
    .await;
    assert!(
        !unconfigured.status.success() && text(&unconfigured).contains("keys.secret"),
        "serve without keys.secret is refused naming it: {}",
        text(&unconfigured)
    );
}

#[tokio::test]
async fn the_postgres_image_refuses_bad_settings_with_a_clear_error() {
    let image = postgres_image().await;
    let cases: [(&[&str], &str); 4] = [
        (&[], "POSTGRES_PASSWORD is not set"),
        (
            &["-e", "POSTGRES_PASSWORD=short"],
            "POSTGRES_PASSWORD is shorter than 16 characters",
        ),
        (
            &[
                "-e",
                "POSTGRES_PASSWORD=0123456789abcdef0123",
                "-e",
                "POSTGRES_DB=x\"; DROP DATABASE postgres; --",
            ],
            "POSTGRES_USER and POSTGRES_DB must be lower-case identifiers",
        ),
        (
            &[
                "-e",
                "POSTGRES_PASSWORD=0123456789abcdef0123",
                "-e",
                "POSTGRES_USER=Robert'); --",
            ],
            "POSTGRES_USER and POSTGRES_DB must be lower-case identifiers",
        ),
    ];
    for (env, expected) in cases {
        let mut args = vec!["run", "--rm", "--read-only", "--tmpfs", "/tmp"];
        args.extend_from_slice(env);
        args.push(&image);
        let output = docker(&args).await;
        assert!(
            !output.status.success() && text(&output).contains(expected),
            "{env:?}: refused with {expected:?}: {}",
            text(&output)
        );
    }
}

/// Removes the container when the test ends, however it ends.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker")
            .args(["rm", "-f", "-v", &self.0])
            .output();
    }
}

#[tokio::test]
async fn the_postgres_image_trusts_nobody_without_the_password() {
    let image = postgres_image().await;
    let password = format!("{}", uuid::Uuid::new_v4().simple());
    let name = format!(
        "sgdeploy-pg-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let started = docker(&[
        "run",
        "-d",
        "--name",
        &name,
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges:true",
        "-e",
        "POSTGRES_USER=sandgate",
        "-e",
        &format!("POSTGRES_PASSWORD={password}"),
        &image,
    ])
    .await;
    assert!(
        started.status.success(),
        "the server starts: {}",
        text(&started)
    );
    let _container = Container(name.clone());

    let psql = |password: Option<&str>| {
        let mut args = vec!["exec".to_owned()];
        if let Some(p) = password {
            args.extend(["-e".to_owned(), format!("PGPASSWORD={p}")]);
        }
        args.extend(
            [
                &name,
                "psql",
                "-X",
                "-w",
                "-h",
                "127.0.0.1",
                "-U",
                "sandgate",
                "-d",
                "sandgate",
                "-tAc",
                "select current_user",
            ]
            .map(str::to_owned),
        );
        args
    };
    // Until the server accepts connections (first start runs initdb), then with the password.
    let start = Instant::now();
    let with_password = loop {
        let args = psql(Some(&password));
        let output = docker(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
        if output.status.success() || start.elapsed() > DEADLINE {
            break output;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        text(&with_password).trim(),
        "sandgate",
        "the superuser logs in with its password"
    );
    for (what, password) in [
        ("no password", None),
        ("a wrong one", Some("wrong-password")),
    ] {
        let args = psql(password);
        let output = docker(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
        assert!(
            !output.status.success()
                && (text(&output).contains("password authentication failed")
                    || text(&output).contains("no password supplied")),
            "{what}: refused: {}",
            text(&output)
        );
    }
    // Also over the server's own socket, from inside the container.
    let socket = docker(&[
        "exec", &name, "psql", "-X", "-w", "-h", "/tmp", "-U", "sandgate", "-d", "sandgate", "-c",
        "select 1",
    ])
    .await;
    assert!(
        !socket.status.success() && text(&socket).contains("no password supplied"),
        "the socket wants the password too: {}",
        text(&socket)
    );
    let user = docker(&["exec", &name, "id", "-un"]).await;
    assert_eq!(
        text(&user).trim(),
        "postgres",
        "the server runs as postgres"
    );
}
