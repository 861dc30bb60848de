//! Running a cell or a command end to end, for any face: resolve the target sandbox, run the
//! call with the tenant's package index served beside it, stream its output to the face,
//! record and explain a sandbox that died underneath, and keep the transcript entry.
//!
//! Cancellation is the face's: dropping the returned future interrupts the cell or kills the
//! command (the sandbox's kernel survives an interrupt). A person may also interrupt a running
//! call from the console (`people`): the call then answers with its output until then
//! (`partial`) and that a person interrupted it.

use std::time::Duration;

use sandgate_sandbox::{
    CellError, CommandOptions, CommandOutcome, ExecOptions, ExecOutcome, OutputEvent,
};
use sandgate_transcript::Entry;
use tokio::sync::mpsc;

use super::partial::{self, Partial};
use super::{Caller, Resolved, SandboxService, ServiceError, Target};
use crate::transcripts::{self, Transcripts};

/// Where a running call's output goes while it runs (the face turns it into progress
/// notifications); `None` when nobody listens. The sender is dropped when the call ends.
pub type OutputSink = Option<mpsc::Sender<OutputEvent>>;

/// A command line to run, and where.
#[derive(Debug, Clone, Copy)]
pub struct CommandLine<'a> {
    /// The bash command line.
    pub command: &'a str,
    /// The working directory, relative to /home/user or absolute under it (default /home/user).
    pub cwd: Option<&'a str>,
}

/// How a cell or a command may run: when it is stopped, how much output is kept.
#[derive(Debug, Clone, Copy)]
pub struct RunLimits {
    /// The cell is interrupted (the command killed, with everything it started) after this.
    pub timeout: Duration,
    /// Most bytes of stdout and stderr together kept.
    pub output_limit: usize,
}

/// The note of a call's egress connections, after its entry (none when it made none).
fn record_egress_note(
    caller: &Caller,
    resolved: &Resolved,
    transcripts: &Transcripts,
    notes: &crate::egress::CallNotes,
) {
    if let Some(mut note) = notes.entry() {
        if let Some(person) = &caller.person {
            note.set_by(person);
        }
        transcripts.record(&resolved.row, note);
    }
}

impl SandboxService {
    /// Runs `code` as one notebook cell in the target sandbox; its transcript entry is kept in
    /// `transcripts`. A cell that raised or timed out is an `Ok` outcome saying so.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn run_cell(
        &self,
        caller: &Caller,
        target: Target<'_>,
        transcripts: &Transcripts,
        code: &str,
        limits: RunLimits,
        output: OutputSink,
    ) -> Result<(Resolved, ExecOutcome), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let options = ExecOptions {
            timeout: limits.timeout,
            output_limit: limits.output_limit,
            ..ExecOptions::default()
        };
        let (text_limit, image_limit) = (options.output_limit, options.display_limit);
        let registered = self.running.register(&resolved.row.id);
        let started = std::time::Instant::now();
        let notes = crate::egress::CallNotes::default();
        let ran = partial::run_keeping(
            output,
            text_limit,
            image_limit,
            |sink| {
                self.with_relays(
                    &resolved,
                    &notes,
                    resolved.sandbox.exec(code, options, sink),
                )
            },
            registered.interrupt.wait(),
        )
        .await;
        let outcome = match ran {
            Ok(ran) => self.checked(&resolved, ran).await?,
            Err((by, partial)) => interrupted_cell(&by, started.elapsed(), partial),
        };
        drop(registered);
        let mut entry = transcripts::cell_entry(code, &outcome);
        self.mark_person(caller, &resolved, &mut entry).await;
        transcripts.record(&resolved.row, entry);
        record_egress_note(caller, &resolved, transcripts, &notes);
        Ok((resolved, outcome))
    }

    /// Runs a command line (bash, as the sandbox user, in its `cwd` or /home/user) in the target
    /// sandbox; its transcript entry is kept in `transcripts`. A command that failed or timed
    /// out is an `Ok` outcome saying so.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn run_command(
        &self,
        caller: &Caller,
        target: Target<'_>,
        transcripts: &Transcripts,
        line: CommandLine<'_>,
        limits: RunLimits,
        output: OutputSink,
    ) -> Result<(Resolved, CommandOutcome), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let options = CommandOptions {
            timeout: limits.timeout,
            output_limit: limits.output_limit,
            cwd: line.cwd.map(str::to_owned),
        };
        let text_limit = options.output_limit;
        let registered = self.running.register(&resolved.row.id);
        let started = std::time::Instant::now();
        let notes = crate::egress::CallNotes::default();
        let ran = partial::run_keeping(
            output,
            text_limit,
            0,
            |sink| {
                self.with_relays(
                    &resolved,
                    &notes,
                    resolved.sandbox.command(line.command, options, sink),
                )
            },
            registered.interrupt.wait(),
        )
        .await;
        let outcome = match ran {
            Ok(ran) => self.checked(&resolved, ran).await?,
            Err((by, partial)) => interrupted_command(&by, started.elapsed(), partial),
        };
        drop(registered);
        let mut entry = transcripts::command_entry(line.command, line.cwd, &outcome);
        self.mark_person(caller, &resolved, &mut entry).await;
        transcripts.record(&resolved.row, entry);
        record_egress_note(caller, &resolved, transcripts, &notes);
        Ok((resolved, outcome))
    }

    /// A person's run: its transcript entry names them, and its sandbox is marked so the bot
    /// is told.
    async fn mark_person(&self, caller: &Caller, resolved: &Resolved, entry: &mut Entry) {
        let Some(person) = &caller.person else {
            return;
        };
        entry.set_by(person);
        self.people_acted(&resolved.row.id, person).await;
    }
}

/// What an interrupted cell answers: its output until then, and a `KeyboardInterrupt` naming
/// the person (the kernel and its variables are kept).
fn interrupted_cell(by: &str, ran: Duration, partial: Partial) -> ExecOutcome {
    ExecOutcome {
        stdout: partial.stdout,
        stderr: partial.stderr,
        displays: partial.displays,
        truncated: partial.truncated,
        error: Some(CellError {
            name: "KeyboardInterrupt".to_owned(),
            value: interrupted_by(by),
            traceback: Vec::new(),
        }),
        duration: ran,
        ..ExecOutcome::default()
    }
}

/// What an interrupted command answers: its output until then, killed (SIGINT's number),
/// saying by whom.
fn interrupted_command(by: &str, ran: Duration, partial: Partial) -> CommandOutcome {
    let mut stderr = partial.stderr;
    if !stderr.is_empty() && !stderr.ends_with('\n') {
        stderr.push('\n');
    }
    stderr.push_str(&interrupted_by(by));
    stderr.push('\n');
    CommandOutcome {
        stdout: partial.stdout,
        stderr,
        signal: Some(2),
        truncated: partial.truncated,
        duration: ran,
        ..CommandOutcome::default()
    }
}

fn interrupted_by(by: &str) -> String {
    format!(
        "a person ({by}) interrupted this call from the sandgate console; the sandbox, its \
         variables and files are kept"
    )
}
