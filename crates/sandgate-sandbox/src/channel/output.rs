//! Bounded accumulation of a call's output.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// Bounded accumulation of a call's output: the agent caps output too, but the gateway does not
/// rely on it.
pub(crate) struct OutputBuffer {
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    pub(crate) room: usize,
    pub(crate) dropped: bool,
    pub(crate) displays: Vec<Display>,
    pub(crate) display_room: usize,
}

impl OutputBuffer {
    pub(crate) fn new(output_limit: usize, display_limit: usize) -> Self {
        Self {
            stdout: String::new(),
            stderr: String::new(),
            room: output_limit.saturating_add(MARKER_SLACK),
            dropped: false,
            displays: Vec::new(),
            display_room: display_limit,
        }
    }

    /// Keeps what fits; returns the kept part (to forward as an event), if any.
    pub(crate) fn push_text(&mut self, stderr: bool, text: &str) -> Option<String> {
        let keep = floor_char_boundary(text, self.room);
        if keep < text.len() {
            self.dropped = true;
        }
        if keep == 0 {
            return None;
        }
        let kept = &text[..keep];
        self.room -= keep;
        if stderr {
            self.stderr.push_str(kept);
        } else {
            self.stdout.push_str(kept);
        }
        Some(kept.to_owned())
    }

    pub(crate) fn push_display(&mut self, frame: &Map<String, Value>) -> Option<Display> {
        let Some(Value::Object(data)) = frame.get("data") else {
            return None;
        };
        let mut display = Display {
            path: frame.get("path").and_then(Value::as_str).map(str::to_owned),
            ..Display::default()
        };
        let mut size = 0;
        for (mime, value) in data {
            if mime == "image/png" {
                match value.as_str().map(|b64| BASE64.decode(b64)) {
                    Some(Ok(png)) => {
                        size += png.len();
                        display.png = Some(png);
                    }
                    _ => tracing::warn!("display with an undecodable image/png dropped"),
                }
            } else {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                size += text.len();
                display.data.insert(mime.clone(), text);
            }
        }
        if size > self.display_room {
            self.dropped = true;
            return None;
        }
        self.display_room -= size;
        self.displays.push(display.clone());
        Some(display)
    }

    /// Appends the gateway's own marker when it dropped output the agent had not already marked.
    pub(crate) fn mark_if_dropped(&mut self, agent_truncated: bool, limit: usize) {
        if self.dropped && !agent_truncated {
            self.stderr.push_str(&format!(
                "\n[output truncated by the gateway: limit of {limit} bytes reached]\n"
            ));
        }
    }
}

pub(crate) fn floor_char_boundary(text: &str, max: usize) -> usize {
    if max >= text.len() {
        return text.len();
    }
    let mut at = max;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

pub(crate) fn mime_bundle(value: &Value) -> Option<MimeBundle> {
    let Value::Object(map) = value else {
        return None;
    };
    if map.is_empty() {
        return None;
    }
    Some(
        map.iter()
            .map(|(k, v)| {
                let text = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), text)
            })
            .collect(),
    )
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    op: &str,
    value: Value,
) -> Result<T, ChannelError> {
    serde_json::from_value(value).map_err(|e| ChannelError::Protocol {
        detail: format!("malformed {op} result: {e}"),
    })
}

pub(crate) fn forward(events: Option<&mpsc::Sender<OutputEvent>>, event: OutputEvent) {
    if let Some(tx) = events {
        // Progress is best effort; a slow consumer must not stall the sandbox's reader.
        if let Err(mpsc::error::TrySendError::Full(_)) = tx.try_send(event) {
            tracing::debug!("output event dropped: receiver is behind");
        }
    }
}
