//! The transcript as a Jupyter notebook (nbformat 4.5): each cell with its outputs (streams,
//! result, charts as embedded PNG, error with traceback), each command as a `%%bash` cell, each
//! file as a note, so a person can open it in JupyterLab or VS Code and re-run it.

use serde_json::{Value, json};

use crate::{Cell, Command, Entry, FileEvent, MimeBundle, Part, Transcript, human_bytes};

/// The notebook as JSON (serialize it with `serde_json::to_vec`).
pub fn render(transcript: &Transcript) -> Value {
    let mut cells = vec![markdown("header", &header(transcript))];
    for part in &transcript.parts {
        cells.push(markdown(
            &format!("{}-start", part.sandbox_id),
            &part_header(part),
        ));
        for record in &part.records {
            let id = format!("{}-{}", part.sandbox_id, record.seq);
            let when = record.at.format("%Y-%m-%d %H:%M:%S UTC").to_string();
            cells.push(match &record.entry {
                Entry::Cell(cell) => code_cell(&id, &when, cell),
                Entry::Command(command) => command_cell(&id, &when, command),
                Entry::Upload(file) => markdown(&id, &file_note("Uploaded", &when, file)),
                Entry::Fetch(file) => markdown(&id, &file_note("Fetched", &when, file)),
                Entry::Pause(mark) => markdown(&id, &mark_note(&when, record, &mark.describe())),
                Entry::Resume(mark) => markdown(&id, &mark_note(&when, record, &mark.describe())),
                Entry::ForkedInto(mark) => {
                    markdown(&id, &mark_note(&when, record, &mark.describe_into()))
                }
                Entry::ForkedFrom(mark) => {
                    markdown(&id, &mark_note(&when, record, &mark.describe_from()))
                }
                Entry::Egress(note) => markdown(&id, &mark_note(&when, record, &note.describe())),
            });
        }
        if part.dropped > 0 {
            cells.push(markdown(
                &format!("{}-truncated", part.sandbox_id),
                &transcript.bound.truncation_note(part.dropped),
            ));
        }
        if part.over_budget > 0 {
            cells.push(markdown(
                &format!("{}-over-budget", part.sandbox_id),
                &transcript.bound.budget_note(part.over_budget),
            ));
        }
    }
    json!({
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
            "sandgate": {
                "conversation_id": transcript.conversation_id,
                "sandboxes": transcript.parts.iter().map(|p| p.sandbox_id.clone()).collect::<Vec<_>>(),
                "exported_at": transcript.exported_at.to_rfc3339(),
            },
        },
        "cells": cells,
    })
}

fn header(t: &Transcript) -> String {
    let mut text = format!(
        "# {}\n\nExported from sandgate at {}. Cells ran in the order below; re-running them \
         needs the uploaded files (listed where they arrived).",
        md_escape(&t.title()),
        t.exported_at.format("%Y-%m-%d %H:%M:%S UTC")
    );
    if let Some(note) = t.omitted.note() {
        text.push_str("\n\n");
        text.push_str(&note);
    }
    if t.parts.is_empty() {
        text.push_str("\n\nNothing ran in this conversation's sandboxes.");
    }
    text
}

fn part_header(part: &Part) -> String {
    let when = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or_else(
            || "—".to_owned(),
            |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        )
    };
    format!(
        "## Sandbox `{}`\n\nStarted {}; {}.",
        part.sandbox_id,
        when(part.started_at),
        match part.closed_at {
            Some(t) => format!("ended {}", when(Some(t))),
            None => "still running at export".to_owned(),
        }
    )
}

fn markdown(id: &str, text: &str) -> Value {
    json!({"cell_type": "markdown", "id": cell_id(id), "metadata": {}, "source": text})
}

/// nbformat 4.5 ids: 1–64 of `[A-Za-z0-9_-]`.
fn cell_id(raw: &str) -> String {
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect()
}

fn code_cell(id: &str, when: &str, cell: &Cell) -> Value {
    let mut outputs = streams(&cell.stdout, &cell.stderr);
    for display in &cell.displays {
        outputs.push(json!({"output_type": "display_data", "data": data(display), "metadata": {}}));
    }
    if let Some(result) = &cell.result {
        outputs.push(json!({
            "output_type": "execute_result",
            "execution_count": cell.execution_count,
            "data": data(result),
            "metadata": {},
        }));
    }
    if let Some(error) = &cell.error {
        outputs.push(json!({
            "output_type": "error",
            "ename": error.name,
            "evalue": error.value,
            "traceback": error.traceback,
        }));
    }
    let mut notes = Vec::new();
    if cell.timed_out {
        notes.push("[interrupted at its timeout]");
    }
    if cell.state_lost {
        notes.push("[the kernel was restarted: variables were lost]");
    }
    if cell.truncated {
        notes.push("[output truncated]");
    }
    if !notes.is_empty() {
        outputs.push(stream("stderr", &format!("{}\n", notes.join("\n"))));
    }
    json!({
        "cell_type": "code",
        "id": cell_id(id),
        "execution_count": cell.execution_count,
        "metadata": {"sandgate": by_person(json!({"ran_at": when, "duration_ms": cell.duration_ms}), cell.by.as_deref())},
        "source": cell.code,
        "outputs": outputs,
    })
}

fn command_cell(id: &str, when: &str, command: &Command) -> Value {
    let mut outputs = streams(&command.stdout, &command.stderr);
    let status = match (command.exit_code, command.signal) {
        (Some(0), _) => None,
        (Some(code), _) => Some(format!("[exit code {code}]")),
        (None, Some(sig)) => Some(format!("[killed by signal {sig}]")),
        (None, None) => Some("[no exit code]".to_owned()),
    };
    let mut notes: Vec<String> = status.into_iter().collect();
    if command.timed_out {
        notes.push("[killed at its timeout]".into());
    }
    if command.truncated {
        notes.push("[output truncated]".into());
    }
    if !notes.is_empty() {
        outputs.push(stream("stderr", &format!("{}\n", notes.join("\n"))));
    }
    let cd = command
        .cwd
        .as_deref()
        .map(|d| format!("cd {}\n", shell_quote(d)))
        .unwrap_or_default();
    json!({
        "cell_type": "code",
        "id": cell_id(id),
        "execution_count": null,
        "metadata": {"sandgate": by_person(json!({"ran_at": when, "duration_ms": command.duration_ms, "exit_code": command.exit_code}), command.by.as_deref())},
        "source": format!("%%bash\n{cd}{}", command.command),
        "outputs": outputs,
    })
}

fn file_note(verb: &str, when: &str, file: &FileEvent) -> String {
    format!(
        "{verb} `{}` ({}, sha256 `{}`) at {when}.",
        code_span_text(&file.path),
        human_bytes(file.size),
        file.sha256
    )
}

/// A mark (a pause, a resume, a fork) as a note: its sentence, when, and who.
fn mark_note(when: &str, record: &crate::Record, sentence: &str) -> String {
    format!(
        "**{}** ({when}, {})",
        md_escape(sentence),
        md_escape(&record.entry.actor().describe())
    )
}

/// A name chosen by untrusted code, made safe inside a one-line code span: no backtick (it
/// would end the span) and no line break or other control character (a blank line ends the
/// paragraph, and markdown after it, an external image say, would be rendered).
fn code_span_text(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '`' => '\'',
            c if c.is_control() => '\u{fffd}',
            c => c,
        })
        .collect()
}

fn streams(stdout: &str, stderr: &str) -> Vec<Value> {
    [("stdout", stdout), ("stderr", stderr)]
        .into_iter()
        .filter(|(_, text)| !text.is_empty())
        .map(|(name, text)| stream(name, text))
        .collect()
}

fn stream(name: &str, text: &str) -> Value {
    json!({"output_type": "stream", "name": name, "text": text})
}

/// A bundle as nbformat wants it: string representations (and JSON for `*json` types) only.
fn data(bundle: &MimeBundle) -> Value {
    let mut out = serde_json::Map::new();
    for (mime, value) in bundle {
        let keep = value.is_string() || (mime.ends_with("json") && value.is_object());
        if keep {
            out.insert(mime.clone(), value.clone());
        }
    }
    if !out.contains_key("text/plain") {
        out.insert("text/plain".into(), Value::String(String::new()));
    }
    Value::Object(out)
}

fn md_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| match c {
            '\\' | '`' | '*' | '_' | '[' | ']' | '<' | '>' | '#' => vec!['\\', c],
            c if c.is_control() => vec![' '],
            c => vec![c],
        })
        .collect()
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A cell's `sandgate` metadata, with `by` (the person's email) when a person ran it.
fn by_person(mut metadata: Value, by: Option<&str>) -> Value {
    if let (Some(by), Some(map)) = (by, metadata.as_object_mut()) {
        map.insert("by".to_owned(), Value::String(by.to_owned()));
    }
    metadata
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample;

    #[test]
    fn a_file_name_cannot_inject_markdown() {
        let file = FileEvent {
            path: "/home/user/a`\n\n![x](http://127.0.0.1:9/p.png)\r\r# H".into(),
            size: 1,
            sha256: "00".into(),
            by: None,
        };
        let note = file_note("Fetched", "now", &file);
        assert!(!note.contains('\n') && !note.contains('\r'), "{note:?}");
        assert_eq!(
            note.matches('`').count(),
            4,
            "two code spans only: {note:?}"
        );
    }

    #[test]
    fn pauses_resumes_and_forks_are_notes_naming_the_other_sandbox() {
        let nb = render(&sample::transcript());
        let sources: Vec<&str> = nb["cells"]
            .as_array()
            .expect("cells")
            .iter()
            .filter(|c| c["cell_type"] == "markdown")
            .filter_map(|c| c["source"].as_str())
            .collect();
        let note = |needle: &str| {
            sources
                .iter()
                .find(|s| s.contains(needle))
                .unwrap_or_else(|| panic!("a note with {needle:?}: {sources:?}"))
                .to_string()
        };
        assert!(note("Paused (idle past its timeout)").contains("by sandgate (idle timeout)"));
        assert!(note("Resumed after 1 h 2 min paused").contains("by the bot"));
        assert!(
            note("Forked: a copy").contains(r"sbx\_copy\<1\>"),
            "the copy is named, escaped"
        );
        assert!(note(r"Forked from sandbox sbx\_source").contains("by the bot"));
    }

    #[test]
    fn cells_keep_their_outputs_and_charts() {
        let nb = render(&sample::transcript());
        assert_eq!(
            (nb["nbformat"].as_u64(), nb["nbformat_minor"].as_u64()),
            (Some(4), Some(5))
        );
        let cells = nb["cells"].as_array().expect("cells");
        let code: Vec<&Value> = cells.iter().filter(|c| c["cell_type"] == "code").collect();
        assert_eq!(code.len(), 5, "four cells and one command");
        assert_eq!(code[0]["outputs"][0]["text"], "hi\n");
        assert_eq!(code[0]["outputs"][1]["output_type"], "execute_result");
        assert!(
            code[1]["outputs"][0]["data"]["image/png"]
                .as_str()
                .is_some_and(|s| s.starts_with("iVBOR"))
        );
        assert_eq!(code[3]["outputs"][0]["ename"], "ZeroDivisionError");
        assert!(
            code[4]["source"]
                .as_str()
                .is_some_and(|s| s.starts_with("%%bash\n"))
        );
        let (truncated, budget) = (&cells[cells.len() - 2], cells.last().expect("a last cell"));
        assert!(
            truncated["source"]
                .as_str()
                .is_some_and(|s| s.contains("2 later call(s)"))
        );
        assert!(
            budget["source"]
                .as_str()
                .is_some_and(|s| s.contains("1 of them") && s.contains("budget of 1.0 GiB")),
            "{budget}"
        );
        let header = cells[0]["source"].as_str().expect("a header");
        assert!(
            header.contains("leaves out the conversation's 3 oldest sandbox(es) (12 call(s)"),
            "the export says what it left out: {header}"
        );
        for cell in cells {
            let id = cell["id"].as_str().expect("an id");
            assert!(
                !id.is_empty()
                    && id.len() <= 64
                    && id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "{id}"
            );
        }
    }
}
