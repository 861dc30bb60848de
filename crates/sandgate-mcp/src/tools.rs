//! The tools: their arguments, structured outputs and descriptions. The names of tools and
//! arguments are a public contract (clients and docs depend on them).

use std::sync::LazyLock;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use sandgate_auth::Scope;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `create_sandbox` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// A key for the end-user conversation (e.g. your chat's id). Calling create_sandbox again
    /// with the same conversation_id returns the same sandbox while it lives.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Close the sandbox after this many seconds without a call (each call restarts the clock;
    /// every tool takes keep_alive_seconds to change it). Bounded by your limits.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `create_sandbox` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CreateSandboxOutput {
    /// The sandbox's id: pass it as sandbox_id to the other tools.
    pub sandbox_id: String,
    /// False when the conversation already had this sandbox and it was returned again.
    pub created: bool,
    /// The conversation it is bound to, if any.
    pub conversation_id: Option<String>,
    /// When it will be closed at the latest (RFC 3339).
    pub expires_at: String,
    /// It is closed after this many seconds without a call.
    pub idle_timeout_seconds: u32,
}

/// Fields every sandbox-reaching tool takes besides its own.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Target {
    /// The sandbox to use (from create_sandbox). Without it, the conversation's sandbox is used,
    /// created on demand; the result names the sandbox_id to pass on.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox to use when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// `execute_code` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteCodeArgs {
    /// Python source to run as one notebook cell.
    pub code: String,
    /// Interrupt the cell after this many seconds (default 60).
    #[serde(default)]
    pub timeout_seconds: Option<u32>,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// The value of a cell's last expression.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CellResult {
    /// Plain-text representation.
    #[serde(rename = "text/plain", skip_serializing_if = "Option::is_none")]
    pub text_plain: Option<String>,
    /// HTML representation (e.g. a pandas DataFrame's table), when there is one.
    #[serde(rename = "text/html", skip_serializing_if = "Option::is_none")]
    pub text_html: Option<String>,
}

/// An exception raised by the cell.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CellErrorOutput {
    /// Exception class, e.g. ZeroDivisionError.
    pub name: String,
    /// Its message.
    pub value: String,
    /// Traceback, as plain-text lines.
    pub traceback: Vec<String>,
}

/// A chart produced by the cell.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ImageOutput {
    /// Where the PNG was saved in the sandbox (fetch it again with get_file).
    pub path: Option<String>,
    /// Always image/png.
    pub mime_type: String,
    /// Size in bytes.
    pub size: u64,
}

/// `execute_code` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ExecuteCodeOutput {
    /// The sandbox the cell ran in.
    pub sandbox_id: String,
    /// Everything printed to stdout (including by child processes).
    pub stdout: String,
    /// Everything printed to stderr.
    pub stderr: String,
    /// The value of the last expression, or null.
    pub result: Option<CellResult>,
    /// The exception the cell raised, or null.
    pub error: Option<CellErrorOutput>,
    /// The kernel's execution counter for this cell.
    pub execution_count: Option<u64>,
    /// Charts (also returned as image content).
    pub images: Vec<ImageOutput>,
    /// Output beyond the limit was dropped.
    pub truncated: bool,
    /// The cell hit its timeout and was interrupted.
    pub timed_out: bool,
    /// The kernel had to be restarted: variables defined earlier are gone (files are kept).
    pub state_lost: bool,
    /// Why the variables are gone (the kernel was restarted after a timeout, was killed, crashed
    /// or ran out of memory), when they are.
    pub state_lost_reason: Option<String>,
    /// Wall time, milliseconds.
    pub duration_ms: u64,
}

/// `run_terminal_command` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunTerminalCommandArgs {
    /// A bash command line (run with bash -lc as the sandbox user).
    pub command: String,
    /// Kill the command (and everything it started) after this many seconds (default 60).
    #[serde(default)]
    pub timeout_seconds: Option<u32>,
    /// Working directory, relative to /home/user or absolute under it (default /home/user).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Start the command as a background job (default false): it keeps running after this
    /// call (e.g. a server or a long computation for later calls) and the call returns at once
    /// with the job; its output goes to the job's log file. See list_jobs and kill_job.
    /// timeout_seconds does not apply to it.
    #[serde(default)]
    pub background: bool,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `run_terminal_command` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RunTerminalCommandOutput {
    /// The sandbox the command ran in.
    pub sandbox_id: String,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
    /// Exit code; null when it was killed by a signal.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if any.
    pub signal: Option<i32>,
    /// It hit its timeout and was killed.
    pub timed_out: bool,
    /// Output beyond the limit was dropped.
    pub truncated: bool,
    /// Wall time, milliseconds.
    pub duration_ms: u64,
    /// The background job the call started (with background true), else null.
    pub job: Option<JobOutput>,
}

/// A background job (started by run_terminal_command with background true).
#[derive(Debug, Serialize, JsonSchema)]
pub struct JobOutput {
    /// Its handle in the sandbox, e.g. job-1: pass it as job_id to kill_job.
    pub job_id: String,
    /// Its main process id inside the sandbox.
    pub pid: u64,
    /// The command line it runs.
    pub command: String,
    /// The file its stdout and stderr go to (outside /home/user: read it with
    /// run_terminal_command, e.g. tail -n 50 <log>).
    pub log: String,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// Whether it is still running.
    pub running: bool,
    /// Its exit code, once it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it (9 when kill_job killed it), if one did.
    pub signal: Option<i32>,
}

impl From<sandgate_sandbox::Job> for JobOutput {
    fn from(job: sandgate_sandbox::Job) -> Self {
        let started = chrono::DateTime::from_timestamp_millis((job.started * 1000.0) as i64)
            .map(super::render::rfc3339)
            .unwrap_or_default();
        Self {
            job_id: job.id,
            pid: job.pid,
            command: job.command,
            log: job.log,
            started_at: started,
            running: job.running,
            exit_code: job.exit_code,
            signal: job.signal,
        }
    }
}

/// `list_jobs` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListJobsArgs {
    /// The sandbox whose jobs to list (from create_sandbox).
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox's jobs to list when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `list_jobs` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListJobsOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its running jobs and the most recently ended ones, oldest first.
    pub jobs: Vec<JobOutput>,
}

/// `kill_job` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillJobArgs {
    /// The job to kill (job_id from run_terminal_command or list_jobs, e.g. job-1).
    pub job_id: String,
    /// The sandbox the job runs in (from create_sandbox).
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox the job runs in when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `kill_job` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct KillJobOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// The job as it ended.
    pub job: JobOutput,
}

/// `upload_file` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadFileArgs {
    /// Destination, relative to /home/user or absolute under it. Missing directories are created.
    pub path: String,
    /// The content, base64-encoded (for binary files). Give this or content_text.
    #[serde(default)]
    pub content_base64: Option<String>,
    /// The content as UTF-8 text. Give this or content_base64.
    #[serde(default)]
    pub content_text: Option<String>,
    /// Replace an existing file (default false).
    #[serde(default)]
    pub overwrite: Option<bool>,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `upload_file` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct UploadFileOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// Absolute path of the file.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
}

/// `get_file` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetFileArgs {
    /// The file, relative to /home/user or absolute under it.
    pub path: String,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// `get_file` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct GetFileOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// Absolute path of the file.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// MIME type (from the file name and content).
    pub mime_type: String,
    /// Hex SHA-256 of the content.
    pub sha256: String,
    /// A link a person can open to download the file (while the sandbox lives), valid until
    /// download_expires_at. Share it with the user instead of pasting large content.
    pub download_url: String,
    /// When the link stops working (RFC 3339).
    pub download_expires_at: String,
    /// Space used and left in /home/user.
    pub space: Option<SpaceOutput>,
}

/// Space used and left in /home/user (a quota: writing past it fails with "No space left on
/// device").
#[derive(Debug, Serialize, JsonSchema)]
pub struct SpaceOutput {
    /// Bytes in use.
    pub used_bytes: u64,
    /// Bytes still free.
    pub free_bytes: u64,
}

impl From<sandgate_sandbox::Space> for SpaceOutput {
    fn from(space: sandgate_sandbox::Space) -> Self {
        Self {
            used_bytes: space.used,
            free_bytes: space.free,
        }
    }
}

/// `list_files` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// Directory, relative to /home/user or absolute under it (default /home/user).
    #[serde(default)]
    pub path: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// See create_sandbox.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Keep the sandbox alive this many seconds without a call from now on (like
    /// create_sandbox's; bounded by your limits). Without it, the idle timeout stays as it is.
    #[serde(default)]
    pub keep_alive_seconds: Option<u32>,
}

/// One directory entry.
#[derive(Debug, Serialize, JsonSchema)]
pub struct FileEntry {
    /// File name.
    pub name: String,
    /// file, dir, symlink or other.
    #[serde(rename = "type")]
    pub kind: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification (RFC 3339).
    pub modified: String,
}

/// `list_files` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListFilesOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// The directory listed (absolute).
    pub path: String,
    /// Its entries, sorted by name.
    pub entries: Vec<FileEntry>,
    /// Space used and left in /home/user.
    pub space: Option<SpaceOutput>,
}

/// `close_sandbox` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CloseSandboxArgs {
    /// The sandbox to close. Without it, the conversation's sandbox is closed.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox to close when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// `close_sandbox` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CloseSandboxOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// True once it is closed.
    pub closed: bool,
}

/// `export_transcript` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExportTranscriptArgs {
    /// One sandbox's transcript. Without it, the conversation's (every sandbox it had).
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose transcript to export when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// "ipynb" (a Jupyter notebook, the default) or "html" (a page a person can read in a
    /// browser).
    #[serde(default)]
    pub format: Option<String>,
}

/// `export_transcript` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ExportTranscriptOutput {
    /// The sandbox (the conversation's latest, when it had several).
    pub sandbox_id: String,
    /// The sandboxes the transcript covers, oldest first.
    pub sandbox_ids: Vec<String>,
    /// The conversation, when the sandboxes were bound to one.
    pub conversation_id: Option<String>,
    /// ipynb or html.
    pub format: String,
    /// The transcript as an MCP resource (read it with resources/read).
    pub uri: String,
    /// Its MIME type.
    pub mime_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Calls (cells, commands, file transfers) it holds.
    pub calls: u64,
    /// Later calls that were not kept because a sandbox's transcript was full.
    pub dropped: u64,
    /// A link a person (e.g. the human agent taking over) can open, valid until
    /// download_expires_at; it stops working if this app is disconnected.
    pub download_url: String,
    /// When the link stops working (RFC 3339).
    pub download_expires_at: String,
}

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
}

impl ToolName {
    /// Every tool.
    pub const ALL: [ToolName; 11] = [
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
        }
    }

    /// Parses a wire name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// The scope a token needs to call it.
    pub fn scope(self) -> Scope {
        match self {
            ToolName::CreateSandbox | ToolName::CloseSandbox => Scope::Sandbox,
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
        super::packages::DEFINITION.clone(),
    ]
});

/// Guesses a MIME type from a file name (`mime_guess`), falling back to sniffing the first bytes
/// of a file without a known extension.
pub fn mime_type(path: &str, head: &[u8]) -> String {
    if let Some(known) = mime_guess::from_path(path).first_raw() {
        return known.to_owned();
    }
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        "image/png".into()
    } else if head.starts_with(b"\xff\xd8\xff") {
        "image/jpeg".into()
    } else if head.starts_with(b"GIF8") {
        "image/gif".into()
    } else if head.starts_with(b"%PDF") {
        "application/pdf".into()
    } else if std::str::from_utf8(head).is_ok() {
        "text/plain".into()
    } else {
        "application/octet-stream".into()
    }
}

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
    fn mime_types_come_from_names_then_content() {
        assert_eq!(mime_type("a/b.CSV", b"x,y"), "text/csv");
        assert_eq!(mime_type("chart", b"\x89PNG\r\n\x1a\nrest"), "image/png");
        assert_eq!(
            mime_type("blob", &[0xff, 0xfe, 0x00, 0x80]),
            "application/octet-stream"
        );
        assert_eq!(mime_type("notes", b"hello"), "text/plain");
    }
}
