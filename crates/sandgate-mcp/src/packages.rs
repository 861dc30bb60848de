//! `install_packages`: pip in the sandbox, the same way as `pip install` typed in a terminal
//! command (the sandbox's package index is served beside every cell and command; see
//! `sandgate_service::packages`), with output streamed as progress.

use std::sync::LazyLock;

use rmcp::RoleServer;
use rmcp::model::{Tool, ToolAnnotations};
use rmcp::service::RequestContext;
use sandgate_service::Caller;
use schemars::JsonSchema;
use serde::Deserialize;

use super::McpServer;
use super::answer::{Answer, CallError, target};
use super::schema::RunTerminalCommandOutput;

/// Most packages one call installs.
const MAX_PACKAGES: usize = 50;
/// Longest requirement accepted (a name with extras and version specifiers).
const MAX_REQUIREMENT: usize = 200;
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
        let command = pip_command(&args.packages).map_err(CallError::InvalidParams)?;
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

/// `pip install --progress-bar off 'req' …`, each requirement checked and shell-quoted.
fn pip_command(packages: &[String]) -> Result<String, String> {
    if packages.is_empty() || packages.len() > MAX_PACKAGES {
        return Err(format!(
            "packages: give between 1 and {MAX_PACKAGES} requirements, e.g. [\"requests\", \"polars>=1.0\"]"
        ));
    }
    let mut command = String::from("pip install --progress-bar off");
    for req in packages {
        let req = req.trim();
        let allowed = |c: char| c.is_ascii_alphanumeric() || "._-[],<>=!~* ".contains(c);
        if req.is_empty()
            || req.len() > MAX_REQUIREMENT
            || !req.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !req.chars().all(allowed)
        {
            return Err(format!(
                "packages: {req:?} is not a requirement pip takes by name (a project name, \
                 optionally with [extras] and version specifiers such as >=1.0; no URLs, paths \
                 or options)"
            ));
        }
        command.push_str(" '");
        command.push_str(req);
        command.push('\'');
    }
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_are_quoted_and_anything_else_is_refused() {
        let ok = pip_command(&["pandas>=2".into(), "pydantic[email]==2.9".into()]).unwrap();
        assert_eq!(
            ok,
            "pip install --progress-bar off 'pandas>=2' 'pydantic[email]==2.9'"
        );
        for bad in [
            "--index-url=http://x",
            "x; rm -rf ~",
            "x'y",
            "/home/user/a.whl",
            "",
            "a$(id)",
        ] {
            assert!(
                pip_command(&[bad.into()]).is_err(),
                "{bad:?} must be refused"
            );
        }
        assert!(pip_command(&[]).is_err());
    }
}
