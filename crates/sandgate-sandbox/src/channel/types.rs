//! What callers pass to and get from the channel.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// How to run a cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOptions {
    /// When the cell is interrupted.
    pub timeout: Duration,
    /// Most bytes of stdout and stderr together kept (the agent caps at this too).
    pub output_limit: usize,
    /// Most bytes of images (decoded PNG) kept from one cell.
    pub display_limit: usize,
}

impl Default for ExecOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            output_limit: 1 << 20,
            display_limit: 32 << 20,
        }
    }
}

/// A MIME bundle: MIME type → content (`text/plain`, `text/html`, base64 for binary types).
pub type MimeBundle = BTreeMap<String, String>;

/// A rich output of a cell (a chart).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Display {
    /// The decoded `image/png`, when the display has one.
    pub png: Option<Vec<u8>>,
    /// The other representations (`text/plain`, `text/html` …).
    pub data: MimeBundle,
    /// Where the agent saved the image under /home/user, when it did.
    pub path: Option<String>,
}

/// Output while a call runs, for progress notifications. Best effort: when the receiver falls
/// behind, events are dropped (the outcome still has all output up to the limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// A piece of stdout.
    Stdout(String),
    /// A piece of stderr.
    Stderr(String),
    /// A chart.
    Display(Display),
}

/// An exception raised by a cell.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CellError {
    /// Exception class, e.g. `ZeroDivisionError`.
    pub name: String,
    /// Its message.
    #[serde(default)]
    pub value: String,
    /// Plain-text traceback lines.
    #[serde(default)]
    pub traceback: Vec<String>,
}

/// What a cell did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecOutcome {
    /// Everything printed to stdout (by Python and child processes), up to the limit.
    pub stdout: String,
    /// Everything printed to stderr, up to the limit (the truncation marker lands here).
    pub stderr: String,
    /// The value of the last expression, `None` when there is none.
    pub result: Option<MimeBundle>,
    /// The exception, when the cell raised one (`KeyboardInterrupt` when interrupted).
    pub error: Option<CellError>,
    /// The kernel's execution counter for this cell (absent when the kernel was restarted).
    pub execution_count: Option<u64>,
    /// Charts and other rich outputs, in order.
    pub displays: Vec<Display>,
    /// Output (or images) beyond the limits were dropped.
    pub truncated: bool,
    /// The cell hit its timeout and was interrupted.
    pub timed_out: bool,
    /// The kernel's variables are gone: the cell did not stop when interrupted and the kernel was
    /// restarted, or the kernel died (during this cell, or since the previous one) and a fresh one
    /// took its place. Files in /home/user are kept.
    pub state_lost: bool,
    /// Why the state was lost, in words for the model (e.g. "the Python kernel was killed by
    /// SIGKILL …"), when it was.
    pub state_lost_reason: Option<String>,
    /// Wall time of the call.
    pub duration: Duration,
}

/// How to run a shell command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOptions {
    /// When the command's process group is killed.
    pub timeout: Duration,
    /// Most bytes of stdout and stderr together kept.
    pub output_limit: usize,
    /// Working directory under /home/user (default: /home/user).
    pub cwd: Option<String>,
}

impl Default for CommandOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            output_limit: 1 << 20,
            cwd: None,
        }
    }
}

/// What a shell command did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommandOutcome {
    /// Its stdout, up to the limit.
    pub stdout: String,
    /// Its stderr, up to the limit.
    pub stderr: String,
    /// Exit code, when it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    /// It hit its timeout and its process group was killed.
    pub timed_out: bool,
    /// Output beyond the limit was dropped.
    pub truncated: bool,
    /// Wall time of the call.
    pub duration: Duration,
}

/// A background job (PROTOCOL.md, `command` with `background`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Job {
    /// Its handle, e.g. `job-1`.
    pub id: String,
    /// Its main process inside the sandbox.
    pub pid: u64,
    /// The command line it runs.
    pub command: String,
    /// The file inside the sandbox its stdout and stderr go to.
    pub log: String,
    /// When it started, unix seconds.
    pub started: f64,
    /// Whether it is still running.
    pub running: bool,
    /// Its exit code, once it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
}

/// Space in the file system of /home/user (its quota), bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Space {
    /// The size of the file system.
    pub total: u64,
    /// Bytes in use.
    pub used: u64,
    /// Bytes still available.
    pub free: u64,
}

/// A file in the sandbox, as written or read.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FileInfo {
    /// Absolute path under /home/user.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Lower-case hex SHA-256 of the content.
    pub sha256: String,
    /// Space used and left in /home/user, when the agent reported it.
    #[serde(default)]
    pub space: Option<Space>,
}

/// The type of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else.
    Other,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DirEntry {
    /// File name.
    pub name: String,
    /// Its type.
    #[serde(rename = "type")]
    pub kind: EntryKind,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, unix seconds.
    pub modified: f64,
}

/// The agent's answer to a ping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct PingInfo {
    /// The agent's pid.
    pub pid: u64,
    /// Whether a cell is running.
    pub busy: bool,
    /// The kernel's pid (the process that runs cells).
    #[serde(default)]
    pub kernel_pid: Option<u64>,
}

/// The agent's answer to `preloaded` (PROTOCOL.md): whether the data stack's import has ended.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PreloadInfo {
    /// Whether the background import ended (done or failed) within the wait.
    pub done: bool,
    /// The kernel's pid, when it has one.
    #[serde(default)]
    pub kernel_pid: Option<u64>,
    /// The preloaded modules now in the kernel's `sys.modules`.
    pub modules: Vec<String>,
    /// The execution count the kernel's next cell gets.
    #[serde(default)]
    pub next_count: Option<u64>,
}

/// The agent's answer to `restored` (PROTOCOL.md): who it is now and what it re-seeded.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RestoredInfo {
    /// The sandbox id it took.
    pub sandbox_id: String,
    /// The agent's pid (a restore keeps it).
    pub pid: u64,
    /// The agent's generators re-seeded (`random`, `openssl`, …).
    pub reseeded: Vec<String>,
    /// The kernel's pid, when it has one.
    #[serde(default)]
    pub kernel_pid: Option<u64>,
    /// The kernel's generators re-seeded; `None` when no kernel was ready to answer.
    #[serde(default)]
    pub kernel_reseeded: Option<Vec<String>>,
}

/// A directory listing with the space used and left in /home/user.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Listing {
    /// The entries, sorted by name.
    pub entries: Vec<DirEntry>,
    /// Space used and left, when the agent reported it.
    #[serde(default)]
    pub space: Option<Space>,
}
