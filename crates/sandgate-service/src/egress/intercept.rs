//! Secrets by placeholder: the TLS interception of a connection a tenant's secret may go into.
//!
//! A CONNECT to a host a secret is bound to is not tunnelled: the egress component terminates the
//! sandbox's TLS with a certificate for the CONNECT target signed by that sandbox's own CA
//! ([`SandboxCa`]: made in this process, its key never leaves it; only the certificate goes into
//! the sandbox's CA bundle), re-originates TLS to the checked address with full verification of
//! the target's name against the system's trust store, and forwards HTTP/1.1 requests one by one.
//! In each request it replaces the secret's placeholder with its value, only in the headers the
//! secret is bound to, only when the TLS name the client asked for (SNI) and the request's Host
//! are the CONNECT target's; it takes the value out of every response (headers and body, also
//! split across chunks, also JSON-escaped or percent-encoded) and asks for no compressed or
//! partial answer to a request that carried a value (a compressed one is refused: it could hide
//! the value from the redaction).

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use zeroize::Zeroizing;

type ProxyBody = BoxBody<Bytes, hyper::Error>;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// One sandbox's egress CA: the certificates the sandbox sees for intercepted hosts are signed
/// by it. Made in memory, per sandbox and process; the sandbox gets the certificate only.
pub(crate) struct SandboxCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pem: String,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa").finish_non_exhaustive()
    }
}

impl SandboxCa {
    /// A new CA for `sandbox_id` (it may sign leaf certificates only: path length 0).
    pub(crate) fn new(sandbox_id: &str) -> Result<Self, rcgen::Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(
            DnType::CommonName,
            format!("sandgate egress CA of {sandbox_id}"),
        );
        params
            .distinguished_name
            .push(DnType::OrganizationName, "sandgate");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params, -1, 3650);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let pem = issuer.pem();
        Ok(Self { issuer, pem })
    }

    /// The CA certificate in PEM (what the sandbox's bundle gets).
    pub(crate) fn pem(&self) -> &str {
        &self.pem
    }

    /// A TLS server configuration presenting a certificate for `host` signed by this CA.
    fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut params =
            CertificateParams::new(vec![host.to_owned()]).map_err(|e| e.to_string())?;
        params.distinguished_name.push(DnType::CommonName, host);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        set_validity(&mut params, -1, 30);
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| e.to_string())?;
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| e.to_string())?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// `params` valid from `days_before` to `days_after` days from today (UTC).
fn set_validity(params: &mut CertificateParams, days_before: i64, days_after: i64) {
    use chrono::Datelike as _;
    let at = |days: i64| {
        let day = chrono::Utc::now().date_naive() + chrono::TimeDelta::days(days);
        rcgen::date_time_ymd(
            day.year(),
            u8::try_from(day.month()).unwrap_or(1),
            u8::try_from(day.day()).unwrap_or(1),
        )
    };
    params.not_before = at(days_before);
    params.not_after = at(days_after);
}

/// The TLS client configuration of re-originated connections: the system's trust store (and, in
/// tests on loopback only, the tests' CA), HTTP/1.1.
pub fn upstream_config(test_ca_pem: Option<&str>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A root the store holds that webpki cannot parse is skipped, as browsers do.
        let _ = roots.add(cert);
    }
    if let Some(pem) = test_ca_pem {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|e| format!("the tests' CA file is not PEM: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("the tests' CA file holds a bad certificate: {e}"))?;
        }
    }
    if roots.is_empty() {
        tracing::warn!(
            errors = ?native.errors,
            "no trusted root certificates found: intercepted egress connections cannot verify any server"
        );
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A secret opened for one connection.
pub(crate) struct OpenSecret {
    /// Its name.
    pub name: String,
    /// This sandbox's placeholder of it.
    pub placeholder: String,
    /// Its value.
    pub value: Zeroizing<Vec<u8>>,
    /// The request headers (lower-case) it may go into.
    pub headers: Vec<String>,
}

/// One intercepted connection.
pub(crate) struct Interception {
    /// The CONNECT target's name (lower-case) and port.
    pub host: String,
    pub port: u16,
    /// What the sandbox is shown: a certificate for `host` from the sandbox's CA.
    pub server: Arc<rustls::ServerConfig>,
    /// How the server is reached.
    pub upstream: Arc<rustls::ClientConfig>,
    /// The secrets bound to `host`.
    pub secrets: Vec<OpenSecret>,
    /// The names of the secrets put into a request so far (for the audit).
    pub injected: Arc<Mutex<BTreeSet<String>>>,
}

impl Interception {
    /// The interception of a connection to `host:port` with `secrets` bound to it, shown a
    /// certificate from `ca`.
    pub(crate) fn new(
        ca: &SandboxCa,
        host: &str,
        port: u16,
        upstream: Arc<rustls::ClientConfig>,
        secrets: Vec<OpenSecret>,
    ) -> Result<Self, String> {
        Ok(Self {
            host: host.to_owned(),
            port,
            server: ca.server_config(host)?,
            upstream,
            secrets,
            injected: Arc::default(),
        })
    }

    /// Serves the sandbox's side `client` (its TLS), forwarding to the server over `server`
    /// (the dialed, checked address), until either side ends.
    pub(crate) async fn run<C, S>(self, client: C, server: S)
    where
        C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(client))
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        {
            Ok(tls) => tls,
            Err(err) => {
                tracing::info!(host = %self.host, %err, "intercepted egress: the sandbox's TLS handshake failed (does the client trust the CA bundle SSL_CERT_FILE names?)");
                return;
            }
        };
        let sni = tls.get_ref().1.server_name().map(str::to_owned);
        let upstream = if sni
            .as_deref()
            .is_some_and(|name| name.eq_ignore_ascii_case(&self.host))
        {
            self.connect(server).await
        } else {
            Err(Refusal::misdirected(format!(
                "the TLS name the client asked for ({}) is not the CONNECT target {}: no secret \
                 goes into this connection",
                sni.as_deref().unwrap_or("none"),
                self.host
            )))
        };
        let forwarder = Arc::new(Forwarder {
            host: self.host,
            port: self.port,
            secrets: self.secrets,
            injected: self.injected,
            upstream: tokio::sync::Mutex::new(upstream),
        });
        let service = hyper::service::service_fn(move |req| {
            let forwarder = forwarder.clone();
            async move { Ok::<_, Infallible>(forwarder.forward(req).await) }
        });
        if let Err(err) = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(REQUEST_HEAD_TIMEOUT)
            .serve_connection(TokioIo::new(tls), service)
            .await
        {
            tracing::debug!(%err, "intercepted egress connection ended");
        }
    }

    /// TLS to the server, verified for the CONNECT target's name, and HTTP/1.1 over it.
    async fn connect<S>(
        &self,
        server: S,
    ) -> Result<hyper::client::conn::http1::SendRequest<Incoming>, Refusal>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let name = ServerName::try_from(self.host.clone()).map_err(|e| {
            Refusal::bad_gateway(format!("{} is not a TLS server name: {e}", self.host))
        })?;
        let connecting =
            tokio_rustls::TlsConnector::from(self.upstream.clone()).connect(name, server);
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
            .map_err(|e| {
                Refusal::bad_gateway(format!(
                    "the TLS connection to {}:{} failed ({e}): its certificate must verify for {} \
                     against the system's trust store",
                    self.host, self.port, self.host
                ))
            })?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| Refusal::bad_gateway(format!("{}:{}: {e}", self.host, self.port)))?;
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%err, "intercepted egress: the server's connection ended");
            }
        });
        Ok(sender)
    }
}

/// Why a request is answered by the egress component itself.
#[derive(Clone)]
struct Refusal {
    status: StatusCode,
    text: String,
}

impl Refusal {
    fn misdirected(text: String) -> Self {
        Self {
            status: StatusCode::MISDIRECTED_REQUEST,
            text,
        }
    }

    fn bad_gateway(text: String) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            text,
        }
    }

    fn response(&self) -> Response<ProxyBody> {
        let body = format!("sandgate egress: {}\n", self.text);
        let mut response = Response::new(
            Full::new(Bytes::from(body))
                .map_err(|never: Infallible| match never {})
                .boxed(),
        );
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }
}

struct Forwarder {
    host: String,
    port: u16,
    secrets: Vec<OpenSecret>,
    injected: Arc<Mutex<BTreeSet<String>>>,
    upstream:
        tokio::sync::Mutex<Result<hyper::client::conn::http1::SendRequest<Incoming>, Refusal>>,
}

/// The longest header a secret's value is filled into, bytes.
const MAX_FILLED_HEADER: usize = 16 * 1024;
/// How long a server has for the head of its answer.
const RESPONSE_HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);
/// How long each TLS handshake (the sandbox's, the server's) may take.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long the sandbox has to send a request's head once its connection is idle.
const REQUEST_HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Headers that belong to one hop (RFC 9110 §7.6.1) and are not forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

impl Forwarder {
    async fn forward(&self, mut req: Request<Incoming>) -> Response<ProxyBody> {
        if let Err(refusal) = self.check_target(&req) {
            return refusal.response();
        }
        let mut upstream = self.upstream.lock().await;
        let sender = match &mut *upstream {
            Ok(sender) => sender,
            Err(refusal) => return refusal.response(),
        };
        remove_hop_by_hop(req.headers_mut());
        let injected = match self.inject(req.headers_mut()) {
            Ok(injected) => injected,
            Err(refusal) => return refusal.response(),
        };
        // No compressed or partial answer on a connection a secret may go into: either could
        // carry a value past the redaction (also one a server kept from an earlier request).
        req.headers_mut().insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        req.headers_mut().remove(header::RANGE);
        req.headers_mut().remove(header::IF_RANGE);
        if !injected.is_empty() {
            lock(&self.injected).extend(injected.iter().cloned());
            super::metrics::counters()
                .secrets_injected
                .inc_by(injected.len() as u64);
        }
        let head = req.method() == http::Method::HEAD;
        if sender.ready().await.is_err() {
            let refusal = Refusal::bad_gateway(format!(
                "{}:{} closed the connection; open a new one",
                self.host, self.port
            ));
            *upstream = Err(refusal.clone());
            return refusal.response();
        }
        let response =
            match tokio::time::timeout(RESPONSE_HEAD_TIMEOUT, sender.send_request(req)).await {
                Ok(Ok(response)) => response,
                Ok(Err(err)) => {
                    return Refusal::bad_gateway(format!("{}:{}: {err}", self.host, self.port))
                        .response();
                }
                Err(_) => {
                    let refusal = Refusal::bad_gateway(format!(
                        "{}:{} sent no answer within {} s",
                        self.host,
                        self.port,
                        RESPONSE_HEAD_TIMEOUT.as_secs()
                    ));
                    *upstream = Err(refusal.clone());
                    return refusal.response();
                }
            };
        drop(upstream);
        let (mut parts, body) = response.into_parts();
        // A reason phrase the server wrote is sent on by hyper as it was: not one that could
        // hold a value.
        parts.extensions.remove::<hyper::ext::ReasonPhrase>();
        let coded = |name: header::HeaderName, allowed: &[&str]| {
            parts.headers.get_all(name).iter().any(|v| {
                v.to_str().map_or(true, |v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|c| !c.is_empty())
                        .any(|c| !allowed.iter().any(|a| c.eq_ignore_ascii_case(a)))
                })
            })
        };
        if coded(header::CONTENT_ENCODING, &["identity"])
            || coded(header::TRANSFER_ENCODING, &["chunked"])
        {
            return Refusal::bad_gateway(format!(
                "{}:{} answered with a compressed body, which the egress component cannot check \
                 for the secrets bound to this host; the server must answer uncompressed \
                 (the request asked for Accept-Encoding: identity)",
                self.host, self.port
            ))
            .response();
        }
        let redactor = Redactor::new(&self.secrets);
        for value in parts.headers.values_mut() {
            if let Some(clean) = redactor.replace_all(value.as_bytes()) {
                *value = HeaderValue::from_bytes(&clean)
                    .unwrap_or_else(|_| HeaderValue::from_static("[redacted]"));
            }
        }
        let close = parts.headers.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
        });
        remove_hop_by_hop(&mut parts.headers);
        if close {
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        let bodiless = head
            || parts.status == StatusCode::NO_CONTENT
            || parts.status == StatusCode::NOT_MODIFIED;
        if !bodiless {
            // The redacted body may be shorter or longer: sent chunked.
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        Response::from_parts(parts, Redacted::new(body, redactor).boxed())
    }

    /// The request must be for the CONNECT target: one Host, naming it (and its port unless 443),
    /// and no other authority in the request line.
    fn check_target(&self, req: &Request<Incoming>) -> Result<(), Refusal> {
        let hosts: Vec<&HeaderValue> = req.headers().get_all(header::HOST).iter().collect();
        let matches = |authority: &str| {
            let (name, port) = match authority.rsplit_once(':') {
                Some((name, port)) => (name, port.parse::<u16>().ok()),
                None => (authority, Some(443)),
            };
            name.trim_end_matches('.').eq_ignore_ascii_case(&self.host) && port == Some(self.port)
        };
        let host_ok = matches!(hosts.as_slice(), [one] if one.to_str().is_ok_and(matches));
        let uri_ok = req.uri().authority().is_none_or(|a| matches(a.as_str()));
        if host_ok && uri_ok {
            return Ok(());
        }
        Err(Refusal::misdirected(format!(
            "this connection is to {}:{}; a request in it must name that host in its Host header \
             (and nothing else): no secret goes into it",
            self.host, self.port
        )))
    }

    /// Puts each secret's value where its placeholder is, in the headers it is bound to; the
    /// names of the secrets put in. A filled header longer than [`MAX_FILLED_HEADER`] is
    /// refused (431): a header of many placeholders must not make the gateway hold many values.
    fn inject(&self, headers: &mut http::HeaderMap) -> Result<Vec<String>, Refusal> {
        let mut injected = Vec::new();
        for secret in &self.secrets {
            for name in &secret.headers {
                let Ok(name) = http::HeaderName::from_bytes(name.as_bytes()) else {
                    continue;
                };
                let http::header::Entry::Occupied(mut entry) = headers.entry(name.clone()) else {
                    continue;
                };
                for value in entry.iter_mut() {
                    let hay = value.as_bytes();
                    let count =
                        memchr::memmem::find_iter(hay, secret.placeholder.as_bytes()).count();
                    if count == 0 {
                        continue;
                    }
                    let filled_len =
                        hay.len() - count * secret.placeholder.len() + count * secret.value.len();
                    if filled_len > MAX_FILLED_HEADER {
                        return Err(Refusal {
                            status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                            text: format!(
                                "the {name} header would be {filled_len} bytes with {} filled \
                                 in ({count} placeholders); at most {MAX_FILLED_HEADER}",
                                secret.name
                            ),
                        });
                    }
                    let Some(filled) = replace(hay, secret.placeholder.as_bytes(), &secret.value)
                    else {
                        continue;
                    };
                    if let Ok(mut filled) = HeaderValue::from_bytes(&filled) {
                        filled.set_sensitive(true);
                        *value = filled;
                        if !injected.contains(&secret.name) {
                            injected.push(secret.name.clone());
                        }
                    }
                }
            }
        }
        Ok(injected)
    }
}

/// Takes out the hop-by-hop headers (RFC 9110 §7.6.1): the fixed ones and those the
/// `Connection` header names.
fn remove_hop_by_hop(headers: &mut http::HeaderMap) {
    let named: Vec<http::HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| http::HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// `haystack` with every `needle` replaced by `with`; `None` when there is none.
fn replace(haystack: &[u8], needle: &[u8], with: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    memchr::memmem::find(haystack, needle)?;
    let mut out = Zeroizing::new(Vec::with_capacity(haystack.len() + with.len()));
    let mut rest = haystack;
    while let Some(at) = memchr::memmem::find(rest, needle) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(with);
        rest = &rest[at + needle.len()..];
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// The forms of a value the redaction looks for: verbatim; JSON-escaped (also with `\/`, and
/// with `<`, `>`, `&`, `'`, `"` as `\u00XX` in either case, as Go's encoder writes them);
/// percent-encoded with upper- and lower-case hex, every byte but letters and digits or all but
/// the unreserved `-_.~`, and `+` for a space; HTML-escaped.
fn forms(value: &str) -> Vec<String> {
    let mut forms = vec![value.to_owned()];
    let json = serde_json::to_string(value).unwrap_or_default();
    let json = json[1..json.len().saturating_sub(1).max(1)].to_owned();
    forms.push(json.clone());
    forms.push(json.replace('/', "\\/"));
    for upper in [false, true] {
        let mut escaped = String::new();
        for c in value.chars() {
            match c {
                '<' | '>' | '&' | '\'' | '"' => {
                    let hex = format!("{:04x}", c as u32);
                    let hex = if upper { hex.to_uppercase() } else { hex };
                    escaped.push_str("\\u");
                    escaped.push_str(&hex);
                }
                '\\' => escaped.push_str("\\\\"),
                c => escaped.push(c),
            }
        }
        forms.push(escaped);
    }
    for keep_unreserved in [false, true] {
        for upper in [true, false] {
            let mut encoded = String::new();
            let mut plus = String::new();
            for b in value.bytes() {
                let keep = b.is_ascii_alphanumeric()
                    || (keep_unreserved && matches!(b, b'-' | b'_' | b'.' | b'~'));
                let piece = if keep {
                    (b as char).to_string()
                } else if upper {
                    format!("%{b:02X}")
                } else {
                    format!("%{b:02x}")
                };
                plus.push_str(if b == b' ' { "+" } else { &piece });
                encoded.push_str(&piece);
            }
            forms.push(encoded);
            forms.push(plus);
        }
    }
    let html = value
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;");
    forms.push(html);
    forms.retain(|f| !f.is_empty());
    forms.sort();
    forms.dedup();
    forms
}

/// Takes secrets' values out of what a server answers: each form of a value ([`forms`]) becomes
/// the secret's placeholder. One automaton, one pass over each buffer.
#[derive(Clone)]
struct Redactor {
    /// Every form of every value, leftmost-longest.
    automaton: Option<Arc<aho_corasick::AhoCorasick>>,
    /// The placeholder each pattern becomes.
    placeholders: Arc<Vec<Vec<u8>>>,
    /// Bytes held back: a form may begin in them and end in the next chunk.
    pending: Vec<u8>,
    keep: usize,
}

impl Redactor {
    fn new(secrets: &[OpenSecret]) -> Self {
        let mut patterns: Vec<Zeroizing<Vec<u8>>> = Vec::new();
        let mut placeholders = Vec::new();
        for secret in secrets {
            let value = Zeroizing::new(String::from_utf8_lossy(&secret.value).into_owned());
            for form in forms(&value) {
                let form = Zeroizing::new(form.into_bytes());
                if !patterns.iter().any(|p| **p == *form) {
                    patterns.push(form);
                    placeholders.push(secret.placeholder.as_bytes().to_vec());
                }
            }
        }
        let keep = patterns
            .iter()
            .map(|p| p.len())
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        let automaton = (!patterns.is_empty()).then(|| {
            Arc::new(
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(patterns.iter().map(|p| p.as_slice()))
                    .expect("the forms of a secret's value build an automaton"),
            )
        });
        Self {
            automaton,
            placeholders: Arc::new(placeholders),
            pending: Vec::new(),
            keep,
        }
    }

    /// Copies `bytes` into `out` with every match starting before `limit` replaced, up to the
    /// end of the last one; returns where the copy stopped.
    fn redact_into(&self, bytes: &[u8], limit: usize, out: &mut Vec<u8>) -> usize {
        let Some(automaton) = &self.automaton else {
            return 0;
        };
        let mut i = 0;
        for found in automaton.find_iter(bytes) {
            if found.start() >= limit {
                break;
            }
            out.extend_from_slice(&bytes[i..found.start()]);
            out.extend_from_slice(&self.placeholders[found.pattern().as_usize()]);
            i = found.end();
        }
        i
    }

    /// `bytes` redacted whole; `None` when nothing was in it.
    fn replace_all(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        self.automaton.as_ref()?.find(bytes)?;
        let mut out = Vec::with_capacity(bytes.len());
        let end = self.redact_into(bytes, bytes.len(), &mut out);
        out.extend_from_slice(&bytes[end..]);
        Some(out)
    }

    /// The next chunk of a body: what may be sent now.
    fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.automaton.is_none() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        let pending = std::mem::take(&mut self.pending);
        // A form that begins in the last `keep` bytes may end in the next chunk (and a shorter
        // form inside it must not be taken for it): only matches that begin before are final.
        let limit = pending.len().saturating_sub(self.keep);
        let mut out = Vec::with_capacity(pending.len());
        let i = self.redact_into(&pending, limit, &mut out);
        let cut = limit.max(i);
        out.extend_from_slice(&pending[i..cut]);
        self.pending = pending[cut..].to_vec();
        out
    }

    /// The end of a body: what was held back.
    fn finish(&mut self) -> Vec<u8> {
        let pending = std::mem::take(&mut self.pending);
        let mut out = Vec::with_capacity(pending.len());
        let i = self.redact_into(&pending, pending.len(), &mut out);
        out.extend_from_slice(&pending[i..]);
        out
    }
}

/// A server's body with the secrets' values taken out (trailers are dropped).
struct Redacted {
    inner: Incoming,
    redactor: Redactor,
    done: bool,
}

impl Redacted {
    fn new(inner: Incoming, redactor: Redactor) -> Self {
        Self {
            inner,
            redactor,
            done: false,
        }
    }
}

impl Body for Redacted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: dropped
                    };
                    let out = this.redactor.push(&data);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                }
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                None => {
                    this.done = true;
                    let tail = this.redactor.finish();
                    if tail.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(tail)))));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str, value: &str) -> OpenSecret {
        OpenSecret {
            name: name.to_owned(),
            placeholder: format!("sgp_{}", name.to_lowercase()),
            value: Zeroizing::new(value.as_bytes().to_vec()),
            headers: vec!["authorization".into()],
        }
    }

    #[test]
    fn a_value_is_taken_out_wherever_the_chunks_split_it() {
        let secrets = [secret("A", "s3cr\"et/value"), secret("B", "bbbb")];
        let body = b"x s3cr\"et/value y s3cr\\\"et\\/value z s3cr%22et%2Fvalue bbbb!".to_vec();
        let whole = Redactor::new(&secrets).replace_all(&body).unwrap();
        let want = b"x sgp_a y sgp_a z sgp_a sgp_b!".to_vec();
        assert_eq!(
            String::from_utf8_lossy(&whole),
            String::from_utf8_lossy(&want)
        );
        for size in 1..body.len() {
            let mut r = Redactor::new(&secrets);
            let mut out = Vec::new();
            for chunk in body.chunks(size) {
                out.extend(r.push(chunk));
            }
            out.extend(r.finish());
            assert_eq!(out, want, "chunks of {size}");
        }
        assert!(
            Redactor::new(&secrets)
                .replace_all(b"nothing here")
                .is_none()
        );
    }

    #[test]
    fn overlapping_values_are_taken_out_whole_wherever_the_chunks_split_them() {
        let secrets = [secret("A", "xyz"), secret("B", "abcxyzdef")];
        for body in [b"abcxyzdef and xyz".to_vec(), b"xyzabcxyzdefxyz".to_vec()] {
            let whole = Redactor::new(&secrets).replace_all(&body).unwrap();
            for size in 1..body.len() {
                let mut r = Redactor::new(&secrets);
                let mut out = Vec::new();
                for chunk in body.chunks(size) {
                    out.extend(r.push(chunk));
                }
                out.extend(r.finish());
                assert_eq!(out, whole, "chunks of {size}");
                let text = String::from_utf8_lossy(&out);
                assert!(!text.contains("abc") && !text.contains("def"), "{text}");
            }
        }
    }

    #[test]
    fn the_encoded_forms_of_a_value_are_taken_out() {
        let secrets = [secret("A", "a-b/c d<e")];
        let r = Redactor::new(&secrets);
        for form in [
            "a-b/c d<e",
            "a-b\\/c d<e",
            "a-b/c d\\u003ce",
            "a-b/c d\\u003Ce",
            "a%2Db%2Fc%20d%3Ce",
            "a%2db%2fc%20d%3ce",
            "a-b%2Fc+d%3Ce",
            "a-b/c d&lt;e",
        ] {
            let out = r.replace_all(form.as_bytes());
            assert_eq!(out.as_deref(), Some(&b"sgp_a"[..]), "{form}");
        }
    }

    #[test]
    fn a_placeholder_is_replaced_wherever_it_stands_in_a_value() {
        let got = replace(b"Bearer sgp_a, sgp_a", b"sgp_a", b"real").unwrap();
        assert_eq!(&got[..], b"Bearer real, real");
        assert!(replace(b"Bearer other", b"sgp_a", b"real").is_none());
    }

    #[test]
    fn a_sandbox_ca_signs_a_leaf_a_client_trusting_it_accepts() {
        let ca = SandboxCa::new("sbx_test").unwrap();
        assert!(ca.pem().contains("BEGIN CERTIFICATE"));
        assert!(!ca.pem().contains("PRIVATE KEY"), "only the certificate");
        ca.server_config("api.shop.test").unwrap();
        let config = upstream_config(Some(ca.pem())).unwrap();
        assert!(config.alpn_protocols == vec![b"http/1.1".to_vec()]);
    }
}
