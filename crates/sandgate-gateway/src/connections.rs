//! Serving connections with bounds a hostile client cannot stretch (DESIGN §8a): a cap on open
//! connections, a share of it per client address (IPv6 counted per /64; behind a reverse proxy,
//! requests in flight per address from the proxy's header), a deadline for a request's headers,
//! one for its body, an idle timeout, and an age after which a connection that never carried an
//! authenticated request is closed (issue 24).
//!
//! `axum::serve` exposes none of hyper's timeouts, so the accept loop is here: hyper-util's
//! connection builder (with `header_read_timeout`, which on HTTP/1.1 also bounds how long a
//! keep-alive connection waits for its next request), graceful shutdown of each connection, a
//! semaphore of connection slots taken *before* `accept` (beyond the cap, new connections wait
//! in the kernel's backlog and use no memory here), and a stream wrapper that closes an idle
//! connection: one on which no byte moved either way for `idle_timeout_seconds` *and* no
//! request is being answered. The rule holds on HTTP/2 too: the server sends no keep-alive pings,
//! whose acknowledgements would keep an unused connection open for ever.
//!
//! A request is "being answered" from when hyper hands it to the service until the service has
//! produced the response head (its future completed or was dropped). A stateless 2026-07-28
//! tool call is answered with one JSON body when the call ends, and nothing moves on its
//! connection meanwhile: without this rule a call longer than the idle timeout lost its
//! connection, and its caller the answer. Such a request is bounded by what it waits for (the
//! call's deadline, the lease's wait, the body read timeout), not by the idle timeout. Once the
//! head is out, the body is on its own again: an SSE stream moves keep-alives, a download moves
//! data, and a client that stops reading is closed after `idle_timeout_seconds`.

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
use sandgate_mcp::refusal::{OversizedBody, too_large};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use addresses::{ClientLimit, Holding, PerAddress};
pub use sandgate_mcp::auth::ConnectionAuth;

mod addresses;

pub use sandgate_service::config::HttpConfig;

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish.
/// Each request carries `ConnectInfo<SocketAddr>` (the peer address) and the connection's
/// [`ConnectionAuth`].
pub async fn serve(
    listener: TcpListener,
    app: Router,
    config: &HttpConfig,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let behind_proxy = !config.client_address_header.is_empty();
    // Directly reachable: connections per peer address. Behind a proxy every peer is the proxy,
    // so the same cap counts the requests in flight per client address from its header.
    let per_peer = PerAddress::new(if behind_proxy {
        0
    } else {
        config.max_connections_per_address
    });
    let per_client = Arc::new(ClientLimit {
        header: config.client_address_header.clone(),
        open: PerAddress::new(if behind_proxy {
            config.max_connections_per_address
        } else {
            0
        }),
    });
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let idle = Duration::from_secs(config.idle_timeout_seconds);
    let anonymous_age = Duration::from_secs(config.anonymous_max_age_seconds);
    let builder = Arc::new(builder(config));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = accept(&listener, &slots) => accepted,
        };
        let Some((stream, peer, slot)) = accepted else {
            continue;
        };
        let Some(per_peer) = per_peer.admit(peer.ip()) else {
            tracing::debug!(%peer, "closed a connection over the per-address cap");
            continue;
        };
        let auth = ConnectionAuth::default();
        let answering = Answering::new();
        let io = TokioIo::new(IdleTimeout::new(stream, idle, answering.clone()));
        let service = connection_service(
            app.clone(),
            peer,
            auth.clone(),
            answering,
            Arc::clone(&per_client),
        );
        let builder = Arc::clone(&builder);
        let stop = stop.clone();
        tracker.spawn(async move {
            let connection = builder.serve_connection_with_upgrades(io, service);
            let ended = run_connection(connection, &auth, anonymous_age, &stop).await;
            if let Err(err) = ended {
                tracing::debug!(error = %err, %peer, "connection ended with an error");
            }
            drop((slot, per_peer));
        });
    }
    stop.cancel();
    tracker.close();
    tracker.wait().await;
}

/// hyper's connection builder with the header deadline, and no HTTP/2 keep-alive pings: their
/// acknowledgements would move bytes, and an HTTP/2 connection with nothing to do would never
/// count as idle (any client stack answers pings). A peer that vanished is caught by the idle
/// timeout all the same: nothing moves.
fn builder(config: &HttpConfig) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(config.header_read_timeout_seconds));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(None);
    builder
}

/// The per-request service of one connection: the peer and the connection's mark in the
/// request's extensions, the request counted as being answered until its response head, and
/// (behind a proxy) against its client address's cap until its response body ends.
fn connection_service(
    app: Router,
    peer: SocketAddr,
    auth: ConnectionAuth,
    answering: Answering,
    per_client: Arc<ClientLimit>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<Response, std::convert::Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |mut request: Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        request.extensions_mut().insert(auth.clone());
        let held = per_client.admit(peer, request.headers());
        // Held until the response head exists, released too when hyper drops the future
        // (the client went away, the connection ended).
        let answer = answering.start();
        let response = app.clone().oneshot(request.map(Body::new));
        async move {
            let Ok(held) = held else {
                drop(answer);
                return Ok(busy_client());
            };
            let response = response.await;
            drop(answer);
            Ok(match (response, held) {
                (Ok(response), Some(held)) => {
                    response.map(|body| Body::new(Holding::new(body, held)))
                }
                (Ok(response), None) => response,
                (Err(never), _) => match never {},
            })
        }
    })
}

/// Runs one connection to its end. An anonymous connection (no request on it carried a verified
/// access token) is closed gracefully once `anonymous_age` has passed since it opened: what it
/// is answering is finished, then it closes, so that bytes sent now and then (a `/healthz` every
/// minute, HTTP/2 pings) cannot hold a connection slot for ever. At shutdown every connection
/// is closed the same way.
async fn run_connection<C>(
    connection: C,
    auth: &ConnectionAuth,
    anonymous_age: Duration,
    stop: &CancellationToken,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    C: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Closable,
{
    tokio::pin!(connection);
    let aged = tokio::time::sleep(anonymous_age);
    tokio::pin!(aged);
    let (mut closing, mut aged_checked) = (false, false);
    loop {
        tokio::select! {
            ended = connection.as_mut() => return ended,
            () = stop.cancelled(), if !closing => {
                closing = true;
                connection.as_mut().close_gracefully();
            }
            () = &mut aged, if !closing && !aged_checked => {
                aged_checked = true;
                if !auth.is_authenticated() {
                    tracing::debug!("closing an anonymous connection at its age limit");
                    closing = true;
                    connection.as_mut().close_gracefully();
                }
            }
        }
    }
}

/// A connection that can be asked to finish what it is answering and close.
trait Closable {
    fn close_gracefully(self: Pin<&mut Self>);
}

impl<I, S, E> Closable for hyper_util::server::conn::auto::UpgradeableConnection<'_, I, S, E>
where
    S: hyper::service::HttpService<Incoming>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::ResBody: hyper::body::Body + Send + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, S::ResBody>,
{
    fn close_gracefully(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// 503 for a client address (behind a proxy) at its cap of requests in flight.
fn busy_client() -> Response {
    let mut response = refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        "too many requests from your address are open at once; finish some, then retry",
    );
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static("1"),
    );
    response
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

/// The requests of one connection that are being answered (received, their response head not
/// produced yet), and when the last of them was. While one is, the connection is busy, not idle.
#[derive(Clone)]
struct Answering(Arc<std::sync::Mutex<Busy>>);

struct Busy {
    /// Requests being answered now.
    open: usize,
    /// When the last answer was produced (the connection's start before the first).
    since: Instant,
}

/// One request being answered; no longer once dropped.
struct Answer(Answering);

impl Answering {
    fn new() -> Self {
        Self(Arc::new(std::sync::Mutex::new(Busy {
            open: 0,
            since: Instant::now(),
        })))
    }

    fn busy(&self) -> std::sync::MutexGuard<'_, Busy> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn start(&self) -> Answer {
        self.busy().open += 1;
        Answer(self.clone())
    }

    /// `None` while a request is being answered; else when the last answer was produced.
    fn idle_since(&self) -> Option<Instant> {
        let busy = self.busy();
        (busy.open == 0).then_some(busy.since)
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        let mut busy = self.0.busy();
        busy.open -= 1;
        if busy.open == 0 {
            busy.since = Instant::now();
        }
    }
}

/// A stream that fails with `TimedOut` once, for `idle`, no byte moved either way and no request
/// was being answered.
struct IdleTimeout<S> {
    inner: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    answering: Answering,
}

impl<S> IdleTimeout<S> {
    fn new(inner: S, idle: Duration, answering: Answering) -> Self {
        Self {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            answering,
        }
    }

    fn moved(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    /// Whether the connection has been idle for `idle`. A deadline that passes while a request
    /// is being answered, or less than `idle` after one was, is moved on instead (and polled
    /// again, so this task is woken at the new one).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        while self.deadline.as_mut().poll(cx).is_ready() {
            let next = match self.answering.idle_since() {
                None => Instant::now() + self.idle,
                Some(since) if since + self.idle > Instant::now() => since + self.idle,
                Some(_) => return true,
            };
            self.deadline.as_mut().reset(next);
        }
        false
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, DuplexStream};

    use super::*;

    const IDLE: Duration = Duration::from_secs(10);

    /// A wrapped connection on which the peer (kept open) sends nothing.
    fn silent() -> (IdleTimeout<DuplexStream>, DuplexStream, Answering) {
        let (ours, peer) = tokio::io::duplex(64);
        let answering = Answering::new();
        let stream = IdleTimeout::new(ours, IDLE, answering.clone());
        (stream, peer, answering)
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_on_which_nothing_happens_is_closed() {
        let (mut stream, _peer, _answering) = silent();
        let error = stream
            .read(&mut [0; 8])
            .await
            .expect_err("an idle connection fails its read");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_being_answered_keeps_a_silent_connection_and_idle_counts_from_its_answer() {
        let (mut stream, _peer, answering) = silent();
        let mut buf = [0; 8];
        let answer = answering.start();
        let waited = tokio::time::timeout(IDLE * 5 / 2, stream.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "nothing ends the connection while a request is being answered: {waited:?}"
        );
        // Answered between two of the deadline's checks: the idle time counts from here.
        drop(answer);
        let waited = tokio::time::timeout(IDLE * 3 / 4, stream.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "not idle yet, less than the idle timeout after the answer: {waited:?}"
        );
        let error = stream
            .read(&mut buf)
            .await
            .expect_err("idle again once the answer is out: the connection fails");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_dropped_unanswered_no_longer_holds_the_connection() {
        let (mut stream, _peer, answering) = silent();
        let (first, second) = (answering.start(), answering.start());
        drop(first);
        let mut buf = [0; 8];
        let waited = tokio::time::timeout(IDLE * 2, stream.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "the second request still holds it: {waited:?}"
        );
        // Cancelled: the future that held it is dropped (the client went away).
        drop(second);
        let error = stream
            .read(&mut buf)
            .await
            .expect_err("no request left: the idle connection fails");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }
}
