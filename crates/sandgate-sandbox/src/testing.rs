//! An in-memory fake of the backend and the agent, for unit tests of the channel and pool logic.
//! The real behaviour is tested against Docker in `tests/it`.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream_shim::ReceiverStream;

use crate::backend::{
    AgentStreams, BackendError, ContainerFate, LaunchSpec, Launched, ManagedContainer,
    SandboxBackend, StreamChunk,
};

/// A tiny stand-in for tokio-stream's `ReceiverStream`.
mod tokio_stream_shim {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::sync::mpsc;

    pub struct ReceiverStream<T>(pub mpsc::Receiver<T>);

    impl<T> futures::Stream for ReceiverStream<T> {
        type Item = T;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
}

type Out = mpsc::Sender<io::Result<StreamChunk>>;

async fn emit(out: &Out, frame: Value) {
    let mut line = serde_json::to_vec(&frame).unwrap();
    line.push(b'\n');
    // Split every frame in two pieces, as Docker may.
    let half = line.len() / 2;
    let second = line.split_off(half);
    let _ = out.send(Ok(StreamChunk::Stdout(line.into()))).await;
    let _ = out.send(Ok(StreamChunk::Stdout(second.into()))).await;
}

/// Controls a fake agent: `kill` ends its output stream (a crash); `received` logs every request.
#[derive(Debug, Clone)]
pub(crate) struct FakeAgent {
    pub kill: watch::Sender<bool>,
    pub received: Arc<Mutex<Vec<Value>>>,
    /// Set to let a `read_file` of `gated:N` send the rest of its chunks and its answer.
    pub release: watch::Sender<bool>,
}

impl FakeAgent {
    pub fn received_ops(&self) -> Vec<String> {
        let received = self.received.lock().unwrap();
        received
            .iter()
            .map(|f| f["op"].as_str().unwrap_or("").to_owned())
            .collect()
    }
}

/// Starts a fake agent; returns the streams a channel opens over and its controls.
pub(crate) fn fake_agent(send_ready: bool) -> (AgentStreams, FakeAgent) {
    let (input, agent_side) = tokio::io::duplex(1 << 20);
    let (out, rx) = mpsc::channel(64);
    let (kill, mut killed) = watch::channel(false);
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let log = received.clone();
    let (release, released) = watch::channel(false);
    tokio::spawn(async move {
        let incarnation = Arc::new(AtomicUsize::new(0));
        let interrupts: Arc<Mutex<HashMap<u64, watch::Sender<bool>>>> = Arc::default();
        if send_ready {
            emit(
                &out,
                json!({"event": "ready", "protocol": 2, "pid": 7, "kernel_pid": 8}),
            )
            .await;
        }
        let mut lines = BufReader::new(agent_side).lines();
        loop {
            let line = tokio::select! {
                line = lines.next_line() => line,
                _ = killed.wait_for(|k| *k) => break,
            };
            let Ok(Some(line)) = line else { break };
            let frame: Value = serde_json::from_str(&line).unwrap();
            log.lock().unwrap().push(frame.clone());
            let id = frame["id"].as_u64().unwrap();
            match frame["op"].as_str().unwrap() {
                "ping" => emit(&out, json!({"id": id, "ok": true, "result": {"pong": true, "pid": 7, "busy": false}})).await,
                "interrupt" => {
                    let target = frame["target"].as_u64().unwrap();
                    let hit = interrupts.lock().unwrap().remove(&target);
                    let interrupted = hit.map(|tx| tx.send(true).is_ok()).unwrap_or(false);
                    emit(&out, json!({"id": id, "ok": true, "result": {"interrupted": interrupted}})).await;
                }
                "restart" => {
                    incarnation.fetch_add(1, Ordering::SeqCst);
                    interrupts.lock().unwrap().clear();
                    emit(&out, json!({"id": id, "ok": true, "result": {"restarted": true, "kernel_pid": 9}})).await;
                }
                "exec" => {
                    let code = frame["code"].as_str().unwrap().to_owned();
                    if code == "crash" {
                        break;
                    }
                    if let Some(n) = code.strip_prefix("stderr:") {
                        // Floods the container's stderr (not a frame), then answers.
                        for i in 0..n.parse::<usize>().unwrap() {
                            let line = format!("noise line {i}\n");
                            let _ = out.send(Ok(StreamChunk::Stderr(line.into_bytes().into()))).await;
                        }
                        emit(&out, json!({"id": id, "ok": true, "result": {"execution_count": 1, "result": null, "error": null, "truncated": false}})).await;
                        continue;
                    }
                    let (itx, mut irx) = watch::channel(false);
                    interrupts.lock().unwrap().insert(id, itx);
                    let out = out.clone();
                    let incarnation = incarnation.clone();
                    let born = incarnation.load(Ordering::SeqCst);
                    tokio::spawn(async move {
                        if let Some(ms) = code.strip_prefix("sleep:") {
                            let ms: u64 = ms.parse().unwrap();
                            let interrupted = tokio::select! {
                                () = tokio::time::sleep(Duration::from_millis(ms)) => false,
                                Ok(_) = irx.wait_for(|i| *i) => true,
                            };
                            let error = interrupted.then(|| json!({"name": "KeyboardInterrupt", "value": "", "traceback": []}));
                            emit(&out, json!({"id": id, "ok": true, "result": {"execution_count": 1, "result": null, "error": error, "truncated": false}})).await;
                        } else if code == "stuck" {
                            // Ignores interrupts; only a restart ends it (and then never answers).
                            std::future::pending::<()>().await;
                        } else if let Some(n) = code.strip_prefix("print:") {
                            let n: usize = n.parse().unwrap();
                            let mut sent = 0;
                            while sent < n {
                                let piece = (n - sent).min(64 * 1024);
                                emit(&out, json!({"id": id, "event": "stdout", "data": "x".repeat(piece)})).await;
                                sent += piece;
                            }
                            emit(&out, json!({"id": id, "ok": true, "result": {"execution_count": 1, "result": null, "error": null, "truncated": false}})).await;
                        } else if incarnation.load(Ordering::SeqCst) == born {
                            emit(&out, json!({"id": id, "ok": true, "result": {"execution_count": 1, "result": {"text/plain": code}, "error": null, "truncated": false}})).await;
                        }
                    });
                }
                "read_file" => {
                    // `gated:N` / `corrupt:N`: N chunks of 1 KiB ("a", "b", …); the first at
                    // once, the rest and the answer once released; `corrupt:` announces a wrong
                    // checksum.
                    let path = frame["path"].as_str().unwrap().to_owned();
                    let (corrupt, n) = match path.split_once(':') {
                        Some(("corrupt", n)) => (true, n.parse::<u8>().unwrap()),
                        Some((_, n)) => (false, n.parse::<u8>().unwrap()),
                        None => (false, 1),
                    };
                    let out = out.clone();
                    let mut released = released.clone();
                    tokio::spawn(async move {
                        use base64::Engine as _;
                        use sha2::Digest as _;
                        let mut hasher = sha2::Sha256::new();
                        for i in 0..n {
                            if i == 1 {
                                let _ = released.wait_for(|r| *r).await;
                            }
                            let chunk = vec![b'a' + i; 1024];
                            hasher.update(&chunk);
                            let data = base64::engine::general_purpose::STANDARD.encode(&chunk);
                            emit(&out, json!({"id": id, "event": "chunk", "data": data})).await;
                        }
                        if n <= 1 {
                            let _ = released.wait_for(|r| *r).await;
                        }
                        let mut sha = hex::encode(hasher.finalize());
                        if corrupt {
                            sha = "0".repeat(64);
                        }
                        emit(&out, json!({"id": id, "ok": true, "result": {"path": format!("/home/user/{path}"), "size": u64::from(n) * 1024, "sha256": sha}})).await;
                    });
                }
                // `egress_serve`: 70 CONNECTs at once, never closed (an agent that does not
                // close its side); the relay's answers arrive as `chunk` frames (logged).
                "egress_serve" => {
                    for cid in 1..=70 {
                        emit(&out, json!({"id": id, "event": "egress_open", "cid": cid, "authority": "shop.test:443"})).await;
                    }
                }
                "chunk" => {}
                other => panic!("fake agent got an unexpected op {other}"),
            }
        }
        // Dropping `out` ends the output stream.
    });
    // Killing ends the stream at once, whatever the agent's tasks still hold.
    let mut killed = kill.subscribe();
    let ended = async move {
        let _ = killed.wait_for(|k| *k).await;
    };
    let streams = AgentStreams {
        output: ReceiverStream(rx).take_until(ended).boxed(),
        input: Box::pin(input),
    };
    (
        streams,
        FakeAgent {
            kill,
            received,
            release,
        },
    )
}

#[derive(Debug)]
struct FakeContainer {
    spec: LaunchSpec,
    fate: ContainerFate,
    kill: watch::Sender<bool>,
}

/// A backend whose containers are fake agents in this process.
#[derive(Debug, Default)]
pub(crate) struct FakeBackend {
    containers: Mutex<HashMap<String, FakeContainer>>,
    next: AtomicUsize,
    /// When set, launches wait for a permit here (to observe concurrency).
    pub gate: Option<Arc<Semaphore>>,
    /// Launches currently in progress, and the most seen at once.
    pub in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
    pub launches: AtomicUsize,
    /// When set, launches fail.
    pub fail: AtomicBool,
}

impl FakeBackend {
    pub fn gated(gate: Arc<Semaphore>) -> Self {
        Self {
            gate: Some(gate),
            ..Self::default()
        }
    }

    pub fn live(&self) -> usize {
        self.containers
            .lock()
            .unwrap()
            .values()
            .filter(|c| c.fate == ContainerFate::Running)
            .count()
    }

    /// Simulates the container dying (e.g. OOM-killed): its stream ends and inspect says why.
    pub fn kill(&self, container_id: &str, fate: ContainerFate) {
        let mut containers = self.containers.lock().unwrap();
        let c = containers.get_mut(container_id).unwrap();
        c.fate = fate;
        let _ = c.kill.send(true);
    }
}

#[async_trait]
impl SandboxBackend for FakeBackend {
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, BackendError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.launches.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err(BackendError::Create {
                sandbox_id: spec.sandbox_id.clone(),
                source: "the fake engine refuses".into(),
            });
        }
        let container_id = format!("fake-{}", self.next.fetch_add(1, Ordering::SeqCst));
        let (streams, FakeAgent { kill, .. }) = fake_agent(true);
        self.containers.lock().unwrap().insert(
            container_id.clone(),
            FakeContainer {
                spec: spec.clone(),
                fate: ContainerFate::Running,
                kill,
            },
        );
        Ok(Launched {
            container_id,
            streams,
        })
    }

    async fn attach(&self, container_id: &str) -> Result<AgentStreams, BackendError> {
        Err(BackendError::Attach {
            container_id: container_id.to_owned(),
            source: "the fake cannot re-attach".into(),
        })
    }

    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError> {
        let containers = self.containers.lock().unwrap();
        Ok(containers.get(container_id).map(|c| ManagedContainer {
            container_id: container_id.to_owned(),
            sandbox_id: c.spec.sandbox_id.clone(),
            profile: c.spec.profile.name.clone(),
            instance: c.spec.instance.clone(),
            managed: true,
            fate: c.fate.clone(),
            created_unix: None,
            image_id: None,
        }))
    }

    async fn remove(&self, container_id: &str) -> Result<(), BackendError> {
        if let Some(c) = self.containers.lock().unwrap().remove(container_id) {
            let _ = c.kill.send(true);
        }
        Ok(())
    }

    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError> {
        let ids: Vec<String> = self.containers.lock().unwrap().keys().cloned().collect();
        let mut out = Vec::new();
        for id in ids {
            if let Some(c) = self.inspect(&id).await?
                && c.instance == instance
            {
                out.push(c);
            }
        }
        Ok(out)
    }
}

/// Polls `cond` until it holds or `within` passes; panics with `what` then.
pub(crate) async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
