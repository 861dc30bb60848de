//! The transcript as one self-contained HTML page for a person taking over the conversation.
//!
//! Everything in a transcript came from untrusted code, so the page is built to run nothing:
//! every output is escaped text (an HTML result or `display(HTML(...))` shows as its source),
//! charts are `data:` PNG images, and the page has no script at all. Serve it with
//! [`CONTENT_SECURITY_POLICY`] so that even a rendering bug cannot make it active content.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::{Cell, Command, Entry, FileEvent, MimeBundle, Part, Transcript, human_bytes, plain};

/// The policy to serve the page with: a sandboxed document (an opaque origin: no scripts, no
/// forms, no access to the server's cookies), loading nothing but its own inline style and
/// `data:` images.
pub const CONTENT_SECURITY_POLICY: &str = "sandbox; default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const STYLE: &str = "body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1d2330}\
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #ccd}\
.entry{margin:1rem 0;border:1px solid #dde;border-radius:6px;padding:.5rem .8rem}\
.meta{color:#667;font-size:.8rem}pre{white-space:pre-wrap;word-break:break-word;margin:.3rem 0;padding:.4rem;background:#f5f6fa;border-radius:4px}\
pre.source{background:#eef3ff}pre.stderr,pre.error{background:#fff0f0}pre.html{background:#fffbe6}\
img{max-width:100%;border:1px solid #eee}.note{color:#955;font-style:italic}.mark{color:#345;font-weight:600}";

/// How an HTML result (`text/html`) is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HtmlResults {
    /// As its escaped source (the exported page: it has no frames).
    Source,
    /// Rendered in a sandboxed frame (`sandbox=""`: no script, an opaque origin) whose
    /// `srcdoc` inherits the embedding page's Content-Security-Policy, which must allow nothing
    /// remote (the console's: `default-src 'none'; img-src data:`).
    SandboxedFrame,
}

/// The parts of a transcript, for a page that has its own layout (the console).
pub fn render_parts(transcript: &Transcript, html_results: HtmlResults) -> Markup {
    html! {
        @for part in &transcript.parts {
            (render_part(transcript, part, html_results))
        }
    }
}

/// The page.
pub fn render(transcript: &Transcript) -> String {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="referrer" content="no-referrer";
                title { (transcript.title()) " · sandgate transcript" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                h1 { (transcript.title()) }
                p.meta {
                    "Exported from sandgate at " (transcript.exported_at.format("%Y-%m-%d %H:%M:%S UTC"))
                    ". Output is shown as text; nothing on this page runs."
                }
                @if let Some(note) = transcript.omitted.note() {
                    p.note.omitted { (note) }
                }
                @if transcript.parts.is_empty() {
                    p { "Nothing ran in this conversation's sandboxes." }
                }
                @for part in &transcript.parts {
                    (render_part(transcript, part, HtmlResults::Source))
                }
            }
        }
    };
    page.into_string()
}

fn render_part(transcript: &Transcript, part: &Part, html_results: HtmlResults) -> Markup {
    html! {
        section.part data-sandbox=(part.sandbox_id) {
            h2 { "Sandbox " code { (part.sandbox_id) } }
            p.meta {
                @if let Some(t) = part.started_at { "Started " (t.format("%Y-%m-%d %H:%M:%S UTC")) ". " }
                @match part.closed_at {
                    Some(t) => { "Ended " (t.format("%Y-%m-%d %H:%M:%S UTC")) "." }
                    None if html_results == HtmlResults::SandboxedFrame => { "Live." }
                    None => { "Still running at export." }
                }
            }
            @for record in &part.records {
                div.entry data-kind=(record.entry.kind()) data-seq=(record.seq)
                    data-by=(record.entry.actor().tag()) {
                    p.meta {
                        (record.at.format("%H:%M:%S UTC")) " · "
                        span.by { (record.entry.actor().describe()) }
                    }
                    @match &record.entry {
                        Entry::Cell(cell) => (render_cell(cell, html_results)),
                        Entry::Command(command) => (render_command(command)),
                        Entry::Upload(file) => (render_file("Uploaded", file)),
                        Entry::Fetch(file) => (render_file("Fetched", file)),
                        Entry::Pause(mark) => p.mark { (mark.describe()) },
                        Entry::Resume(mark) => p.mark { (mark.describe()) },
                        Entry::ForkedInto(mark) => p.mark { (mark.describe_into()) },
                        Entry::ForkedFrom(mark) => p.mark { (mark.describe_from()) },
                        Entry::Egress(note) => p.mark.egress { (note.describe()) },
                    }
                }
            }
            @if part.dropped > 0 {
                p.note.truncated { (transcript.bound.truncation_note(part.dropped)) }
                @if part.over_budget > 0 {
                    p.note.over-budget { (transcript.bound.budget_note(part.over_budget)) }
                }
            }
        }
    }
}

fn render_cell(cell: &Cell, html_results: HtmlResults) -> Markup {
    html! {
        p.meta {
            "In [" (cell.execution_count.map_or_else(|| " ".to_owned(), |n| n.to_string())) "] · "
            (cell.duration_ms) " ms"
        }
        pre.source { (cell.code) }
        (render_streams(&cell.stdout, &cell.stderr))
        @for display in &cell.displays { (render_bundle(display, html_results)) }
        @if let Some(result) = &cell.result {
            div.result { (render_bundle(result, html_results)) }
        }
        @if let Some(error) = &cell.error {
            pre.error { (error.traceback.join("\n")) "\n" (error.name) ": " (error.value) }
        }
        @if cell.timed_out { p.note { "Interrupted at its timeout." } }
        @if cell.state_lost { p.note { "The kernel was restarted: variables were lost." } }
        @if cell.truncated { p.note { "Output truncated." } }
    }
}

fn render_command(command: &Command) -> Markup {
    html! {
        p.meta { "Shell command · " (command.duration_ms) " ms" }
        pre.source { "$ " @if let Some(cwd) = &command.cwd { "cd " (cwd) " && " } (command.command) }
        (render_streams(&command.stdout, &command.stderr))
        @match (command.exit_code, command.signal) {
            (Some(0), _) => {}
            (Some(code), _) => { p.note { "Exit code " (code) "." } }
            (None, Some(sig)) => { p.note { "Killed by signal " (sig) "." } }
            (None, None) => { p.note { "No exit code." } }
        }
        @if command.timed_out { p.note { "Killed at its timeout." } }
        @if command.truncated { p.note { "Output truncated." } }
    }
}

fn render_file(verb: &str, file: &FileEvent) -> Markup {
    html! {
        p.file { (verb) " " code { (file.path) } " (" (human_bytes(file.size)) ", sha256 " code { (file.sha256) } ")" }
    }
}

fn render_streams(stdout: &str, stderr: &str) -> Markup {
    html! {
        @if !stdout.is_empty() { pre.stdout { (stdout) } }
        @if !stderr.is_empty() { pre.stderr { (stderr) } }
    }
}

/// A PNG as an image (only base64 text gets into the `data:` URL); anything else as its text,
/// HTML included, escaped.
fn render_bundle(bundle: &MimeBundle, html_results: HtmlResults) -> Markup {
    let png = bundle
        .get("image/png")
        .and_then(|v| v.as_str())
        .filter(|b64| {
            b64.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+/=\n".contains(&b))
        });
    html! {
        @if let Some(b64) = png {
            img alt="chart" src={ "data:image/png;base64," (b64.replace('\n', "")) };
        } @else if let Some(source) = bundle.get("text/html").and_then(|v| v.as_str()) {
            @if html_results == HtmlResults::SandboxedFrame {
                iframe.html sandbox="" title="HTML output" referrerpolicy="no-referrer" srcdoc=(source) {}
            } @else {
                p.meta { "HTML output, shown as its source:" }
                pre.html { (source) }
            }
        } @else if let Some(text) = plain(bundle) {
            pre.result { (text) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample;

    #[test]
    fn inside_the_console_html_results_are_sandboxed_frames_and_entries_name_who_ran_them() {
        let mut transcript = sample::transcript();
        transcript.parts[0].records[1]
            .entry
            .set_by("ana@example.com");
        let parts = render_parts(&transcript, HtmlResults::SandboxedFrame).into_string();
        assert!(
            parts.contains("<iframe class=\"html\" sandbox=\"\""),
            "an HTML result is a sandboxed frame: {parts}"
        );
        assert!(
            parts.contains("srcdoc=\"&lt;script&gt;"),
            "its source is an escaped attribute"
        );
        assert!(
            !parts.to_ascii_lowercase().contains("<script"),
            "no script element"
        );
        assert!(parts.contains("by ana@example.com") && parts.contains("by the bot"));
        let page = render(&transcript);
        assert!(!page.contains("<iframe"), "the exported page has no frame");
    }

    #[test]
    fn hostile_output_is_text_and_the_page_has_no_script() {
        let page = render(&sample::transcript());
        assert!(
            !page.to_ascii_lowercase().contains("<script"),
            "no script element at all"
        );
        assert!(
            page.contains("&lt;script&gt;document.title"),
            "the HTML output shows as source"
        );
        assert!(
            page.contains("Conversation ticket-&lt;1234&gt;"),
            "titles are escaped"
        );
        assert!(
            page.contains("src=\"data:image/png;base64,iVBOR"),
            "the chart is embedded"
        );
        assert!(page.contains("ZeroDivisionError: division by zero"));
        assert!(page.contains("2 later call(s)"), "truncation is marked");
    }

    #[test]
    fn pauses_resumes_and_forks_are_marked_and_name_the_other_sandbox() {
        let page = render(&sample::transcript());
        for (kind, text) in [
            ("pause", "Paused (idle past its timeout)"),
            ("resume", "Resumed after 1 h 2 min paused"),
            ("forked_into", "made as sandbox sbx_copy&lt;1&gt;"),
            ("forked_from", "Forked from sandbox sbx_source"),
        ] {
            let at = page
                .find(&format!("data-kind=\"{kind}\""))
                .unwrap_or_else(|| panic!("a {kind} entry: {page}"));
            let entry = &page[at..at + page[at..].find("</div>").expect("its end")];
            assert!(
                entry.contains(text),
                "the {kind} mark says {text:?}: {entry}"
            );
        }
        assert!(
            page.contains("data-by=\"sandgate\"") && page.contains("by sandgate (idle timeout)"),
            "a pause on idle is sandgate's, not the bot's"
        );
    }
}
