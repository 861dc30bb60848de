//! The node's handle on one zygote (agent/sandgate_agent/zygote.py): starting it in an image's
//! root filesystem, asking it for children, and hearing when they end.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::json;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use sandgate_lean::host::{self, ZygoteLaunch};
use sandgate_lean::spec::{ABI_VERSION, EnterSpec, SOURCE_HASH};

use super::rootfs::RootFs;
use crate::docker::{AGENT_BOOTSTRAP, agent_argument};

/// How long a zygote may take to import the data stack and say ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a spawn may wait for the zygote's answer.
const SPAWN_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_MESSAGE: usize = 1 << 16;

/// Variables that keep the zygote single-threaded after its imports: without them OpenBLAS's and
/// OpenMP's pools and jemalloc's background thread (pyarrow's) start threads at import.
const SINGLE_THREADED: [(&str, &str); 4] = [
    ("OPENBLAS_NUM_THREADS", "1"),
    ("OMP_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
    ("JE_ARROW_MALLOC_CONF", "background_thread:false"),
];

#[derive(Debug, Deserialize)]
struct Message {
    op: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    pid: Option<i32>,
    #[serde(default)]
    code: Option<i64>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    abi: Option<u32>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    threads: Option<u32>,
}

/// Spawns waiting for the zygote's answer, by sandbox id: the child's pid, or why not.
type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<Result<i32, String>>>>>;

/// Told of every child the zygote reaps: (host pid, exit code or minus the signal).
pub type ExitSink = Arc<dyn Fn(i32, i64) + Send + Sync>;

/// A running zygote.
pub struct Zygote {
    /// The engine's id of the image it runs.
    pub image_id: String,
    /// Its host pid.
    pub pid: u32,
    /// When it said ready.
    pub started: Instant,
    sock: Arc<AsyncFd<OwnedFd>>,
    pending: Pending,
    alive: Arc<std::sync::atomic::AtomicBool>,
    child: Mutex<std::process::Child>,
}

impl std::fmt::Debug for Zygote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zygote")
            .field("image_id", &self.image_id)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Zygote {
    /// Starts a zygote in `rootfs` with the lean library at `library`, and waits for it to say
    /// ready (single-threaded, the library's interface version ours).
    pub async fn start(rootfs: &RootFs, library: &Path, on_exit: ExitSink) -> io::Result<Self> {
        let bytes = tokio::fs::read(library).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "reading the lean engine's library {}: {e} (build it with `cargo build -p sandgate-lean`)",
                    library.display()
                ),
            )
        })?;
        let lib = host::sealed_memfd(c"sandgate-lean", &bytes)?;
        let (ours, theirs) = host::seqpacket_pair()?;
        let mut env: Vec<(String, String)> = rootfs.env.clone();
        env.retain(|(k, _)| !SINGLE_THREADED.iter().any(|(s, _)| s == k) && k != "HOME");
        env.extend(
            SINGLE_THREADED
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        env.push(("HOME".into(), "/home/user".into()));
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.push((
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ));
        }
        env.push((
            "SANDGATE_ZYGOTE_FD".into(),
            std::os::fd::AsRawFd::as_raw_fd(&theirs).to_string(),
        ));
        env.push((
            "SANDGATE_LEAN_LIB_FD".into(),
            std::os::fd::AsRawFd::as_raw_fd(&lib).to_string(),
        ));
        let mut child = host::spawn_zygote(ZygoteLaunch {
            rootfs: rootfs.path.clone(),
            program: "/usr/bin/python3".into(),
            args: vec![
                "-u".into(),
                "-c".into(),
                AGENT_BOOTSTRAP.into(),
                agent_argument().to_owned(),
                "zygote".into(),
            ],
            env,
            inherit: vec![theirs, lib],
        })?;
        let pid = child.id();
        forward_output(&mut child, pid);
        // An OwnedFd owns its descriptor: the I/O-safety hole behind the deprecation (a wrapped
        // value that does not own the descriptor it names) cannot occur.
        #[allow(deprecated)]
        let sock = Arc::new(AsyncFd::new(ours)?);
        let ready = tokio::time::timeout(READY_TIMEOUT, recv(&sock))
            .await
            .map_err(|_| io::Error::other("the zygote did not say ready in time"))??;
        let ready = ready.ok_or_else(|| {
            io::Error::other("the zygote ended before it said ready (its log says why)")
        })?;
        if ready.op != "ready" {
            return Err(io::Error::other(format!(
                "the zygote said {:?} first",
                ready.op
            )));
        }
        if ready.abi != Some(ABI_VERSION) {
            return Err(io::Error::other(format!(
                "the zygote loaded a lean library of interface {:?}, this node's is {ABI_VERSION}",
                ready.abi
            )));
        }
        if ready.source.as_deref() != Some(SOURCE_HASH) {
            return Err(io::Error::other(format!(
                "the lean library {} was built from other sources ({:?}) than this node ({SOURCE_HASH}): \
                 rebuild it (cargo build -p sandgate-lean)",
                library.display(),
                ready.source
            )));
        }
        if ready.threads != Some(1) {
            return Err(io::Error::other(format!(
                "the zygote has {:?} threads after its imports; it must have one",
                ready.threads
            )));
        }
        let zygote = Self {
            image_id: rootfs.image_id.clone(),
            pid,
            started: Instant::now(),
            sock,
            pending: Arc::default(),
            alive: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            child: Mutex::new(child),
        };
        zygote.spawn_reader(on_exit);
        tracing::info!(pid, image_id = %zygote.image_id, "zygote ready");
        Ok(zygote)
    }

    fn spawn_reader(&self, on_exit: ExitSink) {
        let sock = self.sock.clone();
        let pending = self.pending.clone();
        let alive = self.alive.clone();
        tokio::spawn(async move {
            while let Ok(Some(msg)) = recv(&sock).await {
                match msg.op.as_str() {
                    "spawned" | "refused" => {
                        let id = msg.id.unwrap_or_default();
                        let waiter = pending
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&id);
                        if let Some(waiter) = waiter {
                            let answer = match msg.pid {
                                Some(pid) if msg.op == "spawned" => Ok(pid),
                                _ => Err(msg.error.unwrap_or_else(|| "refused".into())),
                            };
                            let _ = waiter.send(answer);
                        }
                    }
                    "exited" => {
                        if let (Some(pid), Some(code)) = (msg.pid, msg.code) {
                            on_exit(pid, code);
                        }
                    }
                    _ => {}
                }
            }
            alive.store(false, std::sync::atomic::Ordering::SeqCst);
            // Whoever waits for an answer gets one now.
            pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
            tracing::warn!("a zygote ended; the next sandbox starts a new one");
        });
    }

    /// Whether it still serves (its reader has not seen it go, and its process has not ended).
    pub fn alive(&self) -> bool {
        if !self.alive.load(std::sync::atomic::Ordering::SeqCst) {
            return false;
        }
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        matches!(child.try_wait(), Ok(None))
    }

    /// Forks a child that builds its container from `spec` and becomes the sandbox `id`'s agent,
    /// on `stdio` (its stdin and stdout) and `stderr`; returns its host pid.
    pub async fn spawn(
        &self,
        id: &str,
        spec: &EnterSpec,
        stdio: OwnedFd,
        stderr: OwnedFd,
    ) -> io::Result<i32> {
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), tx);
        let message = json!({"op": "spawn", "id": id, "spec": spec}).to_string();
        let sent = send(
            &self.sock,
            message.as_bytes(),
            &[stdio.as_fd(), stderr.as_fd()],
        )
        .await;
        drop((stdio, stderr));
        if let Err(err) = sent {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(id);
            return Err(err);
        }
        match tokio::time::timeout(SPAWN_TIMEOUT, rx).await {
            Ok(Ok(Ok(pid))) => Ok(pid),
            Ok(Ok(Err(refusal))) => Err(io::Error::other(format!("the zygote refused: {refusal}"))),
            Ok(Err(_)) => Err(io::Error::other("the zygote ended before it answered")),
            Err(_) => {
                self.pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(id);
                Err(io::Error::other("the zygote did not answer in time"))
            }
        }
    }

    /// Ends the zygote (its children live on).
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn recv(sock: &AsyncFd<OwnedFd>) -> io::Result<Option<Message>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut guard = sock.readable().await?;
        match guard.try_io(|fd| host::recv_message(fd.get_ref().as_fd(), &mut buf)) {
            Ok(Ok((0, _))) => return Ok(None),
            Ok(Ok((n, _fds))) => {
                return serde_json::from_slice(&buf[..n])
                    .map(Some)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

async fn send(
    sock: &AsyncFd<OwnedFd>,
    data: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<()> {
    loop {
        let mut guard = sock.writable().await?;
        match guard.try_io(|fd| host::send_message(fd.get_ref().as_fd(), data, fds)) {
            Ok(result) => return result,
            Err(_would_block) => continue,
        }
    }
}

/// The zygote's stdout and stderr go to the node's log, a line an event.
fn forward_output(child: &mut std::process::Child, pid: u32) {
    let streams: Vec<Box<dyn std::io::Read + Send>> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    .collect();
    for stream in streams {
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stream).lines() {
                match line {
                    Ok(line) => tracing::info!(zygote = pid, "{line}"),
                    Err(_) => break,
                }
            }
        });
    }
}
