//! The node RPC's TLS connections, made with the material of the moment (so a renewed
//! certificate serves the next connection): a node's accepted ones, a gateway's dialled ones.

use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector, server::TlsStream};
use tokio_stream::wrappers::ReceiverStream;

use super::NodeTls;
use super::verify::url_host;

/// How long a peer has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A node's accepted TLS connections, each handshaken with the material of its moment; the
/// stream tonic serves (peers whose certificate fails are logged and dropped here).
pub(crate) type Incoming = ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>>;

/// Accepts on `listener` until the returned stream is dropped.
pub(crate) fn incoming(listener: TcpListener, tls: NodeTls) -> Incoming {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        tracing::warn!(error = %err, "the node RPC listener failed to accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            // TCP_NODELAY: without it a reply's last small frame (the trailers) waits for the
            // ACK of the previous one, and the caller's delayed ACK adds ~40 ms to every call.
            let _ = tcp.set_nodelay(true);
            let (tx, tls) = (tx.clone(), tls.clone());
            // A slow or hostile peer's handshake must not hold the next one back.
            tokio::spawn(async move {
                let config = match tls.server_config() {
                    Ok(config) => config,
                    Err(err) => {
                        tracing::error!(error = %err, "the node TLS material cannot be used");
                        return;
                    }
                };
                let handshake = TlsAcceptor::from(config).accept(tcp);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(err)) => {
                        tracing::warn!(%peer, error = %err, "refused a node RPC client");
                    }
                    Err(_) => {
                        tracing::warn!(%peer, "a node RPC client did not finish its TLS handshake")
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// The connection a gateway's channel makes to a node: TCP, then TLS with the material of the
/// moment, verifying the node's certificate for the host of the URL dialled.
pub(crate) fn connector(
    tls: NodeTls,
) -> impl tower::Service<
    http::Uri,
    Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>>
             + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: http::Uri| {
        let tls = tls.clone();
        async move {
            let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            let host =
                url_host(&uri.to_string()).ok_or_else(|| invalid(format!("no host in {uri}")))?;
            let port = uri.port_u16().unwrap_or(443);
            let name = rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|e| invalid(format!("{host}: {e}")))?;
            let config = tls.client_config().map_err(std::io::Error::other)?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let stream = TlsConnector::from(config).connect(name, tcp).await?;
            Ok(TokioIo::new(stream))
        }
    })
}
