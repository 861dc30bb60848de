//! The link: routing frames from the reader to calls, the reader and writer tasks.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// What the reader hands to a waiting call.
#[derive(Debug)]
pub(crate) enum Delivery {
    Event {
        event: String,
        frame: Map<String, Value>,
    },
    Final(Result<Value, WireError>),
    Oversized {
        is_event: bool,
        len: usize,
    },
}

#[derive(Debug, Default)]
pub(crate) struct Routes {
    pub(crate) calls: HashMap<u64, mpsc::Sender<Delivery>>,
    pub(crate) lost: Option<String>,
}

/// The link's state, watched by callers waiting for a ready frame.
#[derive(Debug, Clone, Default)]
pub(crate) struct Link {
    /// Ready frames seen (the first at start-up, one more per kernel restart).
    pub(crate) readies: u64,
    pub(crate) ready: Option<ReadyInfo>,
    pub(crate) lost: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) label: String,
    pub(crate) routes: Mutex<Routes>,
    pub(crate) link: watch::Sender<Link>,
    /// Counts the agent's `index_wanted` events: pip in the sandbox asked for the package index
    /// relay, which a call running under [`AgentChannel::with_index`] then opens.
    pub(crate) index_wants: watch::Sender<u64>,
    /// Whether one of this channel's calls holds the relay open (at most one serves at a time,
    /// since a newer `index_serve` replaces an older one in the agent).
    pub(crate) index_serving: std::sync::atomic::AtomicBool,
    /// Counts the agent's `egress_wanted` events: a client in the sandbox sent a CONNECT, and a
    /// call running under [`AgentChannel::with_egress`] then opens the egress relay.
    pub(crate) egress_wants: watch::Sender<u64>,
    /// Whether one of this channel's calls holds the egress relay open.
    pub(crate) egress_serving: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(crate) fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        // A panic while holding this lock leaves a map that is still consistent.
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the link: pending calls see their route close and read the reason.
    pub(crate) fn lose(&self, reason: String) {
        let mut routes = self.routes();
        if routes.lost.is_some() {
            return;
        }
        tracing::debug!(sandbox = %self.label, %reason, "agent channel lost");
        routes.lost = Some(reason.clone());
        routes.calls.clear();
        self.link.send_modify(|l| l.lost = Some(reason));
    }

    pub(crate) async fn dispatch(&self, frame: Inbound) {
        let (id, delivery) = match frame {
            Inbound::Ready(info) => {
                let mut routes = self.routes();
                let restarted = self.link.borrow().readies > 0;
                if restarted {
                    // PROTOCOL.md, restart: calls pending at a restart are never answered.
                    tracing::info!(sandbox = %self.label, pending = routes.calls.len(), "agent restarted");
                    routes.calls.clear();
                }
                self.link.send_modify(|l| {
                    l.readies += 1;
                    l.ready = Some(info);
                });
                return;
            }
            Inbound::Event { event, .. } if event == "index_wanted" => {
                // Not the call's business: whichever call can serve the relay opens it.
                self.index_wants.send_modify(|n| *n += 1);
                return;
            }
            Inbound::Event { event, .. } if event == "egress_wanted" => {
                self.egress_wants.send_modify(|n| *n += 1);
                return;
            }
            Inbound::Event { id, event, frame } => (id, Delivery::Event { event, frame }),
            Inbound::Final { id, outcome } => (id, Delivery::Final(outcome)),
            Inbound::Oversized {
                id: Some(id),
                is_event,
                len,
            } => {
                tracing::warn!(sandbox = %self.label, id, len, "dropped an oversized frame");
                (id, Delivery::Oversized { is_event, len })
            }
            Inbound::Oversized { id: None, len, .. } => {
                tracing::warn!(sandbox = %self.label, len, "dropped an oversized frame without id");
                return;
            }
            Inbound::Unattributed(err) => {
                tracing::warn!(sandbox = %self.label, kind = %err.kind, message = %err.message, "agent reported an error without id");
                return;
            }
            Inbound::Garbage { detail } => {
                tracing::warn!(sandbox = %self.label, %detail, "agent wrote a line that is not a frame");
                return;
            }
        };
        let route = self.routes().calls.get(&id).cloned();
        let Some(route) = route else {
            // The answer to a fire-and-forget interrupt, or to a call that was dropped.
            tracing::trace!(sandbox = %self.label, id, "frame for no pending call");
            return;
        };
        if route.send(delivery).await.is_err() {
            self.routes().calls.remove(&id);
        }
    }
}

pub(crate) async fn read_loop(
    shared: Arc<Shared>,
    mut output: BoxStream<'static, std::io::Result<StreamChunk>>,
) {
    let mut lines = LineSplitter::new(MAX_FRAME_BYTES);
    let mut stderr = StderrLog::new(shared.label.clone());
    let mut budget = OutputBudget::new();
    let reason = loop {
        match output.next().await {
            None => break "the sandbox's output stream ended".to_owned(),
            Some(Err(err)) => break format!("reading the sandbox's output failed: {err}"),
            Some(Ok(StreamChunk::Stderr(data))) => stderr.push(&data),
            Some(Ok(StreamChunk::Stdout(data))) => {
                let frames = lines.push(&data);
                let pause = budget.charge(frames.len(), data.len());
                for frame in frames {
                    shared.dispatch(frame).await;
                }
                if !pause.is_zero() {
                    // Over budget: stop reading for a while. The agent's writes block meanwhile,
                    // so the sandbox slows down; other sandboxes have readers of their own.
                    tracing::debug!(sandbox = %shared.label, ?pause, "sandbox output throttled");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    };
    stderr.flush();
    stderr.summarize();
    shared.lose(reason);
}

pub(crate) async fn write_loop(
    shared: Arc<Shared>,
    mut frames: mpsc::Receiver<Bytes>,
    mut input: std::pin::Pin<Box<dyn AsyncWrite + Send>>,
) {
    while let Some(frame) = frames.recv().await {
        // Flush after every frame: a request must not wait in a buffer for the next one.
        let written = async {
            input.write_all(&frame).await?;
            input.flush().await
        };
        if let Err(err) = written.await {
            shared.lose(format!("writing to the sandbox failed: {err}"));
            return;
        }
    }
    // Every sender is gone: the channel was dropped. The input is dropped without a shutdown, so
    // the container's stdin stays open and the agent keeps running for a later `adopt`.
}
/// A registered call: its route from the reader, removed when dropped.
pub(crate) struct Call {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: u64,
    pub(crate) rx: mpsc::Receiver<Delivery>,
    pub(crate) readies_at_start: u64,
}

impl Drop for Call {
    fn drop(&mut self) {
        self.shared.routes().calls.remove(&self.id);
    }
}

impl Call {
    /// The next delivery; when the route closed, the reason as an error.
    pub(crate) async fn next(&mut self) -> Result<Delivery, ChannelError> {
        match self.rx.recv().await {
            Some(d) => Ok(d),
            None => Err(self.closed_reason()),
        }
    }

    pub(crate) fn closed_reason(&self) -> ChannelError {
        let link = self.shared.link.borrow();
        if link.readies > self.readies_at_start {
            ChannelError::KernelRestarted
        } else if let Some(reason) = &link.lost {
            ChannelError::AttachLost {
                reason: reason.clone(),
            }
        } else {
            ChannelError::Protocol {
                detail: "the call's route closed unexpectedly".into(),
            }
        }
    }

    /// Waits for the final answer, ignoring events, within `timeout`.
    pub(crate) async fn finish(
        &mut self,
        op: &'static str,
        timeout: Duration,
    ) -> Result<Value, ChannelError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let delivery = tokio::time::timeout_at(deadline, self.next())
                .await
                .map_err(|_| ChannelError::Unresponsive {
                    op,
                    waited: timeout,
                })??;
            match delivery {
                Delivery::Event { .. } | Delivery::Oversized { is_event: true, .. } => {}
                Delivery::Final(outcome) => {
                    return outcome.map_err(|e| AgentError::from_wire(e, 0).into());
                }
                Delivery::Oversized { len, .. } => {
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
            }
        }
    }
}

/// Sends `interrupt` for a call when dropped while armed: a caller that gives up on a running cell
/// or command (its future dropped) stops it instead of leaving it running.
pub(crate) struct InterruptOnDrop {
    pub(crate) channel: Option<AgentChannel>,
    pub(crate) target: u64,
}

impl InterruptOnDrop {
    pub(crate) fn disarm(&mut self) {
        self.channel = None;
    }
}

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else {
            return;
        };
        let target = self.target;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tracing::debug!(sandbox = %channel.inner.shared.label, target, "call dropped; interrupting it");
                let _ = channel.send_interrupt(target).await;
            });
        }
    }
}
