//! The tools: their names, scopes and descriptions, and their declared schemas (the arguments
//! and outputs themselves are `schema`'s). The names of tools and arguments are a public
//! contract (clients and docs depend on them).

use std::sync::{Arc, LazyLock};

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use sandgate_auth::Scope;
use schemars::JsonSchema;

pub use super::render::mime_type;
pub use super::schema::*;

/// The tools, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolName {
    /// `create_sandbox`.
    CreateSandbox,
    /// `execute_code`.
    ExecuteCode,
    /// `run_terminal_command`.
    RunTerminalCommand,
    /// `upload_file`.
    UploadFile,
    /// `get_file`.
    GetFile,
    /// `list_files`.
    ListFiles,
    /// `close_sandbox`.
    CloseSandbox,
    /// `export_transcript`.
    ExportTranscript,
    /// `list_jobs`.
    ListJobs,
    /// `kill_job`.
    KillJob,
    /// `install_packages`.
    InstallPackages,
    /// `pause_sandbox`.
    PauseSandbox,
    /// `list_sandboxes`.
    ListSandboxes,
    /// `fork_sandbox`.
    ForkSandbox,
}

impl ToolName {
    /// Every tool.
    pub const ALL: [ToolName; 14] = [
        ToolName::CreateSandbox,
        ToolName::ExecuteCode,
        ToolName::RunTerminalCommand,
        ToolName::UploadFile,
        ToolName::GetFile,
        ToolName::ListFiles,
        ToolName::CloseSandbox,
        ToolName::ExportTranscript,
        ToolName::ListJobs,
        ToolName::KillJob,
        ToolName::InstallPackages,
        ToolName::PauseSandbox,
        ToolName::ForkSandbox,
        ToolName::ListSandboxes,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolName::CreateSandbox => "create_sandbox",
            ToolName::ExecuteCode => "execute_code",
            ToolName::RunTerminalCommand => "run_terminal_command",
            ToolName::UploadFile => "upload_file",
            ToolName::GetFile => "get_file",
            ToolName::ListFiles => "list_files",
            ToolName::CloseSandbox => "close_sandbox",
            ToolName::ExportTranscript => "export_transcript",
            ToolName::ListJobs => "list_jobs",
            ToolName::KillJob => "kill_job",
            ToolName::InstallPackages => "install_packages",
            ToolName::PauseSandbox => "pause_sandbox",
            ToolName::ListSandboxes => "list_sandboxes",
            ToolName::ForkSandbox => "fork_sandbox",
        }
    }

    /// Parses a wire name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// The scope a token needs to call it.
    pub fn scope(self) -> Scope {
        match self {
            ToolName::CreateSandbox
            | ToolName::CloseSandbox
            | ToolName::PauseSandbox
            | ToolName::ListSandboxes
            | ToolName::ForkSandbox => Scope::Sandbox,
            ToolName::ExecuteCode
            | ToolName::RunTerminalCommand
            | ToolName::ListJobs
            | ToolName::KillJob
            | ToolName::InstallPackages => Scope::Execute,
            ToolName::GetFile | ToolName::ListFiles | ToolName::ExportTranscript => {
                Scope::FilesRead
            }
            ToolName::UploadFile => Scope::FilesWrite,
        }
    }

    /// Its definition as listed by `tools/list`.
    pub fn definition(self) -> &'static Tool {
        &DEFINITIONS[Self::ALL
            .iter()
            .position(|t| *t == self)
            .expect("every tool is listed")]
    }
}

const FILES_NOTE: &str = "Files live in /home/user inside the sandbox; paths are relative to it \
    or absolute under it.";
const TARGET_NOTE: &str = "Pass the sandbox_id from create_sandbox (or a conversation_id) so \
    calls reach the same sandbox; the result always names the sandbox_id.";

fn tool<A: JsonSchema + 'static, O: JsonSchema + 'static>(
    name: &'static str,
    title: &'static str,
    description: String,
    annotations: ToolAnnotations,
) -> Tool {
    Tool::new(name, description, JsonObject::new())
        .with_input_schema::<A>()
        .with_output_schema::<O>()
        .with_title(title)
        .with_annotations(annotations)
        .admitting_errors()
}

/// A tool whose declared output schema also admits the error shape ([`ToolErrorOutput`]):
/// clients (the official TypeScript SDK among them) check `structuredContent` against
/// `outputSchema` even when `isError` is true.
pub(super) trait AdmittingErrors {
    /// The tool, its output schema admitting its own output or the error shape.
    fn admitting_errors(self) -> Self;
}

impl AdmittingErrors for Tool {
    fn admitting_errors(mut self) -> Self {
        if let Some(output) = self.output_schema.take() {
            self.output_schema = Some(Arc::new(output_or_error(&output)));
        }
        self
    }
}

/// The tool's output schema, its properties joined by the error shape's and its `required`
/// moved into `anyOf`: an answer is either the tool's output (its required fields present) or
/// the error shape (`error` a string, `retryable` present). A property both name (`error` of
/// `execute_code`, the exception it raised) admits either.
fn output_or_error(output: &JsonObject) -> JsonObject {
    // What the error shape serializes to, its schema made as rmcp makes the outputs'.
    let error = rmcp::handler::server::tool::schema_for_output::<ToolErrorOutput>();
    let mut root = output.clone();
    let own_required = root.remove("required");
    let properties = root
        .entry("properties")
        .or_insert_with(|| JsonObject::new().into())
        .as_object_mut()
        .expect("an object schema's properties");
    let error_properties = error["properties"].as_object().expect("error properties");
    for (name, schema) in error_properties {
        match properties.get_mut(name) {
            Some(own) if own != schema => {
                *own = serde_json::json!({ "anyOf": [own.clone(), schema] });
            }
            Some(_) => {}
            None => {
                properties.insert(name.clone(), schema.clone());
            }
        }
    }
    let own_branch = match own_required {
        Some(required) => serde_json::json!({ "required": required }),
        None => serde_json::json!({}),
    };
    let error_branch = serde_json::json!({
        "required": error["required"],
        "properties": { "error": { "type": "string" } },
    });
    root.insert("anyOf".into(), vec![own_branch, error_branch].into());
    root
}

static DEFINITIONS: LazyLock<Vec<Tool>> = LazyLock::new(|| {
    vec![
        tool::<CreateSandboxArgs, CreateSandboxOutput>(
            "create_sandbox",
            "Create sandbox",
            "Get an isolated Python sandbox (a Linux container with no network) for this \
             conversation, in milliseconds. pandas, numpy, scipy, scikit-learn, statsmodels, \
             matplotlib, seaborn, plotly, pyarrow, openpyxl, requests, bs4, lxml, sympy and pillow \
             are installed; install_packages adds more. \
             Calling it again with the same conversation_id returns the same sandbox (created: \
             false). The sandbox keeps variables and files between calls until close_sandbox, or \
             until it has been idle for idle_timeout_seconds."
                .into(),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<ExecuteCodeArgs, ExecuteCodeOutput>(
            "execute_code",
            "Run Python",
            format!(
                "Run Python code as a Jupyter notebook cell: variables, imports and functions \
                 persist between calls; the value of the last expression is returned (with an \
                 HTML table for DataFrames); stdout and stderr are captured, including from \
                 subprocesses; an exception comes back as name, value and traceback with \
                 isError true. Charts: call plt.show() (or leave figures open) and each figure \
                 comes back as an image and is saved as a PNG under /home/user/outputs. \
                 Long cells are interrupted after timeout_seconds (variables survive). {FILES_NOTE} \
                 {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(true)
                .idempotent(false)
                .open_world(false),
        ),
        tool::<RunTerminalCommandArgs, RunTerminalCommandOutput>(
            "run_terminal_command",
            "Run shell command",
            format!(
                "Run a bash command in the sandbox as an unprivileged user (no network, no \
                 sudo). Returns stdout, stderr and the exit code; isError is true when the exit \
                 code is not 0. After timeout_seconds the command and everything it started are \
                 killed (processes started with & or nohup do not survive the call). To keep a \
                 process running for later calls (a server, a long computation), pass \
                 background: true: the call returns at once with a job (job_id, pid, log file), \
                 list_jobs shows it and kill_job ends it. The working directory is /home/user \
                 unless cwd is given. {FILES_NOTE} {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(true)
                .idempotent(false)
                .open_world(false),
        ),
        tool::<UploadFileArgs, UploadFileOutput>(
            "upload_file",
            "Upload file",
            format!(
                "Put a file into the sandbox (e.g. a CSV the customer shared), as content_text \
                 for text or content_base64 for binary data. Refuses to replace an existing file \
                 unless overwrite is true. Returns its absolute path, size and sha256. \
                 {FILES_NOTE} {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(true)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<GetFileArgs, GetFileOutput>(
            "get_file",
            "Get file",
            format!(
                "Fetch a file from the sandbox: images come back as image content, UTF-8 text \
                 as text, anything else as an embedded binary resource; a large file comes back \
                 as a resource link (read it with resources/read) and a download link instead. \
                 Use it for charts saved under /home/user/outputs and for files your code wrote. \
                 {FILES_NOTE} {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(true)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<ListFilesArgs, ListFilesOutput>(
            "list_files",
            "List files",
            format!(
                "List a directory of the sandbox (default /home/user): names, types, sizes and \
                 modification times. {FILES_NOTE} {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(true)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<CloseSandboxArgs, CloseSandboxOutput>(
            "close_sandbox",
            "Close sandbox",
            "Close the sandbox when the conversation is over: its container, variables and \
             files are deleted. A later create_sandbox gives a fresh one."
                .into(),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(true)
                .idempotent(false)
                .open_world(false),
        ),
        tool::<ExportTranscriptArgs, ExportTranscriptOutput>(
            "export_transcript",
            "Export transcript",
            "Hand the conversation over to a person: export what ran in its sandboxes (every \
             cell with its output, charts and errors, every command, every file uploaded or \
             fetched) as a Jupyter notebook (format ipynb) they can open and re-run, or as a \
             web page (format html). Returns a resource link and a download link to give the \
             person. Works after the sandbox was closed, for as long as transcripts are kept."
                .into(),
            ToolAnnotations::new()
                .read_only(true)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<ListJobsArgs, ListJobsOutput>(
            "list_jobs",
            "List background jobs",
            format!(
                "List the sandbox's background jobs (started by run_terminal_command with \
                 background: true): each job's job_id, pid, command, log file, and whether it is \
                 still running or how it ended (exit code or signal). {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(true)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<KillJobArgs, KillJobOutput>(
            "kill_job",
            "Kill background job",
            format!(
                "Stop a background job (started by run_terminal_command with background: true) \
                 and every process it started; returns the job as it ended. Get job_ids from \
                 list_jobs. {TARGET_NOTE}"
            ),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(true)
                .idempotent(true)
                .open_world(false),
        ),
        super::packages::DEFINITION.clone().admitting_errors(),
        tool::<PauseSandboxArgs, PauseSandboxOutput>(
            "pause_sandbox",
            "Pause sandbox",
            "Pause the sandbox now when the conversation will wait (the customer answers later): \
             its memory, variables, files and installed packages are saved and its container \
             stops. Any later call naming its sandbox_id or conversation_id resumes it as it \
             was (the result says resumed). Where the server cannot save memory, only the \
             files and packages are kept and the result says variables were not kept. Idle \
             sandboxes are paused on their own; this only does it sooner."
                .into(),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
        tool::<ForkSandboxArgs, ForkSandboxOutput>(
            "fork_sandbox",
            "Fork sandbox",
            "Copy a sandbox into a new one (a new sandbox_id) with the same variables, memory \
             and files, to try something without touching the original: later changes in \
             either are not seen by the other. The copy is bound to no conversation; pass its \
             sandbox_id to work in it and close_sandbox it when done."
                .into(),
            ToolAnnotations::new()
                .read_only(false)
                .destructive(false)
                .idempotent(false)
                .open_world(false),
        ),
        tool::<ListSandboxesArgs, ListSandboxesOutput>(
            "list_sandboxes",
            "List sandboxes",
            "List your live and paused sandboxes (those of one conversation when conversation_id \
             is given): each sandbox_id, its state (running, paused…), conversation, idle \
             timeout, end of life and, when paused, since when and its snapshot's size."
                .into(),
            ToolAnnotations::new()
                .read_only(true)
                .destructive(false)
                .idempotent(true)
                .open_world(false),
        ),
    ]
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_object_input_and_output_schemas() {
        for name in ToolName::ALL {
            let tool = name.definition();
            assert_eq!(tool.name, name.as_str());
            assert_eq!(
                tool.input_schema.get("type").and_then(|t| t.as_str()),
                Some("object")
            );
            let output = tool.output_schema.as_ref().expect("an output schema");
            assert_eq!(
                output.get("type").and_then(|t| t.as_str()),
                Some("object"),
                "{}",
                name.as_str()
            );
        }
    }

    #[test]
    fn every_output_schema_admits_the_error_shape() {
        for name in ToolName::ALL {
            let output = name.definition().output_schema.as_ref().expect("a schema");
            let branches = output["anyOf"].as_array().expect("anyOf output and error");
            assert_eq!(branches.len(), 2, "{}", name.as_str());
            assert!(
                output.get("required").is_none(),
                "{}: required moved into the branches",
                name.as_str()
            );
            let error = &branches[1]["required"];
            assert_eq!(error, &serde_json::json!(["error", "retryable"]));
            let properties = output["properties"].as_object().expect("properties");
            for field in ["sandbox_id", "error", "retryable", "retry_after_seconds"] {
                assert!(properties.contains_key(field), "{}: {field}", name.as_str());
            }
        }
    }
}
