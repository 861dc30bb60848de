//! Cells, shell commands and background jobs.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// The final answer of an `exec` (PROTOCOL.md).
#[derive(Deserialize)]
struct ExecWire {
    execution_count: Option<u64>,
    #[serde(default)]
    result: Value,
    error: Option<CellError>,
    #[serde(default)]
    truncated: bool,
    #[serde(default)]
    state_lost: bool,
    #[serde(default)]
    state_lost_reason: Option<String>,
}

/// The final answer of a `command` (PROTOCOL.md).
#[derive(Deserialize)]
struct CommandWire {
    exit_code: Option<i32>,
    signal: Option<i32>,
    #[serde(default)]
    timed_out: bool,
    #[serde(default)]
    truncated: bool,
}

/// What a call's loop does with one delivery.
enum Step<T> {
    Continue,
    Done(T),
}

impl AgentChannel {
    /// Runs a Python cell. At `options.timeout` the cell is interrupted (its variables survive); if
    /// it has not stopped after the grace period the kernel is restarted and the outcome says
    /// `state_lost`. When the kernel died during the cell, or between the previous cell and this
    /// one, the outcome says `state_lost` and why. Output events go to `events` as they arrive.
    /// Dropping the future interrupts the cell.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn exec(
        &self,
        code: &str,
        options: ExecOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<ExecOutcome, ChannelError> {
        let started = Instant::now();
        let mut call = self
            .start(
                "exec",
                json!({"code": code, "output_limit": options.output_limit}),
            )
            .await?;
        let mut guard = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        let mut out = OutputBuffer::new(options.output_limit, options.display_limit);
        let mut deadline = tokio::time::Instant::now() + options.timeout;
        let mut timed_out = false;
        loop {
            let delivery = match tokio::time::timeout_at(deadline, call.next()).await {
                Ok(delivery) => delivery?,
                Err(_) if !timed_out => {
                    timed_out = true;
                    self.send_interrupt(call.id).await?;
                    deadline = tokio::time::Instant::now() + self.inner.config.interrupt_grace;
                    continue;
                }
                Err(_) => {
                    guard.disarm();
                    // Its route goes first: events it still emits must not fill a queue nobody reads.
                    drop(call);
                    return self.restart_stuck_cell(out, &options, started).await;
                }
            };
            let step = out.take(delivery, events.as_ref(), &mut guard, |out, result| {
                let wire: ExecWire = decode("exec", result)?;
                out.mark_if_dropped(wire.truncated, options.output_limit);
                Ok(ExecOutcome {
                    result: mime_bundle(&wire.result),
                    error: wire.error,
                    execution_count: wire.execution_count,
                    truncated: wire.truncated || out.dropped,
                    timed_out,
                    state_lost: wire.state_lost,
                    state_lost_reason: wire.state_lost_reason.filter(|_| wire.state_lost),
                    duration: started.elapsed(),
                    ..out.take_exec_outcome()
                })
            })?;
            if let Step::Done(outcome) = step {
                return Ok(outcome);
            }
        }
    }

    /// The cell ignored its interrupt (e.g. stuck in C code): the kernel is restarted.
    async fn restart_stuck_cell(
        &self,
        mut out: OutputBuffer,
        options: &ExecOptions,
        started: Instant,
    ) -> Result<ExecOutcome, ChannelError> {
        tracing::warn!("cell ignored its interrupt; restarting the kernel");
        let reason = format!(
            "the cell ran past its timeout of {}s and did not stop when interrupted, so the Python kernel was restarted",
            options.timeout.as_secs_f64()
        );
        self.restart_because(&reason).await?;
        out.mark_if_dropped(false, options.output_limit);
        Ok(ExecOutcome {
            error: Some(CellError {
                name: "TimeoutError".into(),
                value: format!("{reason}; all variables are lost (files in /home/user are kept)"),
                traceback: Vec::new(),
            }),
            truncated: out.dropped,
            timed_out: true,
            state_lost: true,
            state_lost_reason: Some(reason),
            duration: started.elapsed(),
            ..out.take_exec_outcome()
        })
    }

    /// Runs `bash -lc <command>` as the sandbox user in its own session. At the timeout, and when
    /// it ends, the agent kills its process group and every process that left it; should the agent
    /// not answer within the grace period after the timeout, the gateway interrupts the command
    /// itself. Dropping the future kills the command.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn command(
        &self,
        command: &str,
        options: CommandOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<CommandOutcome, ChannelError> {
        let started = Instant::now();
        let timeout_ms = u64::try_from(options.timeout.as_millis()).unwrap_or(u64::MAX);
        let mut call = self
            .start(
                "command",
                json!({
                    "command": command,
                    "timeout_ms": timeout_ms,
                    "cwd": options.cwd,
                    "output_limit": options.output_limit,
                }),
            )
            .await?;
        let mut guard = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        let grace = self.inner.config.interrupt_grace;
        let mut deadline = tokio::time::Instant::now() + options.timeout + grace;
        let mut interrupted = false;
        let mut out = OutputBuffer::new(options.output_limit, 0);
        loop {
            let delivery = match tokio::time::timeout_at(deadline, call.next()).await {
                Ok(delivery) => delivery?,
                Err(_) if !interrupted => {
                    interrupted = true;
                    self.send_interrupt(call.id).await?;
                    deadline = tokio::time::Instant::now() + grace;
                    continue;
                }
                Err(_) => {
                    guard.disarm();
                    return Err(ChannelError::Unresponsive {
                        op: "command",
                        waited: options.timeout + grace + grace,
                    });
                }
            };
            let step = out.take(delivery, events.as_ref(), &mut guard, |out, result| {
                let wire: CommandWire = decode("command", result)?;
                out.mark_if_dropped(wire.truncated, options.output_limit);
                Ok(CommandOutcome {
                    stdout: std::mem::take(&mut out.stdout),
                    stderr: std::mem::take(&mut out.stderr),
                    exit_code: wire.exit_code,
                    signal: wire.signal,
                    timed_out: wire.timed_out || interrupted,
                    truncated: wire.truncated || out.dropped,
                    duration: started.elapsed(),
                })
            })?;
            if let Step::Done(outcome) = step {
                return Ok(outcome);
            }
        }
    }

    /// Starts `bash -lc <command>` as a background job (PROTOCOL.md, jobs): it outlives the call,
    /// its output goes to a log file in the sandbox, and [`Self::jobs`] and [`Self::kill_job`]
    /// reach it. The sandbox runs a bounded number of jobs at once.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn start_job(&self, command: &str, cwd: Option<&str>) -> Result<Job, ChannelError> {
        let mut call = self
            .start(
                "command",
                json!({"command": command, "cwd": cwd, "background": true}),
            )
            .await?;
        let result = call
            .finish("command", self.inner.config.call_timeout)
            .await?;
        #[derive(Deserialize)]
        struct Wire {
            job: Job,
        }
        Ok(decode::<Wire>("command", result)?.job)
    }

    /// The sandbox's background jobs, running and recently ended.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn jobs(&self) -> Result<Vec<Job>, ChannelError> {
        let mut call = self.start("jobs", json!({})).await?;
        let result = call.finish("jobs", self.inner.config.call_timeout).await?;
        #[derive(Deserialize)]
        struct Wire {
            jobs: Vec<Job>,
        }
        Ok(decode::<Wire>("jobs", result)?.jobs)
    }

    /// Kills a background job and everything it started; returns the job as it ended.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn kill_job(&self, job: &str) -> Result<Job, ChannelError> {
        let mut call = self.start("kill_job", json!({"job": job})).await?;
        let result = call
            .finish("kill_job", self.inner.config.call_timeout)
            .await?;
        #[derive(Deserialize)]
        struct Wire {
            job: Job,
        }
        Ok(decode::<Wire>("kill_job", result)?.job)
    }
}

impl OutputBuffer {
    /// Takes one delivery of a running cell or command: output is kept (within the limits) and
    /// forwarded; the final answer goes through `finish`.
    fn take<T>(
        &mut self,
        delivery: Delivery,
        events: Option<&mpsc::Sender<OutputEvent>>,
        guard: &mut InterruptOnDrop,
        finish: impl FnOnce(&mut Self, Value) -> Result<T, ChannelError>,
    ) -> Result<Step<T>, ChannelError> {
        match delivery {
            Delivery::Event { event, frame } => match event.as_str() {
                "stdout" | "stderr" => {
                    let is_err = event == "stderr";
                    let text = frame.get("data").and_then(Value::as_str).unwrap_or("");
                    if let Some(kept) = self.push_text(is_err, text) {
                        let ev = if is_err {
                            OutputEvent::Stderr(kept)
                        } else {
                            OutputEvent::Stdout(kept)
                        };
                        forward(events, ev);
                    }
                }
                "display" => {
                    if let Some(display) = self.push_display(&frame) {
                        forward(events, OutputEvent::Display(display));
                    }
                }
                other => tracing::debug!(event = other, "unexpected event ignored"),
            },
            Delivery::Oversized { is_event: true, .. } => self.dropped = true,
            Delivery::Oversized { len, .. } => {
                guard.disarm();
                return Err(ChannelError::FrameTooLarge {
                    len,
                    limit: MAX_FRAME_BYTES,
                });
            }
            Delivery::Final(outcome) => {
                guard.disarm();
                let result = outcome.map_err(|e| AgentError::from_wire(e, 0))?;
                return finish(self, result).map(Step::Done);
            }
        }
        Ok(Step::Continue)
    }

    /// An outcome with this buffer's output and displays (taken out of it), the rest defaulted.
    fn take_exec_outcome(&mut self) -> ExecOutcome {
        ExecOutcome {
            stdout: std::mem::take(&mut self.stdout),
            stderr: std::mem::take(&mut self.stderr),
            displays: std::mem::take(&mut self.displays),
            ..ExecOutcome::default()
        }
    }
}
