//! Serving connections with bounds a hostile client cannot stretch (DESIGN §8a): a cap on open
//! connections, a deadline for a request's headers, one for its body, and an idle timeout.
//!
//! `axum::serve` exposes none of hyper's timeouts, so the accept loop is here: hyper-util's
//! connection builder (with `header_read_timeout`, which on HTTP/1.1 also bounds how long a
//! keep-alive connection waits for its next request), its graceful-shutdown watcher, a
//! semaphore of connection slots taken *before* `accept` (beyond the cap, new connections wait
//! in the kernel's backlog and use no memory here), and a stream wrapper that closes a
//! connection on which no byte moved either way for `idle_timeout_seconds`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use sandgate_mcp::refusal::{OversizedBody, too_large};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

pub use sandgate_service::config::HttpConfig;

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish.
/// Each request carries `ConnectInfo<SocketAddr>` (the peer address).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    config: &HttpConfig,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let per_address = PerAddress::new(config.max_connections_per_address);
    let graceful = GracefulShutdown::new();
    let idle = Duration::from_secs(config.idle_timeout_seconds);
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(config.header_read_timeout_seconds));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(idle / 2))
        .keep_alive_timeout(idle / 2);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = accept(&listener, &slots) => accepted,
        };
        let Some((stream, peer, slot)) = accepted else {
            continue;
        };
        let Some(per_address) = per_address.admit(peer.ip()) else {
            tracing::debug!(%peer, "closed a connection over the per-address cap");
            continue;
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            app.clone().oneshot(request.map(Body::new))
        });
        let io = TokioIo::new(IdleTimeout::new(stream, idle));
        let builder = Arc::clone(&builder);
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let connection = builder.serve_connection_with_upgrades(io, service);
            if let Err(err) = watcher.watch(connection).await {
                tracing::debug!(error = %err, %peer, "connection ended with an error");
            }
            drop((slot, per_address));
        });
    }
    graceful.shutdown().await;
}

/// Open connections per client address, capped.
#[derive(Clone)]
struct PerAddress {
    cap: usize,
    open: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

/// One open connection counted against its address; uncounted when dropped.
struct AddressSlot {
    owner: PerAddress,
    ip: std::net::IpAddr,
}

impl PerAddress {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            open: Arc::default(),
        }
    }

    fn counts(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<std::net::IpAddr, usize>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a new connection from `ip`; `None` when that address is at the cap.
    fn admit(&self, ip: std::net::IpAddr) -> Option<AddressSlot> {
        if self.cap > 0 {
            let mut open = self.counts();
            let count = open.entry(ip).or_default();
            if *count >= self.cap {
                return None;
            }
            *count += 1;
        }
        Some(AddressSlot {
            owner: self.clone(),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        if self.owner.cap == 0 {
            return;
        }
        let mut open = self.owner.counts();
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Takes a connection slot, then accepts. `None` after an accept error (a full fd table, a
/// connection reset before it was accepted): the caller simply tries again.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> Option<(TcpStream, SocketAddr, tokio::sync::OwnedSemaphorePermit)> {
    let slot = Arc::clone(slots)
        .acquire_owned()
        .await
        .expect("the slot semaphore is never closed");
    match listener.accept().await {
        Ok((stream, peer)) => {
            // A tool result goes out as several small writes; with Nagle a later write waits
            // for the client's delayed ACK of the earlier one (up to 40 ms).
            if let Err(err) = stream.set_nodelay(true) {
                tracing::debug!(error = %err, "cannot set TCP_NODELAY on a connection");
            }
            Some((stream, peer, slot))
        }
        Err(err) => {
            tracing::warn!(error = %err, "accepting a connection failed");
            // Out of file descriptors and the like: give the process a moment instead of
            // spinning on the error.
            tokio::time::sleep(Duration::from_millis(50)).await;
            None
        }
    }
}

/// A stream that fails with `TimedOut` once no byte moved either way for `idle`.
struct IdleTimeout<S> {
    inner: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> IdleTimeout<S> {
    fn new(inner: S, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn moved(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.deadline.as_mut().poll(cx).is_ready()
    }

    /// A write's outcome: bytes written count as movement; a pending write past the idle
    /// deadline fails.
    fn after_write(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.moved();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }
}

fn idle_error() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "connection idle too long")
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(result)
            }
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(idle_error())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.after_write(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.after_write(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// How [`body_deadline`] reads request bodies.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// The whole body must arrive within this.
    pub timeout: Duration,
    /// Largest body, bytes.
    pub max_bytes: usize,
    /// Instead of answering 413 at once, pass the request on with an empty body and
    /// [`OversizedBody`] in its extensions, so an authenticating layer behind can answer
    /// (and audit) it once it knows who sent it.
    pub defer_too_large: bool,
}

/// Middleware: the whole request body must arrive within the deadline (a client dripping its
/// body a byte at a time cannot hold a handler) and within the size bound. Answers 408 or 413.
/// The body is read here, so handlers behind it see it at once.
pub async fn body_deadline(
    axum::extract::State(limits): axum::extract::State<BodyLimits>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, limits.max_bytes);
    let bytes = match tokio::time::timeout(limits.timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) if limits.defer_too_large => {
            parts.extensions.insert(OversizedBody(limits.max_bytes));
            axum::body::Bytes::new()
        }
        Ok(Err(_)) => return too_large(limits.max_bytes),
        Err(_) => {
            return refusal(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "the request body did not arrive within {} s; send it again at once",
                    limits.timeout.as_secs()
                ),
            );
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

fn refusal(status: StatusCode, code: &str, description: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({ "error": code, "error_description": description })),
    )
        .into_response()
}
