//! What ran in a sandbox, kept so a person can take over a conversation: every cell and command
//! (code, output, result, error, charts, duration, time), every file uploaded or fetched (name,
//! size, hash; never the file itself), and the marks of what happened to the sandbox itself:
//! its pauses, its resumes (after how long) and its forks (naming the other sandbox).
//!
//! - [`Entry`]: one thing that happened, as stored (JSON) by the gateway.
//! - [`Transcript`]: a conversation's entries, sandbox by sandbox, with what was not kept.
//! - [`notebook`]: the transcript as a Jupyter notebook (nbformat 4.5).
//! - [`html`]: the transcript as one self-contained HTML page that runs nothing.
//!
//! This crate knows nothing of Postgres, HTTP or Docker: the gateway fills a [`Transcript`]
//! from the store and hands it to a renderer.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub mod html;
pub mod notebook;

/// A Jupyter MIME bundle: MIME type to its representation (images base64-encoded).
pub type MimeBundle = BTreeMap<String, serde_json::Value>;

/// One thing that happened in a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A Python cell (`execute_code`).
    Cell(Cell),
    /// A shell command (`run_terminal_command`).
    Command(Command),
    /// A file the model uploaded into the sandbox (`upload_file`).
    Upload(FileEvent),
    /// A file the model fetched from the sandbox (`get_file`).
    Fetch(FileEvent),
    /// The sandbox was paused: checkpointed into the snapshot store, its container removed.
    Pause(PauseMark),
    /// The sandbox was resumed from a pause.
    Resume(ResumeMark),
    /// A copy of this sandbox was made (`fork_sandbox`, the console's copy): the mark in the
    /// source's transcript, naming the copy.
    ForkedInto(ForkMark),
    /// This sandbox began as a copy of another: the mark in the copy's transcript, naming the
    /// source.
    ForkedFrom(ForkMark),
    /// The egress connections of the call just before it (a cell or a command), opened or
    /// refused.
    Egress(EgressNote),
}

impl Entry {
    /// Who ran it: the person's email for a console run, `None` for the bot.
    pub fn by(&self) -> Option<&str> {
        match self {
            Entry::Cell(c) => c.by.as_deref(),
            Entry::Command(c) => c.by.as_deref(),
            Entry::Upload(f) | Entry::Fetch(f) => f.by.as_deref(),
            Entry::Pause(m) => m.by.as_deref(),
            Entry::Resume(m) => m.by.as_deref(),
            Entry::ForkedInto(m) | Entry::ForkedFrom(m) => m.by.as_deref(),
            Entry::Egress(n) => n.by.as_deref(),
        }
    }

    /// Who it was, as a reader sees it: the person, sandgate itself (a pause on idle), or the
    /// bot.
    pub fn actor(&self) -> Actor<'_> {
        match (self.by(), self) {
            (Some(person), _) => Actor::Person(person),
            (
                None,
                Entry::Pause(PauseMark {
                    cause: PauseCause::Idle,
                    ..
                }),
            ) => Actor::Sandgate,
            (None, _) => Actor::Bot,
        }
    }

    /// Marks the entry as a person's (their email).
    pub fn set_by(&mut self, person: &str) {
        let by = Some(person.to_owned());
        match self {
            Entry::Cell(c) => c.by = by,
            Entry::Command(c) => c.by = by,
            Entry::Upload(f) | Entry::Fetch(f) => f.by = by,
            Entry::Pause(m) => m.by = by,
            Entry::Resume(m) => m.by = by,
            Entry::ForkedInto(m) | Entry::ForkedFrom(m) => m.by = by,
            Entry::Egress(n) => n.by = by,
        }
    }

    /// The entry's kind as stored beside it (for queries that need no JSON).
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::Cell(_) => "cell",
            Entry::Command(_) => "command",
            Entry::Upload(_) => "upload",
            Entry::Fetch(_) => "fetch",
            Entry::Pause(_) => "pause",
            Entry::Resume(_) => "resume",
            Entry::ForkedInto(_) => "forked_into",
            Entry::ForkedFrom(_) => "forked_from",
            Entry::Egress(_) => "egress",
        }
    }
}

/// Who did what an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Actor<'a> {
    /// A signed-in person, from the console (their email).
    Person(&'a str),
    /// The bot, through MCP.
    Bot,
    /// sandgate itself (a pause of a sandbox idle past its timeout).
    Sandgate,
}

impl Actor<'_> {
    /// `by ana@example.com`, `by the bot`, `by sandgate (idle timeout)`.
    pub fn describe(&self) -> String {
        match self {
            Actor::Person(p) => format!("by {p}"),
            Actor::Bot => "by the bot".to_owned(),
            Actor::Sandgate => "by sandgate (idle timeout)".to_owned(),
        }
    }

    /// The short form of a page's `data-by` attribute: the person, `bot` or `sandgate`.
    pub fn tag(&self) -> &str {
        match self {
            Actor::Person(p) => p,
            Actor::Bot => "bot",
            Actor::Sandgate => "sandgate",
        }
    }
}

/// Why a sandbox was paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseCause {
    /// It was idle past its timeout (sandgate's reaper).
    Idle,
    /// `pause_sandbox` asked for it.
    Asked,
}

/// The egress connections of one call: a line each, as the audit trail has them (target, how it
/// ended, bytes each way, the secrets put in by name; or the refusal), never what they carried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EgressNote {
    /// One line per connection, in the order they ended.
    pub connections: Vec<String>,
    /// Connections of the call not listed (past the note's bound).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub more: u64,
    /// The person whose call it was (their email); `None`: the bot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl EgressNote {
    /// The sentence a reader sees.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "Egress during the call above ({} connection{}): {}",
            self.connections.len() as u64 + self.more,
            if self.connections.len() as u64 + self.more == 1 {
                ""
            } else {
                "s"
            },
            self.connections.join("; ")
        );
        if self.more > 0 {
            text.push_str(&format!("; and {} more", self.more));
        }
        text
    }
}

/// A pause of the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PauseMark {
    /// Why.
    pub cause: PauseCause,
    /// The person who paused it from the console (their email); `None`: the bot, or sandgate
    /// for a pause on idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

impl PauseMark {
    /// The sentence a reader sees.
    pub fn describe(&self) -> String {
        let why = match self.cause {
            PauseCause::Idle => "idle past its timeout",
            PauseCause::Asked => "pause_sandbox asked for it",
        };
        format!(
            "Paused ({why}): its memory and files were kept in the snapshot store and its \
             container removed; the next call resumes it."
        )
    }
}

/// A resume of the sandbox from a pause.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeMark {
    /// How long it was paused, seconds.
    pub paused_seconds: f64,
    /// The person whose console call resumed it (their email); `None`: the bot's call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

impl ResumeMark {
    /// The sentence a reader sees.
    pub fn describe(&self) -> String {
        format!(
            "Resumed after {} paused, with its variables and files.",
            human_duration(self.paused_seconds)
        )
    }
}

/// A fork: the other sandbox of the pair (the copy in the source's mark, the source in the
/// copy's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkMark {
    /// The other sandbox, `sbx_…`.
    pub sandbox_id: String,
    /// The person who forked it from the console (their email); `None`: the bot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

impl ForkMark {
    /// The sentence a reader sees in the source's transcript.
    pub fn describe_into(&self) -> String {
        format!(
            "Forked: a copy of this sandbox's memory and files was made as sandbox {}; what \
             runs there is in its own transcript.",
            self.sandbox_id
        )
    }

    /// The sentence a reader sees in the copy's transcript.
    pub fn describe_from(&self) -> String {
        format!(
            "Forked from sandbox {}: this sandbox began as a copy of its memory and files; what \
             ran before is in that sandbox's transcript.",
            self.sandbox_id
        )
    }
}

/// A Python cell and what it produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// The source.
    pub code: String,
    /// stdout (including child processes').
    pub stdout: String,
    /// stderr.
    pub stderr: String,
    /// The value of the last expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<MimeBundle>,
    /// The exception it raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CellError>,
    /// Charts and other rich outputs (`display(...)`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub displays: Vec<MimeBundle>,
    /// The kernel's execution counter.
    #[serde(default)]
    pub execution_count: Option<u64>,
    /// Output beyond the gateway's per-call limit was dropped.
    #[serde(default)]
    pub truncated: bool,
    /// Interrupted at its timeout.
    #[serde(default)]
    pub timed_out: bool,
    /// The kernel was restarted (variables lost).
    #[serde(default)]
    pub state_lost: bool,
    /// Wall time, milliseconds.
    pub duration_ms: u64,
    /// The person who ran it from the console (their email); `None`: the bot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellError {
    /// Exception class.
    pub name: String,
    /// Message.
    pub value: String,
    /// Plain-text traceback lines.
    pub traceback: Vec<String>,
}

/// A shell command and what it produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Command {
    /// The command line.
    pub command: String,
    /// Its working directory, when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// stdout.
    pub stdout: String,
    /// stderr.
    pub stderr: String,
    /// Exit code.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Killed at its timeout.
    #[serde(default)]
    pub timed_out: bool,
    /// Output beyond the per-call limit was dropped.
    #[serde(default)]
    pub truncated: bool,
    /// Wall time, milliseconds.
    pub duration_ms: u64,
    /// The person who ran it from the console (their email); `None`: the bot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// A file that went into or out of the sandbox: what it was, not what it held.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEvent {
    /// Absolute path in the sandbox.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
    /// The person who moved it from the console (their email); `None`: the bot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// An entry with its place and time.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Position in its sandbox's transcript, from 1.
    pub seq: i32,
    /// When the call finished.
    pub at: DateTime<Utc>,
    /// What happened.
    pub entry: Entry,
}

/// One sandbox's part of a transcript.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// `sbx_…`.
    pub sandbox_id: String,
    /// When the sandbox was leased.
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended, if it has.
    pub closed_at: Option<DateTime<Utc>>,
    /// What was kept, in order.
    pub records: Vec<Record>,
    /// Entries that were not kept because the sandbox's transcript was full, or its tenant's
    /// transcripts were at their byte budget (those are also in `over_budget`).
    pub dropped: u32,
    /// Of `dropped`, the entries not kept because the tenant's transcripts were at their byte
    /// budget.
    pub over_budget: u32,
}

/// How much of a sandbox's activity a transcript keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// Most entries kept per sandbox.
    pub max_entries: u32,
    /// Most bytes (of stored JSON) kept per sandbox.
    pub max_bytes: u64,
    /// Most bytes (of stored JSON) kept over all of a tenant's transcripts.
    pub tenant_max_bytes: u64,
}

impl Bound {
    /// The sentence a reader sees where entries were dropped.
    pub fn truncation_note(&self, dropped: u32) -> String {
        format!(
            "[transcript truncated: {dropped} later call(s) in this sandbox were not kept; a \
             sandbox's transcript keeps its first {} calls and at most {} of output]",
            self.max_entries,
            human_bytes(self.max_bytes)
        )
    }

    /// The sentence a reader sees where entries were dropped because the tenant's transcripts
    /// were at their byte budget.
    pub fn budget_note(&self, over_budget: u32) -> String {
        format!(
            "[{over_budget} of them were not kept because your tenant's stored transcripts \
             reached their budget of {}; they free as older transcripts reach the end of their \
             retention]",
            human_bytes(self.tenant_max_bytes)
        )
    }
}

/// What one load of a conversation's transcript left out: its oldest sandboxes beyond the
/// load's bound in parts or bytes (the newest are kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Omitted {
    /// Sandboxes left out.
    pub parts: u32,
    /// Their calls.
    pub calls: u64,
    /// Their stored bytes.
    pub bytes: u64,
}

impl Omitted {
    /// The sentence a reader sees at the top of an export that left sandboxes out; `None`
    /// when nothing was left out.
    pub fn note(&self) -> Option<String> {
        (self.parts > 0).then(|| {
            format!(
                "[this export leaves out the conversation's {} oldest sandbox(es) ({} call(s), {} \
                 stored): one export holds only its newest sandboxes; export an older one by its \
                 sandbox id]",
                self.parts,
                self.calls,
                human_bytes(self.bytes)
            )
        })
    }
}

/// A conversation's transcript: its sandboxes' parts, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    /// The conversation, when the sandboxes were bound to one.
    pub conversation_id: Option<String>,
    /// Sandbox by sandbox.
    pub parts: Vec<Part>,
    /// The bound each part was kept under.
    pub bound: Bound,
    /// The oldest sandboxes this export left out.
    pub omitted: Omitted,
    /// When this export was made.
    pub exported_at: DateTime<Utc>,
}

impl Transcript {
    /// A short title: the conversation, else the sandbox.
    pub fn title(&self) -> String {
        match (&self.conversation_id, self.parts.first()) {
            (Some(c), _) => format!("Conversation {c}"),
            (None, Some(p)) => format!("Sandbox {}", p.sandbox_id),
            (None, None) => "Empty transcript".to_owned(),
        }
    }
}

/// `1536` → `1.5 KiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["bytes", "KiB", "MiB", "GiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} bytes")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `3.2` → `3 s`, `4000` → `1 h 6 min`, `200000` → `2 d 7 h`: a length of time as a person
/// would say it (to the second under a minute).
pub fn human_duration(seconds: f64) -> String {
    let total = if seconds.is_finite() && seconds > 0.0 {
        seconds.round() as u64
    } else {
        0
    };
    let (d, h, m, s) = (
        total / 86_400,
        total % 86_400 / 3600,
        total % 3600 / 60,
        total % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s} s"),
        (0, 0, _) => format!("{m} min {s} s"),
        (0, _, _) => format!("{h} h {m} min"),
        _ => format!("{d} d {h} h"),
    }
}

/// The `text/plain` of a bundle, when it has one.
pub(crate) fn plain(bundle: &MimeBundle) -> Option<&str> {
    bundle.get("text/plain").and_then(|v| v.as_str())
}

#[cfg(test)]
pub(crate) mod sample {
    use super::*;

    /// A transcript with one of everything, including hostile output.
    pub fn transcript() -> Transcript {
        let at = DateTime::from_timestamp(1_800_000_000, 0).expect("a valid time");
        let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
        let entries = vec![
            Entry::Upload(FileEvent {
                path: "/home/user/orders.csv".into(),
                size: 39,
                sha256: "c9a2".into(),
                by: None,
            }),
            Entry::Cell(Cell {
                code: "print('hi')\n1 + 1".into(),
                stdout: "hi\n".into(),
                result: Some(BTreeMap::from([("text/plain".into(), "2".into())])),
                execution_count: Some(1),
                duration_ms: 3,
                ..Cell::default()
            }),
            Entry::Cell(Cell {
                code: "plt.plot([1, 2]); plt.show()".into(),
                displays: vec![BTreeMap::from([
                    ("image/png".into(), png.into()),
                    ("text/plain".into(), "<Figure>".into()),
                ])],
                execution_count: Some(2),
                duration_ms: 40,
                ..Cell::default()
            }),
            Entry::Cell(Cell {
                code: "display(HTML('<script>document.title = \"pwned\"</script>'))".into(),
                displays: vec![BTreeMap::from([(
                    "text/html".into(),
                    "<script>document.title = \"pwned\"</script>".into(),
                )])],
                execution_count: Some(3),
                duration_ms: 2,
                ..Cell::default()
            }),
            Entry::Cell(Cell {
                code: "1 / 0".into(),
                error: Some(CellError {
                    name: "ZeroDivisionError".into(),
                    value: "division by zero".into(),
                    traceback: vec![
                        "Traceback".into(),
                        "ZeroDivisionError: division by zero".into(),
                    ],
                }),
                execution_count: Some(4),
                duration_ms: 1,
                ..Cell::default()
            }),
            Entry::Command(Command {
                command: "ls && exit 3".into(),
                stdout: "orders.csv\n".into(),
                exit_code: Some(3),
                duration_ms: 5,
                ..Command::default()
            }),
            Entry::Fetch(FileEvent {
                path: "/home/user/outputs/figure-2-1.png".into(),
                size: 68,
                sha256: "ab12".into(),
                by: None,
            }),
            Entry::Pause(PauseMark {
                cause: PauseCause::Idle,
                by: None,
            }),
            Entry::Resume(ResumeMark {
                paused_seconds: 3725.4,
                by: None,
            }),
            Entry::ForkedInto(ForkMark {
                sandbox_id: "sbx_copy<1>".into(),
                by: Some("ana@example.com".into()),
            }),
            Entry::ForkedFrom(ForkMark {
                sandbox_id: "sbx_source".into(),
                by: None,
            }),
        ];
        Transcript {
            conversation_id: Some("ticket-<1234>".into()),
            parts: vec![Part {
                sandbox_id: "sbx_test".into(),
                started_at: Some(at),
                closed_at: None,
                records: entries
                    .into_iter()
                    .enumerate()
                    .map(|(i, entry)| Record {
                        seq: i as i32 + 1,
                        at,
                        entry,
                    })
                    .collect(),
                dropped: 2,
                over_budget: 1,
            }],
            bound: Bound {
                max_entries: 7,
                max_bytes: 1 << 20,
                tenant_max_bytes: 1 << 30,
            },
            omitted: Omitted {
                parts: 3,
                calls: 12,
                bytes: 4096,
            },
            exported_at: at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_as_tagged_json() {
        for record in sample::transcript().parts[0].records.iter() {
            let json = serde_json::to_value(&record.entry).expect("serializes");
            assert_eq!(json["kind"], record.entry.kind());
            let back: Entry = serde_json::from_value(json).expect("deserializes");
            assert_eq!(back, record.entry);
        }
    }

    #[test]
    fn durations_read_like_a_person_said_them() {
        assert_eq!(human_duration(3.2), "3 s");
        assert_eq!(human_duration(75.0), "1 min 15 s");
        assert_eq!(human_duration(3725.4), "1 h 2 min");
        assert_eq!(human_duration(200_000.0), "2 d 7 h");
        assert_eq!(human_duration(f64::NAN), "0 s");
    }

    #[test]
    fn a_pause_on_idle_is_sandgates_and_a_mark_with_a_person_is_theirs() {
        let records = &sample::transcript().parts[0].records;
        let actor = |kind: &str| {
            records
                .iter()
                .find(|r| r.entry.kind() == kind)
                .map(|r| r.entry.actor())
                .expect("the sample has one")
        };
        assert_eq!(actor("pause"), Actor::Sandgate);
        assert_eq!(actor("resume"), Actor::Bot);
        assert_eq!(actor("forked_into"), Actor::Person("ana@example.com"));
    }

    #[test]
    fn sizes_read_like_a_person_wrote_them() {
        assert_eq!(human_bytes(39), "39 bytes");
        assert_eq!(human_bytes(16 << 20), "16.0 MiB");
    }
}
