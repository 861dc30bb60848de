//! The error catalogue through the official MCP TypeScript SDK (npm `@modelcontextprotocol/sdk`,
//! pinned in tests/ts-sdk/package-lock.json): `tests/ts-sdk/error_kinds.mjs` against the real
//! binary. After `tools/list` the SDK checks every result's `structuredContent` against the
//! tool's `outputSchema`, error results included, so a tool error whose shape its schema does
//! not admit fails the script.
//!
//! The SDK's directory comes from `SANDGATE_TEST_TS_SDK` (`scripts/test.sh` sets it from
//! `scripts/ts-sdk.sh`, which installs the lock file with `npm ci`).

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::error_kinds::Catalogue;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/ts-sdk/error_kinds.mjs"
);

/// The directory the SDK is installed in. Deliberately a hard failure when unset: a skipped
/// interop test looks exactly like a passing one.
fn sdk_dir() -> String {
    std::env::var("SANDGATE_TEST_TS_SDK").expect(
        "SANDGATE_TEST_TS_SDK is not set: it must name the directory scripts/ts-sdk.sh installs \
         the MCP TypeScript SDK into (scripts/test.sh sets it)",
    )
}

#[tokio::test]
async fn the_typescript_sdk_accepts_every_error_answer_against_its_output_schema() {
    let sdk = sdk_dir();
    let stack = Catalogue::start().await;
    let child = Command::new("node")
        .arg(SCRIPT)
        .env("SANDGATE_TEST_TS_SDK", &sdk)
        .env("SANDGATE_MCP_URL", stack.gateway.mcp_url())
        .env("SANDGATE_MCP_TOKEN", &stack.token)
        .env("SANDGATE_MCP_QUOTA_TOKEN", &stack.quota_token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let output = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the script finishes within 3 minutes")
        .expect("its output can be read");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("ok ("),
        "error_kinds.mjs succeeded:\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}
