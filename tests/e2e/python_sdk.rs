//! The support-analyst conversation driven by the official Python MCP SDK (PyPI `mcp` 2.x), once
//! per protocol mode: `tests/e2e/python/support_analyst.py` against the real binary.
//!
//! The interpreter comes from `SANDGATE_TEST_PYTHON` (`scripts/test.sh` sets it to the venv that
//! `scripts/py-venv.sh` builds from `tests/python-requirements.txt`).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::support::{self, Gateway};

pub(crate) const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/e2e/python/support_analyst.py"
);

/// The Python interpreter that has the `mcp` SDK. Deliberately a hard failure when unset: a
/// skipped interop test looks exactly like a passing one.
pub(crate) fn python() -> String {
    std::env::var("SANDGATE_TEST_PYTHON").expect(
        "SANDGATE_TEST_PYTHON is not set: it must name a Python with the `mcp` 2.x SDK \
         (scripts/test.sh sets it from scripts/py-venv.sh, which installs tests/python-requirements.txt)",
    )
}

/// Runs the script in `mode` against the MCP endpoint `mcp_url`; panics with its output unless it
/// exits 0.
pub(crate) async fn run_script(python: &str, mcp_url: &str, token: &str, mode: &str) {
    let stdout = run_python(
        python,
        SCRIPT,
        &["--mode", mode],
        mcp_url,
        token,
        Duration::from_secs(360),
    )
    .await;
    assert!(
        stdout.contains(&format!("ok ({mode}")),
        "the script reported success for {mode}:\n{stdout}"
    );
}

/// Runs the Python `script` with `args` against the MCP endpoint `mcp_url` (given as
/// `SANDGATE_MCP_URL` and `SANDGATE_MCP_TOKEN`); panics with its output unless it exits 0
/// within `within`. Returns its stdout.
pub(crate) async fn run_python(
    python: &str,
    script: &str,
    args: &[&str],
    mcp_url: &str,
    token: &str,
    within: Duration,
) -> String {
    run_python_with_env(python, script, args, mcp_url, token, &[], within).await
}

/// [`run_python`] with `env` added to the script's environment (e.g. `SSL_CERT_FILE`, the CA an
/// HTTPS endpoint's certificate is checked against).
pub(crate) async fn run_python_with_env(
    python: &str,
    script: &str,
    args: &[&str],
    mcp_url: &str,
    token: &str,
    env: &[(&str, &str)],
    within: Duration,
) -> String {
    let script = Path::new(script);
    assert!(script.is_file(), "{} exists", script.display());
    let child = Command::new(python)
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .env("SANDGATE_MCP_URL", mcp_url)
        .env("SANDGATE_MCP_TOKEN", token)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("SANDGATE_TEST_PYTHON={python} could not be started: {e}"));
    let name = script.display();
    let output = tokio::time::timeout(within, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{name} {args:?} finished within {within:?}"))
        .expect("the script's output can be read");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} {args:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    stdout.into_owned()
}

#[tokio::test]
async fn official_python_sdk_plays_the_support_analyst_conversation() {
    let python = python();
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    // `legacy`: 2025-11-25 with an Mcp-Session-Id session; `2026-07-28`: stateless, pinned;
    // `auto`: the SDK's default, which probes server/discover and must land on 2026-07-28.
    for mode in ["legacy", "2026-07-28", "auto"] {
        run_script(&python, &gateway.mcp_url(), &token, mode).await;
    }
}

#[tokio::test]
async fn official_python_sdk_reads_files_and_transcripts_as_resources() {
    let python = python();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/python/resources.py"
    );
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let (a, b) = (gateway.create_tenant().await, gateway.create_tenant().await);
    let output = Command::new(&python)
        .arg(script)
        .env("SANDGATE_MCP_URL", gateway.mcp_url())
        .env("SANDGATE_MCP_TOKEN", gateway.token(&a).await)
        .env("SANDGATE_OTHER_TOKEN", gateway.token(&b).await)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(240), output)
        .await
        .expect("the resources script finished within 4 min")
        .expect("the script runs");
    assert!(
        output.status.success(),
        "resources.py failed:\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn official_python_sdk_installs_packages_from_the_loopback_index() {
    let python = python();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/python/packages.py"
    );
    let (index, addr, _wheels) = crate::packages::serve_index().await;
    let cache = crate::wheels::TempDir::new("sandgate-test-wheel-cache");
    let (gateway, _tenant, token) = crate::packages::gateway_with_index(addr, cache.path()).await;
    let output = Command::new(&python)
        .arg(script)
        .args(["--mode", "2026-07-28"])
        .env("SANDGATE_MCP_URL", gateway.mcp_url())
        .env("SANDGATE_MCP_TOKEN", &token)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), output)
        .await
        .expect("the packages script finished within 5 min")
        .expect("the script runs");
    assert!(
        output.status.success(),
        "packages.py failed:\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        index.downloads_of("sgtool-2.0-py3-none-any.whl"),
        1,
        "the wheel came from the test's index, once"
    );
}

/// Issue 27's pause and resume through the official SDK, in both protocol eras: a cell sets a
/// variable and writes a file, the sandbox idles past its 2 s timeout and is paused (the script
/// polls `list_sandboxes`), and the next call by `conversation_id` sees both under the same
/// `sandbox_id`, saying it resumed; its transcript marks the pause and the resume.
#[tokio::test]
async fn official_python_sdk_resumes_a_paused_sandbox_in_both_eras() {
    let python = python();
    if !crate::pause::runsc2024_registered() {
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/python/pause_resume.py"
    );
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = crate::pause::plain_dir();
    let store = crate::pause::StoreDir::new();
    let gateway = Gateway::start(&database, &crate::pause::pausing_env(&plain, &store)).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    for mode in ["legacy", "2026-07-28"] {
        let stdout = run_python(
            &python,
            script,
            &["--mode", mode],
            &gateway.mcp_url(),
            &token,
            Duration::from_secs(360),
        )
        .await;
        assert!(
            stdout.contains(&format!("ok ({mode})")),
            "the script reported success for {mode}:\n{stdout}"
        );
    }
    support::remove_containers_of(&gateway.instance);
}

/// The README's Python example, as printed there: the first ```python block after "With the
/// official Python SDK".
fn readme_python_example() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md is readable");
    let intro = readme
        .find("With the official Python SDK")
        .expect("the README introduces its Python example");
    let start = readme[intro..]
        .find("```python\n")
        .map(|at| intro + at + "```python\n".len())
        .expect("the README has a ```python block after its introduction");
    let len = readme[start..]
        .find("\n```")
        .expect("the README's python block ends");
    readme[start..start + len + 1].to_owned()
}

/// What a run of "1 + 1" cannot show about the example, read from it: it imports no private
/// module of the SDK (a `_name` one may change in any release), runs with `asyncio.run`, and its
/// HTTP client waits for reads at least as long as a call may last
/// (limits.max_call_timeout_seconds), so a long cell is not cut off by the client.
fn assert_example_is_robust(example: &str) {
    for line in example.lines() {
        let line = line.trim();
        if line.starts_with("import ") || line.starts_with("from ") {
            let module = line.split_whitespace().nth(1).unwrap_or_default();
            assert!(
                module == "__future__" || !module.split('.').any(|part| part.starts_with('_')),
                "the README's example imports no private module: {line}"
            );
        }
    }
    assert!(
        example.contains("asyncio.run(main())"),
        "the README's example runs its coroutine with asyncio.run:\n{example}"
    );
    let max_call: f64 = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/default.toml"
    ))
    .expect("config/default.toml")
    .lines()
    .find_map(|l| l.strip_prefix("max_call_timeout_seconds = "))
    .and_then(|v| v.trim().parse().ok())
    .expect("config/default.toml has limits.max_call_timeout_seconds");
    let read: f64 = example
        .split("read=")
        .nth(1)
        .and_then(|rest| {
            let number: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            number.parse().ok()
        })
        .unwrap_or_else(|| panic!("the README's example sets a read timeout (read=…):\n{example}"));
    assert!(
        read >= max_call,
        "the README's example reads for {read} s, at least limits.max_call_timeout_seconds ({max_call} s)"
    );
}

#[tokio::test]
async fn the_readmes_python_example_runs_as_printed() {
    let python = python();
    let dir = crate::wheels::TempDir::new("sandgate-test-readme-example");
    let script = dir.path().join("readme_example.py");
    let example = readme_python_example();
    assert_example_is_robust(&example);
    std::fs::write(&script, example).expect("the example is written");
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let tenant = gateway.create_tenant().await;
    let output = Command::new(&python)
        .arg(&script)
        .env("SANDGATE_MCP_URL", gateway.mcp_url())
        .env("TOKEN", gateway.token(&tenant).await)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), output)
        .await
        .expect("the README's example finished within 2 min")
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.trim() == "2",
        "the README's example should print 2:\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
