//! The deployment artifacts under `deploy/`: the compose file brought up from the images the
//! build scripts make here (offline), and the Kubernetes manifests validated offline against the
//! Kubernetes schemas.

mod compose;
mod images;
mod kubelet;
mod kubernetes;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// The repository's root (the tests run from `crates/sandgate`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .canonicalize()
        .expect("the repository root exists")
}

/// Runs `program args` with a deadline; returns its output, or panics with `what` and stderr
/// when it fails or does not finish.
pub async fn run_ok(what: &str, program: &str, args: &[&str], deadline: Duration) -> String {
    let output = run(program, args, deadline).await;
    assert!(
        output.status.success(),
        "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// Runs `program args` with a deadline and returns its output, whatever its exit status.
pub async fn run(program: &str, args: &[&str], deadline: Duration) -> std::process::Output {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{program} could not be started: {e}"));
    tokio::time::timeout(deadline, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?} finished within {deadline:?}"))
        .expect("its output can be read")
}

/// A cold build of the Postgres image is a debootstrap and an apt-get install: minutes.
const BUILD_DEADLINE: Duration = Duration::from_secs(1200);

/// Builds an image with one of the `deploy/*/build.sh` scripts (nothing when it is there);
/// returns the tag (its last line).
pub async fn build_image(script: &str, args: &[&str]) -> String {
    let path = repo_root().join(script);
    let stdout = run_ok(
        script,
        path.to_str().expect("a UTF-8 path"),
        args,
        BUILD_DEADLINE,
    )
    .await;
    stdout
        .lines()
        .last()
        .unwrap_or_else(|| panic!("{script} printed a tag"))
        .trim()
        .to_owned()
}

/// The gateway/node image of the binary under test.
pub async fn gateway_image() -> String {
    build_image(
        "deploy/gateway/build.sh",
        &["--binary", crate::support::BIN],
    )
    .await
}

/// The Postgres image.
pub async fn postgres_image() -> String {
    build_image("deploy/postgres/build.sh", &[]).await
}

/// The TLS reverse proxy image (Debian's nginx with `deploy/nginx/sandgate.conf`).
pub async fn proxy_image() -> String {
    build_image("deploy/nginx/build.sh", &[]).await
}
