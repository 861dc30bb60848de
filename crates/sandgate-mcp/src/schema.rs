//! The tools' arguments and structured outputs (their JSON schemas are the tools' declared
//! input and output schemas). The names of tools, arguments and fields are a public contract
//! (clients and docs depend on them).

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
    /// The sandbox had been paused (idle past its timeout, or `pause_sandbox`) and this call
    /// resumed it, same sandbox_id, variables and files kept; null when it was running.
    pub resumed: Option<ResumedOutput>,
    /// The conversation's previous sandbox, when it ended and this call got a new one (then
    /// state_lost is true): which, when and why; null otherwise.
    pub previous_sandbox: Option<PreviousSandboxOutput>,
    /// Wall time, milliseconds.
    pub duration_ms: u64,
}

/// A conversation's sandbox that ended.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PreviousSandboxOutput {
    /// Its id.
    pub sandbox_id: String,
    /// When it ended (RFC 3339), if known.
    pub ended_at: Option<String>,
    /// Why it ended.
    pub reason: String,
}

/// That a call resumed its paused sandbox.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ResumedOutput {
    /// How long the sandbox was paused, seconds.
    pub paused_seconds: f64,
    /// True when the pause kept only its files (its runtime cannot checkpoint): a fresh Python
    /// kernel with /home/user restored; variables were not kept (state_lost is true).
    pub from_files: bool,
    /// Of a resume from files: the packages installed again (name==version).
    pub packages_reinstalled: Vec<String>,
    /// Of a resume from files: the packages installed at the pause that were not installed
    /// again (install them with install_packages when packages are on).
    pub packages_not_reinstalled: Vec<String>,
    /// Of a resume from files: paths under /home/user that were not restored.
    pub files_not_restored: Vec<String>,
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
    /// When the command failed: `command_failed` (a non-zero exit code or a signal) or
    /// `timeout` (see the README's error catalogue); absent when it succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With `error`: whether running it again unchanged may succeed (false for both kinds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
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
    /// The bytes of stored entries it holds (the rendering is about this size; it is not
    /// rendered to measure it).
    pub size: u64,
    /// Calls (cells, commands, file transfers) it holds.
    pub calls: u64,
    /// Later calls that were not kept because a sandbox's transcript was full or the tenant's
    /// transcripts were at their byte budget.
    pub dropped: u64,
    /// Of those, the calls not kept because the tenant's transcripts were at their byte budget.
    pub over_budget: u64,
    /// The conversation's oldest sandboxes this export leaves out (one export holds only its
    /// newest sandboxes, up to a bound in sandboxes and bytes); export one by its sandbox id.
    pub omitted_sandboxes: u64,
    /// Their calls.
    pub omitted_calls: u64,
    /// A link a person (e.g. the human agent taking over) can open, valid until
    /// download_expires_at; it stops working if this app is disconnected.
    pub download_url: String,
    /// When the link stops working (RFC 3339).
    pub download_expires_at: String,
}

/// The structured content of a tool answer with isError true when the tool could not do what
/// was asked (a missing sandbox, a bad path, a quota, an unavailable node …): every tool's
/// outputSchema admits it beside the tool's own output. The kinds are the README's error
/// catalogue.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ToolErrorOutput {
    /// The error's kind, e.g. not_found, bad_path, quota_exceeded (the README lists them all).
    pub error: String,
    /// Whether the same call, made again unchanged (after retry_after_seconds when given), may
    /// succeed.
    pub retryable: bool,
    /// When a retry may succeed, seconds, where that is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u32>,
    /// For quota_exceeded: the quota that refused the call (e.g. max_calls_per_minute).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// For quota_exceeded: the quota's value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<u32>,
}

/// `pause_sandbox` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseSandboxArgs {
    /// The sandbox to pause. Without it, the conversation's sandbox is paused.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox to pause when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// `pause_sandbox` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PauseSandboxOutput {
    /// The sandbox.
    pub sandbox_id: String,
    /// True once it is paused.
    pub paused: bool,
    /// When it was paused (RFC 3339).
    pub paused_at: Option<String>,
}

/// `list_sandboxes` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesArgs {
    /// Only this conversation's sandboxes (else every live or paused sandbox of yours).
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// One sandbox in `list_sandboxes`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SandboxEntry {
    /// Its id.
    pub sandbox_id: String,
    /// `running`, `pausing`, `paused` or `resuming` (any call on a paused one resumes it).
    pub state: String,
    /// The conversation it is bound to, if any.
    pub conversation_id: Option<String>,
    /// Its idle timeout, seconds.
    pub idle_timeout_seconds: u32,
    /// Its end of life (RFC 3339).
    pub expires_at: Option<String>,
    /// When it was paused (RFC 3339), when it is paused.
    pub paused_at: Option<String>,
    /// The size of its sealed snapshot, bytes, when it is paused.
    pub snapshot_bytes: Option<u64>,
}

/// `list_sandboxes` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ListSandboxesOutput {
    /// Always null (this call names no one sandbox).
    pub sandbox_id: Option<String>,
    /// The sandboxes, newest first.
    pub sandboxes: Vec<SandboxEntry>,
}

/// `fork_sandbox` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSandboxArgs {
    /// The sandbox to copy. Without it, the conversation's sandbox is copied.
    #[serde(default)]
    pub sandbox_id: Option<String>,
    /// The conversation whose sandbox to copy when sandbox_id is not given.
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// `fork_sandbox` result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ForkSandboxOutput {
    /// The new sandbox (the copy): pass this sandbox_id to work in it.
    pub sandbox_id: String,
    /// The sandbox it was copied from (unchanged by anything done in the copy).
    pub forked_from: String,
    /// The copy's idle timeout, seconds.
    pub idle_timeout_seconds: u32,
    /// The copy's end of life (RFC 3339).
    pub expires_at: String,
}
