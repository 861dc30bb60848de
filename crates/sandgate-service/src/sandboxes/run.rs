//! Running a cell or a command end to end, for any face: resolve the target sandbox, run the
//! call with the tenant's package index served beside it, stream its output to the face,
//! record and explain a sandbox that died underneath, and keep the transcript entry.
//!
//! Cancellation is the face's: dropping the returned future interrupts the cell or kills the
//! command (the sandbox's kernel survives an interrupt).

use std::time::Duration;

use sandgate_sandbox::{CommandOptions, CommandOutcome, ExecOptions, ExecOutcome, OutputEvent};
use tokio::sync::mpsc;

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
        let call = resolved.sandbox.exec(code, options, output);
        let ran = self.with_package_index(&resolved, call).await;
        let outcome = self.checked(&resolved, ran).await?;
        transcripts.record(&resolved.row, transcripts::cell_entry(code, &outcome));
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
        let call = resolved.sandbox.command(line.command, options, output);
        let ran = self.with_package_index(&resolved, call).await;
        let outcome = self.checked(&resolved, ran).await?;
        let entry = transcripts::command_entry(line.command, line.cwd, &outcome);
        transcripts.record(&resolved.row, entry);
        Ok((resolved, outcome))
    }
}
