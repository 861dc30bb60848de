//! Cells and shell commands.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

impl AgentChannel {
    /// Runs a Python cell. At `options.timeout` the cell is interrupted (its variables survive); if
    /// it has not stopped after the grace period the kernel is restarted and the outcome says
    /// `state_lost`. Output events go to `events` as they arrive. Dropping the future interrupts
    /// the cell.
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
        let mut oversized_events = false;
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
                    // The cell ignored the interrupt (e.g. stuck in C code): restart the kernel.
                    tracing::warn!("cell ignored its interrupt; restarting the kernel");
                    guard.disarm();
                    // Its route goes first: events it still emits must not fill a queue nobody reads.
                    drop(call);
                    self.restart().await?;
                    out.mark_if_dropped(false, options.output_limit);
                    return Ok(ExecOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        result: None,
                        error: Some(CellError {
                            name: "TimeoutError".into(),
                            value: format!(
                                "the cell ran past its timeout of {}s and did not stop when interrupted; the Python kernel was restarted and all variables are lost (files in /home/user are kept)",
                                options.timeout.as_secs_f64()
                            ),
                            traceback: Vec::new(),
                        }),
                        execution_count: None,
                        displays: out.displays,
                        truncated: out.dropped || oversized_events,
                        timed_out: true,
                        state_lost: true,
                        duration: started.elapsed(),
                    });
                }
            };
            match delivery {
                Delivery::Event { event, frame } => match event.as_str() {
                    "stdout" | "stderr" => {
                        let is_err = event == "stderr";
                        let text = frame.get("data").and_then(Value::as_str).unwrap_or("");
                        if let Some(kept) = out.push_text(is_err, text) {
                            let ev = if is_err {
                                OutputEvent::Stderr(kept)
                            } else {
                                OutputEvent::Stdout(kept)
                            };
                            forward(events.as_ref(), ev);
                        }
                    }
                    "display" => {
                        if let Some(display) = out.push_display(&frame) {
                            forward(events.as_ref(), OutputEvent::Display(display));
                        }
                    }
                    other => tracing::debug!(event = other, "unexpected exec event ignored"),
                },
                Delivery::Oversized { is_event: true, .. } => oversized_events = true,
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
                    #[derive(Deserialize)]
                    struct Wire {
                        execution_count: Option<u64>,
                        #[serde(default)]
                        result: Value,
                        error: Option<CellError>,
                        #[serde(default)]
                        truncated: bool,
                    }
                    let wire: Wire = decode("exec", result)?;
                    out.mark_if_dropped(wire.truncated, options.output_limit);
                    return Ok(ExecOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        result: mime_bundle(&wire.result),
                        error: wire.error,
                        execution_count: wire.execution_count,
                        displays: out.displays,
                        truncated: wire.truncated || out.dropped || oversized_events,
                        timed_out,
                        state_lost: false,
                        duration: started.elapsed(),
                    });
                }
            }
        }
    }

    /// Runs `bash -lc <command>` in its own process group. The agent kills the whole group at the
    /// timeout; should it not answer within the grace period after that, the gateway interrupts the
    /// command itself. Dropping the future kills the command.
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
            match delivery {
                Delivery::Event { event, frame } if event == "stdout" || event == "stderr" => {
                    let is_err = event == "stderr";
                    let text = frame.get("data").and_then(Value::as_str).unwrap_or("");
                    if let Some(kept) = out.push_text(is_err, text) {
                        let ev = if is_err {
                            OutputEvent::Stderr(kept)
                        } else {
                            OutputEvent::Stdout(kept)
                        };
                        forward(events.as_ref(), ev);
                    }
                }
                Delivery::Event { event, .. } => {
                    tracing::debug!(event, "unexpected command event ignored");
                }
                Delivery::Oversized { is_event: true, .. } => out.dropped = true,
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
                    #[derive(Deserialize)]
                    struct Wire {
                        exit_code: Option<i32>,
                        signal: Option<i32>,
                        #[serde(default)]
                        timed_out: bool,
                        #[serde(default)]
                        truncated: bool,
                    }
                    let wire: Wire = decode("command", result)?;
                    out.mark_if_dropped(wire.truncated, options.output_limit);
                    return Ok(CommandOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        exit_code: wire.exit_code,
                        signal: wire.signal,
                        timed_out: wire.timed_out || interrupted,
                        truncated: wire.truncated || out.dropped,
                        duration: started.elapsed(),
                    });
                }
            }
        }
    }
}
