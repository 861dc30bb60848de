//! The output of a running call so far, kept beside the face's stream: a call that a person
//! interrupts from the console is dropped before the sandbox hands back its outcome, and still
//! answers (to the bot, and in the transcript) with what it printed until then.
//!
//! Kept as the sandbox keeps a call's own outcome: stdout and stderr together up to the call's
//! output limit, images up to the cell's image limit, `truncated` past either.

use std::future::Future;

use sandgate_sandbox::{Display, OutputEvent};
use tokio::sync::mpsc;

use super::run::OutputSink;

/// Events the sandbox may send before the relay below reads them (beyond it the sandbox drops
/// events as it does for a slow face, and the output is short of them).
const BUFFER: usize = 256;

/// What a call printed so far.
#[derive(Debug, Default)]
pub(super) struct Partial {
    pub stdout: String,
    pub stderr: String,
    pub displays: Vec<Display>,
    pub truncated: bool,
    text_limit: usize,
    image_limit: usize,
    image_bytes: usize,
}

impl Partial {
    fn new(text_limit: usize, image_limit: usize) -> Self {
        Self {
            text_limit,
            image_limit,
            ..Self::default()
        }
    }

    fn keep(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Stdout(text) => self.keep_text(text, false),
            OutputEvent::Stderr(text) => self.keep_text(text, true),
            OutputEvent::Display(display) => {
                let bytes = display.png.as_ref().map_or(0, Vec::len)
                    + display.data.values().map(String::len).sum::<usize>();
                if self.image_bytes + bytes > self.image_limit {
                    self.truncated = true;
                } else {
                    self.image_bytes += bytes;
                    self.displays.push(display.clone());
                }
            }
        }
    }

    fn keep_text(&mut self, text: &str, stderr: bool) {
        let room = self
            .text_limit
            .saturating_sub(self.stdout.len() + self.stderr.len());
        let mut end = text.len().min(room);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        if end < text.len() {
            self.truncated = true;
        }
        let into = if stderr {
            &mut self.stderr
        } else {
            &mut self.stdout
        };
        into.push_str(&text[..end]);
    }
}

/// Runs `call` (made with the sink this hands it) while relaying its output events to `face`
/// and keeping them, until the call ends or `stop` resolves first. `Ok` is the call's own
/// answer; `Err` carries `stop`'s value and the output kept until then (the call is dropped,
/// which interrupts it).
pub(super) async fn run_keeping<T, S>(
    face: OutputSink,
    text_limit: usize,
    image_limit: usize,
    call: impl FnOnce(OutputSink) -> T,
    stop: S,
) -> Result<T::Output, (S::Output, Partial)>
where
    T: Future,
    S: Future,
{
    let (sink, mut events) = mpsc::channel::<OutputEvent>(BUFFER);
    let mut partial = Partial::new(text_limit, image_limit);
    let relay = |partial: &mut Partial, event: OutputEvent| {
        partial.keep(&event);
        if let Some(face) = &face {
            // As the sandbox does for its sink: a face that falls behind misses events.
            let _ = face.try_send(event);
        }
    };
    let call = call(Some(sink));
    tokio::pin!(call);
    tokio::pin!(stop);
    let ended = loop {
        tokio::select! {
            biased;
            Some(event) = events.recv() => relay(&mut partial, event),
            done = &mut call => break Ok(done),
            by = &mut stop => break Err(by),
        }
    };
    // What was sent before the end and not yet read.
    while let Ok(event) = events.try_recv() {
        relay(&mut partial, event);
    }
    ended.map_err(|by| (by, partial))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stopped_call_answers_with_what_it_printed_and_the_face_saw_it_too() {
        let (face, mut seen) = mpsc::channel(16);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<&str>();
        let call = |sink: OutputSink| async move {
            let sink = sink.expect("a sink");
            sink.send(OutputEvent::Stdout("half ".into()))
                .await
                .unwrap();
            sink.send(OutputEvent::Stderr("warn\n".into()))
                .await
                .unwrap();
            sink.send(OutputEvent::Stdout("way\n".into()))
                .await
                .unwrap();
            let _ = stop_tx.send("ada@example.test");
            std::future::pending::<()>().await;
        };
        let ended = run_keeping(Some(face), 1024, 1024, call, async {
            stop_rx.await.unwrap()
        })
        .await;
        let Err((by, partial)) = ended else {
            panic!("the call never ends: it was stopped")
        };
        assert_eq!(by, "ada@example.test");
        assert_eq!(partial.stdout, "half way\n");
        assert_eq!(partial.stderr, "warn\n");
        assert!(!partial.truncated);
        let mut relayed = Vec::new();
        while let Ok(event) = seen.try_recv() {
            relayed.push(event);
        }
        assert_eq!(relayed.len(), 3, "the face got every event: {relayed:?}");
    }

    #[tokio::test]
    async fn a_call_that_ends_answers_itself() {
        let call = |sink: OutputSink| async move {
            sink.unwrap()
                .send(OutputEvent::Stdout("x".into()))
                .await
                .unwrap();
            7
        };
        let ended = run_keeping(None, 16, 16, call, std::future::pending::<()>()).await;
        assert!(matches!(ended, Ok(7)));
    }

    #[test]
    fn output_is_kept_up_to_the_limits_and_says_when_it_was_cut() {
        let mut partial = Partial::new(6, 4);
        partial.keep(&OutputEvent::Stdout("abc".into()));
        partial.keep(&OutputEvent::Stderr("dé".into()));
        // 3 + 3 bytes: full; the next piece is cut (at a character boundary).
        partial.keep(&OutputEvent::Stdout("zz".into()));
        assert_eq!(
            (partial.stdout.as_str(), partial.stderr.as_str()),
            ("abc", "dé")
        );
        assert!(partial.truncated);
        let mut partial = Partial::new(100, 4);
        partial.keep(&OutputEvent::Display(Display {
            png: Some(vec![0; 3]),
            ..Display::default()
        }));
        partial.keep(&OutputEvent::Display(Display {
            png: Some(vec![0; 3]),
            ..Display::default()
        }));
        assert_eq!(partial.displays.len(), 1);
        assert!(partial.truncated, "the second image is past the limit");
    }
}
