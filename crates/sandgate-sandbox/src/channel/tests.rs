//! Unit tests of the channel against the in-memory fake agent.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

use super::error::size_in_message;
use crate::testing::{FakeAgent, eventually, fake_agent};
use std::collections::HashMap;

async fn open() -> (AgentChannel, FakeAgent) {
    let (streams, agent) = fake_agent(true);
    let config = ChannelConfig {
        interrupt_grace: Duration::from_millis(100),
        ready_timeout: Duration::from_secs(5),
        call_timeout: Duration::from_secs(5),
    };
    let channel = AgentChannel::open("sbx_test", streams, config);
    channel
        .wait_ready(Duration::from_secs(5))
        .await
        .expect("fake agent is ready");
    (channel, agent)
}

fn quick(timeout_ms: u64) -> ExecOptions {
    ExecOptions {
        timeout: Duration::from_millis(timeout_ms),
        ..ExecOptions::default()
    }
}

#[tokio::test]
async fn a_ping_is_answered_while_a_cell_runs() {
    let (channel, _agent) = open().await;
    let slow = channel.exec("sleep:2000", quick(10_000), None);
    let ping = async {
        let started = Instant::now();
        channel.ping().await.expect("ping answered");
        started.elapsed()
    };
    tokio::pin!(slow);
    let waited = tokio::select! {
        waited = ping => waited,
        _ = &mut slow => panic!("the cell finished before the ping was answered"),
    };
    assert!(waited < Duration::from_secs(1), "ping took {waited:?}");
}

#[tokio::test]
async fn a_cell_past_its_deadline_is_interrupted_and_keeps_state() {
    let (channel, agent) = open().await;
    let outcome = channel.exec("sleep:10000", quick(50), None).await.unwrap();
    assert!(outcome.timed_out && !outcome.state_lost, "{outcome:?}");
    assert_eq!(outcome.error.unwrap().name, "KeyboardInterrupt");
    assert!(agent.received_ops().contains(&"interrupt".to_owned()));
    assert!(!agent.received_ops().contains(&"restart".to_owned()));
}

#[tokio::test]
async fn a_cell_ignoring_its_interrupt_gets_the_kernel_restarted() {
    let (channel, agent) = open().await;
    let outcome = channel.exec("stuck", quick(50), None).await.unwrap();
    assert!(outcome.timed_out && outcome.state_lost, "{outcome:?}");
    assert!(agent.received_ops().contains(&"restart".to_owned()));
    let next = channel.exec("1+1", quick(5000), None).await.unwrap();
    assert_eq!(next.result.unwrap()["text/plain"], "1+1");
}

#[tokio::test]
async fn calls_in_flight_and_later_fail_with_the_reason_when_the_stream_ends() {
    let (channel, agent) = open().await;
    let pending = tokio::spawn({
        let channel = channel.clone();
        async move { channel.exec("sleep:10000", quick(60_000), None).await }
    });
    eventually(
        "the exec to reach the agent",
        Duration::from_secs(5),
        || agent.received_ops().contains(&"exec".to_owned()),
    )
    .await;
    agent.kill.send(true).unwrap();
    let err = pending.await.unwrap().expect_err("the exec fails");
    assert!(matches!(err, ChannelError::AttachLost { .. }), "{err:?}");
    assert!(err.to_string().contains("stream ended"), "{err}");
    let later = channel.ping().await.expect_err("later calls fail too");
    assert!(
        matches!(later, ChannelError::AttachLost { .. }),
        "{later:?}"
    );
    assert!(channel.is_lost());
}

#[tokio::test]
async fn dropping_a_running_exec_interrupts_it() {
    let (channel, agent) = open().await;
    let exec = channel.exec("sleep:10000", quick(60_000), None);
    let _ = tokio::time::timeout(Duration::from_millis(50), exec).await;
    eventually(
        "an interrupt after the drop",
        Duration::from_secs(5),
        || agent.received_ops().contains(&"interrupt".to_owned()),
    )
    .await;
}

#[tokio::test]
async fn output_beyond_the_limit_is_not_accumulated_even_if_the_agent_sends_it() {
    let (channel, _agent) = open().await;
    let (tx, mut rx) = mpsc::channel(1024);
    let options = ExecOptions {
        output_limit: 1000,
        ..quick(10_000)
    };
    let outcome = channel
        .exec("print:3000000", options, Some(tx))
        .await
        .unwrap();
    assert!(
        outcome.stdout.len() <= 1000 + MARKER_SLACK,
        "kept {}",
        outcome.stdout.len()
    );
    assert!(outcome.truncated);
    assert!(
        outcome.stderr.contains("[output truncated"),
        "{:?}",
        outcome.stderr
    );
    let mut streamed = 0;
    while let Ok(OutputEvent::Stdout(s)) = rx.try_recv() {
        streamed += s.len();
    }
    assert_eq!(
        streamed,
        outcome.stdout.len(),
        "events carry only what was kept"
    );
}

#[test]
fn too_large_messages_yield_the_size() {
    assert_eq!(
        size_in_message("/home/user/big is 12345 bytes, larger than the limit of 10"),
        Some(12345)
    );
    assert_eq!(size_in_message("no numbers here"), None);
}

#[test]
fn output_is_bounded_at_a_char_boundary_and_marked() {
    let mut out = OutputBuffer::new(10, 0);
    let big = "é".repeat(10_000);
    let kept = out.push_text(false, &big).expect("some output kept");
    assert!(kept.len() <= 10 + MARKER_SLACK);
    assert!(out.push_text(true, "more").is_none());
    out.mark_if_dropped(false, 10);
    assert!(out.dropped);
    assert!(out.stderr.contains("[output truncated by the gateway"));
}

/// Counts the events logged with a given message.
#[derive(Clone, Default)]
struct CountEvents(Arc<Mutex<HashMap<String, usize>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountEvents {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        *self.0.lock().unwrap().entry(message.0).or_default() += 1;
    }
}

#[tokio::test]
async fn a_sandbox_flooding_stderr_stays_within_its_log_budget() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let counts = CountEvents::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(counts.clone()));
    let dropped_before = crate::telemetry::counters().stderr_lines_dropped.get();
    let (channel, _agent) = open().await;
    channel
        .exec("stderr:5000", quick(10_000), None)
        .await
        .expect("the cell answers despite the flood");
    drop(channel);
    let counts = counts.0.lock().unwrap().clone();
    let logged = counts.get("sandbox stderr").copied().unwrap_or(0);
    assert!(
        logged <= STDERR_BURST_LINES as usize + 2,
        "{logged} stderr lines reached the log"
    );
    assert!(logged > 0, "the first lines are logged: {counts:?}");
    let dropped = crate::telemetry::counters().stderr_lines_dropped.get() - dropped_before;
    assert!(dropped >= 5000 - logged as u64 - 2, "dropped {dropped}");
}

#[test]
fn an_output_budget_pauses_a_sandbox_that_sends_too_fast() {
    let mut budget = OutputBudget::new();
    assert!(budget.charge(10, 1000).is_zero(), "within budget");
    let pause = budget.charge(100_000, 10);
    assert!(
        pause > Duration::ZERO,
        "100k frames at once are over budget"
    );
    let bytes = budget.charge(1, 1 << 30);
    assert!(bytes > Duration::ZERO, "1 GiB at once is over budget");
}

#[tokio::test]
async fn a_file_streams_chunk_by_chunk_before_the_agent_has_sent_it_all() {
    let (channel, agent) = open().await;
    // The fake sends the first chunk, then waits: a reader that buffered the whole file would
    // never return here.
    let (first, mut rest) = tokio::time::timeout(
        Duration::from_secs(5),
        channel.read_file_stream("gated:3", 1 << 20),
    )
    .await
    .expect("the first chunk comes back before the rest of the file was sent")
    .expect("the read starts");
    assert_eq!(first.as_ref(), vec![b'a'; 1024].as_slice());
    agent.release.send(true).unwrap();
    let mut got = Vec::new();
    while let Some(chunk) = rest.next().await {
        got.extend_from_slice(&chunk.expect("the rest arrives intact"));
    }
    let expected: Vec<u8> = [vec![b'b'; 1024], vec![b'c'; 1024]].concat();
    assert_eq!(got, expected, "the rest, in order");
}

#[tokio::test]
async fn a_streamed_file_whose_checksum_does_not_match_ends_in_an_error() {
    let (channel, agent) = open().await;
    agent.release.send(true).unwrap();
    let (_, mut rest) = channel
        .read_file_stream("corrupt:2", 1 << 20)
        .await
        .expect("the read starts");
    let mut outcome = Vec::new();
    while let Some(chunk) = rest.next().await {
        outcome.push(chunk.is_ok());
    }
    assert_eq!(
        outcome,
        [true, false],
        "the chunk, then an error instead of a clean end"
    );
    assert!(rest.next().await.is_none(), "nothing after the error");
}

/// Admits nothing and refuses nothing: each CONNECT stays waiting for the handler.
struct NeverAnswers(AtomicU64);

impl EgressHandler for NeverAnswers {
    fn open<'a>(
        &'a self,
        _authority: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<EgressUpstream, EgressRefusal>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(std::future::pending())
    }
}

#[tokio::test]
async fn an_agent_that_never_closes_its_connections_gets_no_more_than_64_open() {
    let (channel, agent) = open().await;
    let handler = Arc::new(NeverAnswers(AtomicU64::new(0)));
    let serve = channel.serve_egress(handler.clone());
    let refusals = || {
        agent
            .received
            .lock()
            .unwrap()
            .iter()
            .filter(|f| {
                f["op"] == "chunk"
                    && f["status"] == 429
                    && f["refused"]
                        .as_str()
                        .is_some_and(|t| t.contains("64 egress connections open already"))
            })
            .count()
    };
    tokio::select! {
        ended = serve => panic!("the relay ended: {ended:?}"),
        () = eventually("70 CONNECTs taken", Duration::from_secs(10), || refusals() == 6) => {}
    }
    assert_eq!(
        handler.0.load(Ordering::SeqCst),
        64,
        "the handler was asked for 64 connections, no more"
    );
}
