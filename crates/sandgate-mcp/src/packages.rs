//! `install_packages`: pip in the sandbox, the same way as `pip install` typed in a terminal
//! command (the sandbox's package index is served beside every cell and command; see
//! `sandgate_service::packages`), with output streamed as progress. Which requirements it takes
//! is the service's rule (`sandgate_service::packages::requirements`).

use std::sync::LazyLock;

use rmcp::RoleServer;
use rmcp::model::{Tool, ToolAnnotations};
use rmcp::service::RequestContext;
use sandgate_service::Caller;
use sandgate_service::packages::requirements::pip_command;
use schemars::JsonSchema;
use serde::Deserialize;

use super::McpServer;
use super::answer::{Answer, CallError, target};
use super::schema::RunTerminalCommandOutput;

/// How long pip may take when the caller names no timeout, seconds.
const DEFAULT_TIMEOUT_SECONDS: u32 = 300;

/// `install_packages` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallPackagesArgs {
    /// Requirements as pip takes them: names, optionally with extras and versions, e.g.
    /// ["requests-toolbelt", "polars>=1.0", "pydantic[email]==2.9.2"].
    pub packages: Vec<String>,
    /// Stop pip after this many seconds (default 300, bounded by your limits).
    #[serde(default)]
    pub timeout_seconds: Option<u32>,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// The tool's definition (its output is run_terminal_command's: pip's output and exit code).
pub(super) static DEFINITION: LazyLock<Tool> = LazyLock::new(|| {
    Tool::new(
        "install_packages",
        "Install Python packages in the sandbox (pip, binary wheels only, from the package index \
         the operator configured; the sandbox itself stays without network). Installed packages \
         import in the next execute_code call. Same as running `pip install …` with \
         run_terminal_command or `%pip install …` in a cell. A package the tenant's policy \
         refuses, one that ships no wheel (only a source distribution) or a download that fails \
         its hash check is refused and stderr says why; the sandbox is unaffected. Pass the \
         sandbox_id from create_sandbox (or a conversation_id).",
        rmcp::model::JsonObject::new(),
    )
    .with_input_schema::<InstallPackagesArgs>()
    .with_output_schema::<RunTerminalCommandOutput>()
    .with_title("Install Python packages")
    .with_annotations(
        ToolAnnotations::new()
            .read_only(false)
            .destructive(false)
            .idempotent(true)
            .open_world(true),
    )
});

impl McpServer {
    /// Runs `pip install` with the requested packages in the target sandbox.
    pub(super) async fn install_packages(
        &self,
        args: InstallPackagesArgs,
        caller: &Caller,
        conversation: Option<&str>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let command = pip_command(&args.packages)
            .map_err(|refused| CallError::InvalidParams(refused.to_string()))?;
        let timeout = self.call_timeout(Some(
            args.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT_SECONDS),
        ))?;
        let conversation = args.conversation_id.as_deref().or(conversation);
        let to = target(&args.sandbox_id, conversation, None);
        let line = sandgate_service::CommandLine {
            command: &command,
            cwd: None,
        };
        self.run_command(caller, to, line, timeout, ctx).await
    }
}
