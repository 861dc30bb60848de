//! Output of a running cell or command as `notifications/progress`, when the client sent a
//! progress token.

use std::time::Duration;

use rmcp::RoleServer;
use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::{Peer, RequestContext};
use sandgate_service::domain::OutputEvent;
use tokio::sync::mpsc;

/// How often output chunks of a running cell or command are sent as progress notifications.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Most characters of output one progress notification carries.
const PROGRESS_CHUNK_CHARS: usize = 8192;

/// When the client sent a progress token, a sender for output events and the task that turns
/// them into rate-limited `notifications/progress` (ended when the sender is dropped).
pub(super) fn progress_forwarder(
    ctx: &RequestContext<RoleServer>,
) -> (
    Option<mpsc::Sender<OutputEvent>>,
    Option<tokio::task::JoinHandle<()>>,
) {
    let Some(token) = ctx.meta.get_progress_token() else {
        return (None, None);
    };
    let (tx, rx) = mpsc::channel(256);
    let peer = ctx.peer.clone();
    let task = tokio::spawn(forward_progress(rx, peer, token));
    (Some(tx), Some(task))
}

async fn forward_progress(
    mut rx: mpsc::Receiver<OutputEvent>,
    peer: Peer<RoleServer>,
    token: ProgressToken,
) {
    let mut pending = String::new();
    let mut step = 0u64;
    let mut ticker = tokio::time::interval(PROGRESS_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(OutputEvent::Stdout(s)) => pending.push_str(&s),
                Some(OutputEvent::Stderr(s)) => pending.push_str(&s),
                Some(OutputEvent::Display(d)) => {
                    pending.push_str(&format!("[chart{}]\n", d.path.map(|p| format!(": {p}")).unwrap_or_default()));
                }
                None => break,
            },
            _ = ticker.tick() => {
                if !pending.is_empty() {
                    step += 1;
                    send_progress(&peer, &token, step, std::mem::take(&mut pending)).await;
                }
            }
        }
    }
    if !pending.is_empty() {
        step += 1;
        send_progress(&peer, &token, step, pending).await;
    }
}

async fn send_progress(
    peer: &Peer<RoleServer>,
    token: &ProgressToken,
    step: u64,
    mut message: String,
) {
    if message.len() > PROGRESS_CHUNK_CHARS {
        let mut cut = PROGRESS_CHUNK_CHARS;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    let param = ProgressNotificationParam::new(token.clone(), step as f64).with_message(message);
    if let Err(err) = peer.notify_progress(param).await {
        tracing::debug!(error = %err, "sending a progress notification failed");
    }
}
