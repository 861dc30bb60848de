//! How tool outputs read: the structured content, and the text block a model (or a person)
//! reads beside it.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use rmcp::model::{CallToolResult, ContentBlock};
use serde::Serialize;

use sandgate_service::domain::{Job, Space};
use sandgate_service::{RESUMED_FROM_FILES, Resumed};

use super::schema::{ExecuteCodeOutput, JobOutput, ResumedOutput, SpaceOutput};

pub(super) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub(super) fn structured<T: Serialize>(
    value: &T,
    text: String,
    is_error: bool,
    extra: Vec<ContentBlock>,
) -> CallToolResult {
    let json = serde_json::to_value(value).expect("tool outputs serialize");
    let mut result = CallToolResult::structured(json);
    result.content = std::iter::once(ContentBlock::text(text))
        .chain(extra)
        .collect();
    result.is_error = Some(is_error);
    result
}

pub(super) fn absolute(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    if trimmed.is_empty() || trimmed == "." {
        "/home/user".into()
    } else if trimmed.starts_with('/') {
        trimmed.into()
    } else {
        format!("/home/user/{}", trimmed.trim_start_matches("./"))
    }
}

/// stdout as it was printed, then stderr under a marker, each ending in a newline.
pub(super) fn render_streams(stdout: &str, stderr: &str) -> String {
    let mut text = String::new();
    for (marker, stream) in [("", stdout), ("[stderr]\n", stderr)] {
        if !stream.is_empty() {
            text.push_str(marker);
            text.push_str(stream);
            if !stream.ends_with('\n') {
                text.push('\n');
            }
        }
    }
    text
}

/// A notebook-like rendering of a cell's outcome for the text block.
pub(super) fn render_cell(out: &ExecuteCodeOutput, timeout: Duration) -> String {
    let mut text = render_streams(&out.stdout, &out.stderr);
    if let Some(plain) = out.result.as_ref().and_then(|r| r.text_plain.as_ref()) {
        match out.execution_count {
            Some(n) => text.push_str(&format!("Out[{n}]: {plain}\n")),
            None => text.push_str(&format!("Out: {plain}\n")),
        }
    }
    for image in &out.images {
        match &image.path {
            Some(path) => text.push_str(&format!("[chart: {path}]\n")),
            None => text.push_str("[chart]\n"),
        }
    }
    if let Some(error) = &out.error {
        let summary = format!("{}: {}", error.name, error.value);
        let traceback = error.traceback.join("\n");
        text.push_str(&traceback);
        if !traceback.is_empty() {
            text.push('\n');
        }
        // IPython's traceback already ends with "Name: value"; the plain kernel's may not.
        if !traceback.trim_end().ends_with(summary.trim_end()) {
            text.push_str(&summary);
            text.push('\n');
        }
    }
    if out.timed_out {
        text.push_str(&format!(
            "[interrupted after the {} s timeout]\n",
            timeout.as_secs()
        ));
    }
    let from_files = out.resumed.as_ref().is_some_and(|r| r.from_files);
    if out.state_lost && out.previous_sandbox.is_some() {
        let why = out.state_lost_reason.as_deref().unwrap_or_default();
        text.push_str(&format!("[{why}]\n"));
    } else if out.state_lost && !from_files {
        let why = out
            .state_lost_reason
            .as_deref()
            .unwrap_or("the Python kernel was restarted");
        text.push_str(&format!(
            "[{why}: variables are gone, files in /home/user are kept]\n"
        ));
    }
    if out.truncated {
        text.push_str("[output truncated]\n");
    }
    if text.is_empty() {
        text.push_str("(no output)\n");
    }
    if let Some(resumed) = &out.resumed {
        if resumed.from_files {
            text.push_str(&format!(
                "[sandbox {} {RESUMED_FROM_FILES} (paused {:.0} s; its runtime cannot \
                 checkpoint): files in /home/user are back]\n",
                out.sandbox_id, resumed.paused_seconds
            ));
            if let Some(missing) = files_missing_note(resumed) {
                text.push_str(&format!("[{missing}]\n"));
            }
        } else {
            text.push_str(&format!(
                "[resumed sandbox {} after {:.0} s paused: variables and files kept]\n",
                out.sandbox_id, resumed.paused_seconds
            ));
        }
    }
    text.push_str(&format!("[sandbox {}]", out.sandbox_id));
    text
}

impl From<Job> for JobOutput {
    fn from(job: Job) -> Self {
        let started = chrono::DateTime::from_timestamp_millis((job.started * 1000.0) as i64)
            .map(rfc3339)
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

impl From<Space> for SpaceOutput {
    fn from(space: Space) -> Self {
        Self {
            used_bytes: space.used,
            free_bytes: space.free,
        }
    }
}

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

/// What of a resume from files did not come back, in one line.
fn files_missing_note(resumed: &ResumedOutput) -> Option<String> {
    let mut parts = Vec::new();
    if !resumed.packages_not_reinstalled.is_empty() {
        parts.push(format!(
            "packages not reinstalled: {}",
            resumed.packages_not_reinstalled.join(", ")
        ));
    }
    if !resumed.files_not_restored.is_empty() {
        parts.push(format!(
            "not restored: {}",
            resumed.files_not_restored.join(", ")
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

impl From<&Resumed> for ResumedOutput {
    fn from(r: &Resumed) -> Self {
        let files = r.files.clone().unwrap_or_default();
        let mut not_reinstalled = files.packages_not_reinstalled;
        if let (Some(note), false) = (files.packages_note, not_reinstalled.is_empty()) {
            not_reinstalled.push(format!("({note})"));
        }
        Self {
            paused_seconds: r.paused_seconds,
            from_files: r.files.is_some(),
            packages_reinstalled: files.packages_reinstalled,
            packages_not_reinstalled: not_reinstalled,
            files_not_restored: files.files_not_restored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
