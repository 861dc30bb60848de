//! What each tool does, as MCP: parse the arguments, ask the service layer, and shape the
//! answer (structured content, a text block, images or blobs). The service layer decides what
//! happens to sandboxes; this module decides how it reads.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::DateTime;
use rmcp::RoleServer;
use rmcp::model::{ContentBlock, JsonObject, ResourceContents};
use rmcp::service::RequestContext;
use sandgate_service::domain::CommandOutcome;
use sandgate_service::{
    Caller, CommandLine, ErrorKind, RESUMED_FROM_FILES, RunLimits, ServiceError, Target,
};
use serde::de::DeserializeOwned;

use super::McpServer;
use super::answer::{Answer, CallError, target};
use super::progress::progress_forwarder;
use super::render::{absolute, mime_type, render_cell, render_streams, rfc3339, structured};
use super::schema::*;
use super::tools::ToolName;

fn parse_args<T: DeserializeOwned>(args: Option<JsonObject>) -> Result<T, CallError> {
    serde_json::from_value(serde_json::Value::Object(args.unwrap_or_default()))
        .map_err(|e| CallError::InvalidParams(format!("invalid arguments: {e}")))
}

/// Longest wait for the note saying people acted in the sandbox (see `add_people_note`).
const PEOPLE_NOTE_WAIT: Duration = Duration::from_millis(500);

impl McpServer {
    pub(super) fn call_timeout(&self, asked: Option<u32>) -> Result<Duration, CallError> {
        let limits = &self.inner.limits;
        match asked {
            None => Ok(Duration::from_secs(
                limits.default_call_timeout_seconds.into(),
            )),
            Some(0) => Err(CallError::InvalidParams(
                "timeout_seconds must be at least 1".into(),
            )),
            Some(s) if s > limits.max_call_timeout_seconds => {
                Err(CallError::InvalidParams(format!(
                    "timeout_seconds {s} exceeds the maximum of {}",
                    limits.max_call_timeout_seconds
                )))
            }
            Some(s) => Ok(Duration::from_secs(s.into())),
        }
    }

    /// Runs one tool call for `caller`.
    pub(super) async fn dispatch(
        &self,
        tool: ToolName,
        args: Option<JsonObject>,
        caller: &Caller,
        conversation: Option<&str>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        match tool {
            ToolName::CreateSandbox => {
                self.create_sandbox(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::ExecuteCode => {
                let args: ExecuteCodeArgs = parse_args(args)?;
                let timeout = self.call_timeout(args.timeout_seconds)?;
                let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
                self.execute_code(caller, to, &args.code, timeout, ctx)
                    .await
            }
            ToolName::RunTerminalCommand => {
                let args: RunTerminalCommandArgs = parse_args(args)?;
                if args.background {
                    return self.start_job(args, caller, conversation).await;
                }
                let timeout = self.call_timeout(args.timeout_seconds)?;
                let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
                let line = CommandLine {
                    command: &args.command,
                    cwd: args.cwd.as_deref(),
                };
                self.run_command(caller, to, line, timeout, ctx).await
            }
            ToolName::UploadFile => {
                self.upload_file(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::GetFile => self.get_file(parse_args(args)?, caller, conversation).await,
            ToolName::ListFiles => {
                self.list_files(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::CloseSandbox => {
                self.close_sandbox(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::ExportTranscript => {
                self.export_transcript(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::ListJobs => {
                self.list_jobs(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::KillJob => self.kill_job(parse_args(args)?, caller, conversation).await,
            ToolName::PauseSandbox => {
                self.pause_sandbox(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::ListSandboxes => self.list_sandboxes(parse_args(args)?, caller).await,
            ToolName::ForkSandbox => {
                self.fork_sandbox(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::InstallPackages => {
                self.install_packages(parse_args(args)?, caller, conversation, ctx)
                    .await
            }
        }
    }

    async fn create_sandbox(
        &self,
        args: CreateSandboxArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let resolved = self
            .inner
            .sandboxes
            .create(caller, conversation, args.keep_alive_seconds)
            .await?;
        let row = &resolved.row;
        let out = CreateSandboxOutput {
            sandbox_id: row.id.clone(),
            created: resolved.created,
            conversation_id: row.conversation_id.clone(),
            expires_at: row.expires_at.map(rfc3339).unwrap_or_default(),
            idle_timeout_seconds: row.idle_timeout_seconds.unwrap_or_default().max(0) as u32,
        };
        let text = format!(
            "{} sandbox {} (idle timeout {} s, expires {}). Pass sandbox_id \"{}\" to the other tools.",
            if out.created {
                "Created"
            } else {
                "Reusing the conversation's"
            },
            out.sandbox_id,
            out.idle_timeout_seconds,
            out.expires_at,
            out.sandbox_id
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn upload_file(
        &self,
        args: UploadFileArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let data = match (args.content_base64, args.content_text) {
            (Some(b64), None) => BASE64.decode(b64.trim()).map_err(|e| {
                CallError::InvalidParams(format!("content_base64 is not valid base64: {e}"))
            })?,
            (None, Some(text)) => text.into_bytes(),
            _ => {
                return Err(CallError::InvalidParams(
                    "give exactly one of content_base64 and content_text".into(),
                ));
            }
        };
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let (resolved, info) = self
            .inner
            .sandboxes
            .upload_file(
                caller,
                to,
                &args.path,
                &data,
                args.overwrite.unwrap_or(false),
            )
            .await?;
        let entry = crate::transcripts::file_entry(&info, false);
        self.inner.transcripts.record(&resolved.row, entry);
        let out = UploadFileOutput {
            sandbox_id: resolved.row.id.clone(),
            path: info.path,
            size: info.size,
            sha256: info.sha256,
        };
        let text = format!(
            "Wrote {} ({} bytes, sha256 {}) in sandbox {}.",
            out.path, out.size, out.sha256, out.sandbox_id
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn get_file(
        &self,
        args: GetFileArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let (resolved, data, info) = self
            .inner
            .sandboxes
            .read_file(caller, to, &args.path)
            .await?;
        let entry = crate::transcripts::file_entry(&info, true);
        self.inner.transcripts.record(&resolved.row, entry);
        let mime = mime_type(&info.path, &data[..data.len().min(512)]);
        let (download_url, expires) = self.inner.links.mint(caller, &resolved.row.id, &info.path);
        let out = GetFileOutput {
            sandbox_id: resolved.row.id.clone(),
            path: info.path.clone(),
            size: info.size,
            mime_type: mime.clone(),
            sha256: info.sha256,
            download_url,
            download_expires_at: rfc3339(expires),
            space: info.space.map(SpaceOutput::from),
        };
        let summary = format!(
            "{} ({} bytes, {}) from sandbox {}. Download link for a person (valid until {}): {}",
            out.path,
            out.size,
            out.mime_type,
            out.sandbox_id,
            out.download_expires_at,
            out.download_url
        );
        let inline_max = self.inner.limits.inline_file_bytes;
        let inline = info.size <= inline_max;
        let summary = if !inline {
            format!(
                "{summary}\nThe file is over {inline_max} bytes, so it is not inlined: read the \
                 resource link with resources/read, or give the person the download link."
            )
        } else {
            summary
        };
        let content = if !inline {
            super::resources::file_link(&out.sandbox_id, &info.path, &mime, info.size)
        } else if mime.starts_with("image/") && mime != "image/svg+xml" {
            ContentBlock::image(BASE64.encode(&data), mime)
        } else if let Ok(text) = std::str::from_utf8(&data) {
            ContentBlock::text(text.to_owned())
        } else {
            ContentBlock::resource(
                ResourceContents::blob(
                    BASE64.encode(&data),
                    format!("sandbox://{}{}", out.sandbox_id, info.path),
                )
                .with_mime_type(mime),
            )
        };
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, summary, false, vec![content]),
        ))
    }

    async fn list_files(
        &self,
        args: ListFilesArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let path = args.path.unwrap_or_else(|| ".".into());
        let (resolved, listing) = self.inner.sandboxes.list_files(caller, to, &path).await?;
        let out = ListFilesOutput {
            sandbox_id: resolved.row.id.clone(),
            path: absolute(&path),
            space: listing.space.map(SpaceOutput::from),
            entries: listing
                .entries
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: format!("{:?}", e.kind).to_lowercase(),
                    size: e.size,
                    modified: DateTime::from_timestamp(e.modified as i64, 0)
                        .map(rfc3339)
                        .unwrap_or_default(),
                })
                .collect(),
        };
        let mut text = format!("{} in sandbox {}:\n", out.path, out.sandbox_id);
        for e in &out.entries {
            text.push_str(&format!(
                "{:<7} {:>10}  {}  {}\n",
                e.kind, e.size, e.modified, e.name
            ));
        }
        if out.entries.is_empty() {
            text.push_str("(empty)\n");
        }
        if let Some(space) = &out.space {
            text.push_str(&format!(
                "{} MiB used, {} MiB free in /home/user\n",
                space.used_bytes >> 20,
                space.free_bytes >> 20
            ));
        }
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    /// The sandbox a close, pause or fork names: `sandbox_id`, else the conversation's; with
    /// neither, an invalid-params error saying what to give (`verb`: what the tool does).
    async fn named_sandbox(
        &self,
        sandbox_id: Option<String>,
        caller: &Caller,
        conversation: Option<&str>,
        verb: &str,
    ) -> Result<String, CallError> {
        match (sandbox_id, conversation) {
            (Some(id), _) => Ok(id),
            (None, Some(conversation)) => Ok(self
                .inner
                .sandboxes
                .conversation_sandbox(caller, conversation)
                .await?),
            (None, None) => Err(CallError::InvalidParams(format!(
                "give the sandbox_id to {verb}"
            ))),
        }
    }

    async fn close_sandbox(
        &self,
        args: CloseSandboxArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let service = &self.inner.sandboxes;
        let id = self
            .named_sandbox(args.sandbox_id, caller, conversation, "close")
            .await?;
        let row = service.close(caller, &id).await?;
        let out = CloseSandboxOutput {
            sandbox_id: row.id.clone(),
            closed: true,
        };
        let text = format!(
            "Closed sandbox {}; its files and variables are gone.",
            out.sandbox_id
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    /// Tells the bot when people acted in its sandbox from the console since its last call
    /// (once per action; a failure to read the mark only costs the note).
    async fn add_people_note(&self, caller: &Caller, sandbox_id: &str, text: &mut String) {
        if caller.person.is_some() {
            return;
        }
        // One statement on the answer's path; with Postgres slow or away the answer goes
        // without the note rather than wait (the mark stays for the next call).
        let take = self
            .inner
            .sandboxes
            .take_people_note(caller.tenant, sandbox_id);
        match tokio::time::timeout(PEOPLE_NOTE_WAIT, take).await {
            Ok(Ok(Some(note))) => {
                text.push('\n');
                text.push_str(&note.text());
            }
            Ok(Ok(None)) => {}
            Ok(Err(err)) => tracing::warn!(error = %err, "reading whether people acted failed"),
            Err(_) => tracing::warn!("reading whether people acted took too long; no note"),
        }
    }

    async fn pause_sandbox(
        &self,
        args: PauseSandboxArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let service = &self.inner.sandboxes;
        let id = self
            .named_sandbox(args.sandbox_id, caller, conversation, "pause")
            .await?;
        let row = service.pause(caller, &id).await?;
        let out = PauseSandboxOutput {
            sandbox_id: row.id.clone(),
            paused: true,
            paused_at: row.paused_at.map(rfc3339),
        };
        let text = format!(
            "Paused sandbox {}: its variables and files are kept; the next call naming it (or \
             its conversation) resumes it.",
            out.sandbox_id
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn fork_sandbox(
        &self,
        args: ForkSandboxArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let service = &self.inner.sandboxes;
        let id = self
            .named_sandbox(args.sandbox_id, caller, conversation, "fork")
            .await?;
        let forked = service.fork(caller, &id).await?;
        let row = &forked.fork.row;
        let out = ForkSandboxOutput {
            sandbox_id: row.id.clone(),
            forked_from: forked.source_id.clone(),
            idle_timeout_seconds: row.idle_timeout_seconds.unwrap_or_default().max(0) as u32,
            expires_at: row.expires_at.map(rfc3339).unwrap_or_default(),
        };
        let text = format!(
            "Forked sandbox {} into {}: the copy has the same variables and files; pass \
             sandbox_id \"{}\" to work in it. The original is unchanged.",
            out.forked_from, out.sandbox_id, out.sandbox_id
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn list_sandboxes(
        &self,
        args: ListSandboxesArgs,
        caller: &Caller,
    ) -> Result<Answer, CallError> {
        let held = self
            .inner
            .sandboxes
            .list_held(caller, args.conversation_id.as_deref())
            .await?;
        let sandboxes: Vec<SandboxEntry> = held
            .iter()
            .map(|h| SandboxEntry {
                sandbox_id: h.row.id.clone(),
                state: h.state().to_owned(),
                conversation_id: h.row.conversation_id.clone(),
                idle_timeout_seconds: h.row.idle_timeout_seconds.unwrap_or_default().max(0) as u32,
                expires_at: h.row.expires_at.map(rfc3339),
                paused_at: (h.state() != "running")
                    .then_some(h.row.paused_at)
                    .flatten()
                    .map(rfc3339),
                snapshot_bytes: h.snapshot_bytes,
            })
            .collect();
        let mut text = format!("{} sandbox(es):\n", sandboxes.len());
        for s in &sandboxes {
            text.push_str(&format!(
                "- {} {}{}\n",
                s.sandbox_id,
                s.state,
                s.conversation_id
                    .as_deref()
                    .map(|c| format!(" (conversation {c})"))
                    .unwrap_or_default()
            ));
        }
        let out = ListSandboxesOutput {
            sandbox_id: None,
            sandboxes,
        };
        Ok(Answer {
            sandbox_id: None,
            result: structured(&out, text, false, vec![]),
        })
    }

    /// The limits of a cell or command that may run for `timeout`.
    fn run_limits(&self, timeout: Duration) -> RunLimits {
        RunLimits {
            timeout,
            output_limit: self.inner.limits.output_limit_bytes,
        }
    }

    /// Runs a cell or command (`run`, given where its output goes): its output streams as
    /// progress when the client asked for it, and a cancelled request stops it (dropping the
    /// service's call interrupts the cell or kills the command).
    async fn run_streaming<T, Fut>(
        &self,
        ctx: &RequestContext<RoleServer>,
        run: impl FnOnce(sandgate_service::OutputSink) -> Fut,
    ) -> Result<T, CallError>
    where
        Fut: Future<Output = Result<T, ServiceError>>,
    {
        let (events, progress) = progress_forwarder(ctx);
        let outcome = tokio::select! {
            outcome = run(events) => outcome,
            () = ctx.ct.cancelled() => return Err(CallError::Cancelled),
        };
        // All output notifications go out before the result.
        if let Some(progress) = progress {
            let _ = progress.await;
        }
        Ok(outcome?)
    }

    async fn execute_code(
        &self,
        caller: &Caller,
        to: Target<'_>,
        code: &str,
        timeout: Duration,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let (service, transcripts) = (&self.inner.sandboxes, &self.inner.transcripts);
        let limits = self.run_limits(timeout);
        let (resolved, outcome) = self
            .run_streaming(ctx, |events| {
                service.run_cell(caller, to, transcripts, code, limits, events)
            })
            .await?;
        let sandbox_id = resolved.row.id.clone();
        let mut images = Vec::new();
        let mut blocks = Vec::new();
        for display in &outcome.displays {
            if let Some(png) = &display.png {
                images.push(ImageOutput {
                    path: display.path.clone(),
                    mime_type: "image/png".into(),
                    size: png.len() as u64,
                });
                blocks.push(ContentBlock::image(BASE64.encode(png), "image/png"));
            }
        }
        let from_files = resolved.resumed.as_ref().is_some_and(|r| r.files.is_some());
        let out = ExecuteCodeOutput {
            sandbox_id: sandbox_id.clone(),
            stdout: outcome.stdout,
            stderr: outcome.stderr,
            result: outcome.result.map(|bundle| CellResult {
                text_plain: bundle.get("text/plain").cloned(),
                text_html: bundle.get("text/html").cloned(),
            }),
            error: outcome.error.map(|e| CellErrorOutput {
                name: e.name,
                value: e.value,
                traceback: e.traceback,
            }),
            execution_count: outcome.execution_count,
            images,
            truncated: outcome.truncated,
            timed_out: outcome.timed_out,
            state_lost: outcome.state_lost || resolved.replaced.is_some() || from_files,
            state_lost_reason: outcome
                .state_lost_reason
                .or_else(|| resolved.replaced.as_ref().map(|r| r.sentence()))
                .or_else(|| from_files.then(|| RESUMED_FROM_FILES.to_owned())),
            resumed: resolved.resumed.as_ref().map(ResumedOutput::from),
            previous_sandbox: resolved.replaced.as_ref().map(|r| PreviousSandboxOutput {
                sandbox_id: r.previous_sandbox_id.clone(),
                ended_at: r.ended_at.map(rfc3339),
                reason: r.reason.clone(),
            }),
            duration_ms: outcome.duration.as_millis() as u64,
        };
        let is_error = out.error.is_some() || out.timed_out;
        let mut text = render_cell(&out, timeout);
        self.add_people_note(caller, &sandbox_id, &mut text).await;
        Ok(Answer {
            sandbox_id: Some(sandbox_id),
            result: structured(&out, text, is_error, blocks),
        })
    }

    /// Runs a command line in the target sandbox (`run_terminal_command`, `install_packages`).
    pub(super) async fn run_command(
        &self,
        caller: &Caller,
        to: Target<'_>,
        line: CommandLine<'_>,
        timeout: Duration,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let (service, transcripts) = (&self.inner.sandboxes, &self.inner.transcripts);
        let limits = self.run_limits(timeout);
        let (resolved, outcome) = self
            .run_streaming(ctx, |events| {
                service.run_command(caller, to, transcripts, line, limits, events)
            })
            .await?;
        let failed = match (outcome.timed_out, outcome.exit_code) {
            (true, _) => Some(ErrorKind::Timeout),
            (false, Some(0)) => None,
            (false, _) => Some(ErrorKind::CommandFailed),
        };
        let out = RunTerminalCommandOutput {
            sandbox_id: resolved.row.id.clone(),
            stdout: outcome.stdout,
            stderr: outcome.stderr,
            exit_code: outcome.exit_code,
            signal: outcome.signal,
            timed_out: outcome.timed_out,
            truncated: outcome.truncated,
            duration_ms: outcome.duration.as_millis() as u64,
            job: None,
            error: failed.map(|kind| kind.as_str().to_owned()),
            retryable: failed.map(ErrorKind::retryable),
        };
        let is_error = failed.is_some();
        let mut text = render_streams(&out.stdout, &out.stderr);
        if out.timed_out {
            text.push_str(&format!(
                "[timed out after {} s; the command and its children were killed]\n",
                timeout.as_secs()
            ));
        }
        match (out.exit_code, out.signal) {
            (Some(code), _) => text.push_str(&format!("[exit code {code}]")),
            (None, Some(sig)) => text.push_str(&format!("[killed by signal {sig}]")),
            (None, None) => text.push_str("[no exit code]"),
        }
        self.add_people_note(caller, &out.sandbox_id, &mut text)
            .await;
        Ok(Answer {
            sandbox_id: Some(out.sandbox_id.clone()),
            result: structured(&out, text, is_error, vec![]),
        })
    }

    /// `run_terminal_command` with `background: true`: starts the job and answers at once.
    async fn start_job(
        &self,
        args: RunTerminalCommandArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        if args.timeout_seconds.is_some() {
            return Err(CallError::InvalidParams(
                "timeout_seconds does not apply to a background command (it runs until it \
                 exits or kill_job ends it); leave timeout_seconds out, or drop background"
                    .into(),
            ));
        }
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let started = std::time::Instant::now();
        let (resolved, job) = self
            .inner
            .sandboxes
            .start_job(caller, to, &args.command, args.cwd.as_deref())
            .await?;
        let job = JobOutput::from(job);
        let note = format!(
            "Started background job {} (pid {}); its output goes to {} (read it with \
             run_terminal_command, e.g. tail -n 50 {}). It keeps running after this call: \
             list_jobs shows whether it still runs, kill_job with job_id \"{}\" stops it.",
            job.job_id, job.pid, job.log, job.log, job.job_id
        );
        let outcome = CommandOutcome {
            stdout: format!("{note}\n"),
            duration: started.elapsed(),
            ..Default::default()
        };
        let entry = crate::transcripts::command_entry(&args.command, args.cwd.as_deref(), &outcome);
        self.inner.transcripts.record(&resolved.row, entry);
        let out = RunTerminalCommandOutput {
            sandbox_id: resolved.row.id.clone(),
            stdout: String::new(),
            stderr: String::new(),
            exit_code: None,
            signal: None,
            timed_out: false,
            truncated: false,
            duration_ms: outcome.duration.as_millis() as u64,
            job: Some(job),
            error: None,
            retryable: None,
        };
        let text = format!("{note} (sandbox {})", out.sandbox_id);
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn list_jobs(
        &self,
        args: ListJobsArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        if args.sandbox_id.is_none() && conversation.is_none() {
            return Err(CallError::InvalidParams(
                "give the sandbox_id (or conversation_id) whose jobs to list".into(),
            ));
        }
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let (resolved, jobs) = self.inner.sandboxes.jobs(caller, to).await?;
        let out = ListJobsOutput {
            sandbox_id: resolved.row.id.clone(),
            jobs: jobs.into_iter().map(JobOutput::from).collect(),
        };
        let mut text = format!("Background jobs in sandbox {}:\n", out.sandbox_id);
        for job in &out.jobs {
            text.push_str(&format!(
                "{}  pid {}  {}  log {}  {}\n",
                job.job_id,
                job.pid,
                job_state(job),
                job.log,
                job.command
            ));
        }
        if out.jobs.is_empty() {
            text.push_str("(none; start one with run_terminal_command and background: true)\n");
        } else if out.jobs.iter().any(|j| j.running) {
            text.push_str("Stop a running job with kill_job and its job_id.\n");
        }
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }

    async fn kill_job(
        &self,
        args: KillJobArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        if args.sandbox_id.is_none() && conversation.is_none() {
            return Err(CallError::InvalidParams(
                "give the sandbox_id (or conversation_id) the job runs in".into(),
            ));
        }
        let to = target(&args.sandbox_id, conversation, args.keep_alive_seconds);
        let (resolved, job) = self
            .inner
            .sandboxes
            .kill_job(caller, to, &args.job_id)
            .await?;
        let out = KillJobOutput {
            sandbox_id: resolved.row.id.clone(),
            job: JobOutput::from(job),
        };
        let text = format!(
            "Background job {} in sandbox {}: {}.",
            out.job.job_id,
            out.sandbox_id,
            job_state(&out.job)
        );
        Ok(Answer::new(
            &out.sandbox_id,
            structured(&out, text, false, vec![]),
        ))
    }
}

/// How a job reads in a text block: running, or how it ended.
fn job_state(job: &JobOutput) -> String {
    match (job.running, job.exit_code, job.signal) {
        (true, _, _) => "running".into(),
        (false, Some(code), _) => format!("exited with code {code}"),
        (false, None, Some(sig)) => format!("killed by signal {sig}"),
        (false, None, None) => "ended".into(),
    }
}
