//! Bounds on what anonymous callers can make the authorization server do (issue 11): rate
//! limits per client address and per account (`governor`), the bounded queue in front of
//! password hashing, the negative cache of failed client-metadata lookups, and the client
//! address itself (the peer, or a trusted reverse proxy's header).
//!
//! These limiters live in this process's memory: with several replicas each applies them on
//! its own (docs/security.md). The account lockout is in Postgres and shared.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::AppState;
pub use crate::config::OAuthLimitsConfig;

/// The address a request came from: the TCP peer, or, when `http.client_address_header` names
/// a header a trusted reverse proxy sets, the address in it (for `X-Forwarded-For`, the last
/// entry: the one the proxy itself appended). Without a usable header, the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddress(pub IpAddr);

impl ClientAddress {
    /// Resolves the address from the peer and the headers under `header_name`'s rule.
    pub fn resolve(peer: Option<SocketAddr>, headers: &HeaderMap, header_name: &str) -> Self {
        let from_header = (!header_name.is_empty())
            .then(|| headers.get_all(header_name).iter().next_back())
            .flatten()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .and_then(|v| parse_addr(v.trim()));
        let fallback = peer.map_or(IpAddr::from([0, 0, 0, 0]), |p| p.ip());
        ClientAddress(from_header.unwrap_or(fallback))
    }
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `[::1]:5678` or `::1`.
fn parse_addr(value: &str) -> Option<IpAddr> {
    value
        .parse::<IpAddr>()
        .ok()
        .or_else(|| value.parse::<SocketAddr>().ok().map(|s| s.ip()))
}

impl FromRequestParts<AppState> for ClientAddress {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        Ok(ClientAddress::resolve(
            peer,
            &parts.headers,
            &state.config.http.client_address_header,
        ))
    }
}

/// A refusal because a limit was hit: 429 (or 503 for the hashing queue) with `Retry-After`.
#[derive(Debug, Clone, Copy)]
pub struct Limited {
    /// Which limit.
    pub what: LimitKind,
    /// When a retry may succeed.
    pub retry_after: Duration,
}

/// The limits, as shown to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// Sign-ins from one address.
    LoginAddress,
    /// Sign-ins for one account.
    LoginAccount,
    /// The account is locked after failed sign-ins.
    Lockout,
    /// Every hashing slot is busy.
    HashingBusy,
    /// Registrations from one address.
    Register,
    /// Metadata-document fetches from one address.
    MetadataFetch,
}

impl Limited {
    /// Seconds for `Retry-After` (at least 1).
    pub fn retry_after_seconds(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }

    /// The HTTP status: 503 when the server is busy, 429 when the caller went too fast.
    pub fn status(&self) -> StatusCode {
        match self.what {
            LimitKind::HashingBusy => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// A sentence for a person: what happened and when to try again.
    pub fn message(&self) -> String {
        let wait = human_wait(self.retry_after_seconds());
        match self.what {
            LimitKind::LoginAddress => {
                format!("Too many sign-in attempts from your network. Try again in {wait}.")
            }
            LimitKind::LoginAccount => {
                format!("Too many sign-in attempts for this account. Try again in {wait}.")
            }
            LimitKind::Lockout => format!(
                "This account is locked for {wait} after repeated failed sign-ins. \
                 Try again then, or ask your administrator to reset your password."
            ),
            LimitKind::HashingBusy => {
                format!("sandgate is busy signing people in. Try again in {wait}.")
            }
            LimitKind::Register => {
                format!("Too many client registrations from this address; retry in {wait}.")
            }
            LimitKind::MetadataFetch => format!(
                "too many client metadata documents fetched for this address; retry in {wait}"
            ),
        }
    }

    /// Adds `Retry-After` to a response.
    pub fn stamp(&self, response: &mut Response) {
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(self.retry_after_seconds()),
        );
    }

    /// An OAuth-style JSON error answer (registration).
    pub fn json(&self, code: &str) -> Response {
        let mut response = (
            self.status(),
            axum::Json(serde_json::json!({
                "error": code,
                "error_description": self.message(),
            })),
        )
            .into_response();
        self.stamp(&mut response);
        response
    }
}

fn human_wait(seconds: u64) -> String {
    match seconds {
        1 => "1 second".into(),
        s if s < 120 => format!("{s} seconds"),
        s => format!("{} minutes", s.div_ceil(60)),
    }
}

/// The limiters, the hashing queue and the metadata negative cache. Cheap to clone.
#[derive(Clone)]
pub struct Limiters {
    inner: Arc<Inner>,
}

struct Inner {
    login_address: DefaultKeyedRateLimiter<IpAddr>,
    login_account: DefaultKeyedRateLimiter<String>,
    register: DefaultKeyedRateLimiter<IpAddr>,
    metadata_fetch: DefaultKeyedRateLimiter<IpAddr>,
    hashing: Arc<Semaphore>,
    hashing_queue: Arc<Semaphore>,
    /// The only threads that hash passwords: argon2's ~19 MiB per hash lands in these threads'
    /// malloc arenas and nowhere else, so resident memory stays bounded by their number (on the
    /// shared blocking pool every thread that ever hashed kept its arena's memory).
    hashing_threads: rayon::ThreadPool,
    hashing_wait: Duration,
    failed_documents: Mutex<lru::LruCache<String, (Instant, String)>>,
    failure_ttl: Duration,
}

impl std::fmt::Debug for Limiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiters").finish_non_exhaustive()
    }
}

/// How many failed metadata-document URLs are remembered at most.
const FAILED_DOCUMENTS_REMEMBERED: usize = 4096;

fn per_minute(n: u32) -> Quota {
    Quota::per_minute(NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN))
}

impl Limiters {
    /// Limiters for `config` (validated: every rate is at least 1).
    pub fn new(config: &OAuthLimitsConfig) -> Self {
        let register = Quota::per_hour(
            NonZeroU32::new(config.register_per_address_per_hour).unwrap_or(NonZeroU32::MIN),
        );
        Self {
            inner: Arc::new(Inner {
                login_address: RateLimiter::keyed(per_minute(config.login_per_address_per_minute)),
                login_account: RateLimiter::keyed(per_minute(config.login_per_account_per_minute)),
                register: RateLimiter::keyed(register),
                metadata_fetch: RateLimiter::keyed(per_minute(
                    config.metadata_fetch_per_address_per_minute,
                )),
                hashing: Arc::new(Semaphore::new(config.password_hash_concurrency)),
                hashing_threads: rayon::ThreadPoolBuilder::new()
                    .num_threads(config.password_hash_concurrency)
                    .thread_name(|i| format!("sandgate-argon2-{i}"))
                    .build()
                    .expect("password hashing threads start"),
                hashing_queue: Arc::new(Semaphore::new(
                    config.password_hash_concurrency + config.password_hash_queue,
                )),
                hashing_wait: Duration::from_millis(config.password_hash_wait_ms),
                failed_documents: Mutex::new(lru::LruCache::new(
                    std::num::NonZeroUsize::new(FAILED_DOCUMENTS_REMEMBERED)
                        .expect("a positive constant"),
                )),
                failure_ttl: Duration::from_secs(config.metadata_failure_cache_seconds),
            }),
        }
    }

    fn check<K: std::hash::Hash + Eq + Clone>(
        limiter: &DefaultKeyedRateLimiter<K>,
        key: &K,
        what: LimitKind,
    ) -> Result<(), Limited> {
        limiter.check_key(key).map_err(|not_until| Limited {
            what,
            retry_after: not_until.wait_time_from(DefaultClock::default().now()),
        })
    }

    /// One sign-in attempt from `address`.
    pub fn login_from(&self, address: ClientAddress) -> Result<(), Limited> {
        Self::check(
            &self.inner.login_address,
            &address.0,
            LimitKind::LoginAddress,
        )
    }

    /// One sign-in attempt for `email` (compared case-insensitively).
    pub fn login_for(&self, email: &str) -> Result<(), Limited> {
        Self::check(
            &self.inner.login_account,
            &email.to_lowercase(),
            LimitKind::LoginAccount,
        )
    }

    /// One registration from `address`.
    pub fn register_from(&self, address: ClientAddress) -> Result<(), Limited> {
        Self::check(&self.inner.register, &address.0, LimitKind::Register)
    }

    /// One metadata-document fetch caused by `address`.
    pub fn metadata_fetch_from(&self, address: ClientAddress) -> Result<(), Limited> {
        Self::check(
            &self.inner.metadata_fetch,
            &address.0,
            LimitKind::MetadataFetch,
        )
    }

    /// Runs `hash` (a password hash or check) on the hashing threads, after waiting in a bounded
    /// queue for a bounded time. `Err` (503) when the queue is full or the wait ran out: memory
    /// never grows with a flood.
    pub async fn hash<R: Send + 'static>(
        &self,
        hash: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Limited> {
        let busy = Limited {
            what: LimitKind::HashingBusy,
            retry_after: Duration::from_secs(1).max(self.inner.hashing_wait),
        };
        let _in_queue = Arc::clone(&self.inner.hashing_queue)
            .try_acquire_owned()
            .map_err(|_| busy)?;
        let slot = Arc::clone(&self.inner.hashing).acquire_owned();
        let slot = match tokio::time::timeout(self.inner.hashing_wait, slot).await {
            Ok(Ok(slot)) => slot,
            _ => return Err(busy),
        };
        let (done, result) = tokio::sync::oneshot::channel();
        self.inner.hashing_threads.spawn(move || {
            let _ = done.send(hash());
            drop(slot);
        });
        result.await.map_err(|_| busy)
    }

    /// A metadata-document URL's recent failure, if one is remembered.
    pub fn failed_document(&self, url: &str) -> Option<String> {
        let mut cache = self
            .inner
            .failed_documents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match cache.get(url) {
            Some((at, why)) if at.elapsed() < self.inner.failure_ttl => Some(why.clone()),
            Some(_) => {
                cache.pop(url);
                None
            }
            None => None,
        }
    }

    /// Remembers that fetching `url` failed, and why.
    pub fn remember_failed_document(&self, url: &str, why: &str) {
        if self.inner.failure_ttl.is_zero() {
            return;
        }
        self.inner
            .failed_documents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .put(url.to_owned(), (Instant::now(), why.to_owned()));
    }

    /// Forgets keys whose limits are back to full, every `every` until `stop`: the keyed
    /// limiters' memory is bounded by the keys seen within one refill period.
    pub fn start_housekeeping(
        &self,
        every: Duration,
        stop: CancellationToken,
        tasks: &TaskTracker,
    ) {
        let this = self.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let inner = &this.inner;
                inner.login_address.retain_recent();
                inner.login_account.retain_recent();
                inner.register.retain_recent();
                inner.metadata_fetch.retain_recent();
                inner.login_address.shrink_to_fit();
                inner.login_account.shrink_to_fit();
                inner.register.shrink_to_fit();
                inner.metadata_fetch.shrink_to_fit();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_address_is_the_peer_unless_a_trusted_header_is_configured() {
        let peer: SocketAddr = "10.0.0.7:5555".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-forwarded-for",
            "203.0.113.9, 198.51.100.4".parse().unwrap(),
        );
        assert_eq!(
            ClientAddress::resolve(Some(peer), &headers, "").0,
            peer.ip(),
            "without configuration the header is ignored (anyone can send it)"
        );
        assert_eq!(
            ClientAddress::resolve(Some(peer), &headers, "x-forwarded-for").0,
            "198.51.100.4".parse::<IpAddr>().unwrap(),
            "the proxy's own (last) entry counts, not what the client wrote before it"
        );
        headers.insert("x-real-ip", "[2001:db8::1]:443".parse().unwrap());
        assert_eq!(
            ClientAddress::resolve(Some(peer), &headers, "x-real-ip").0,
            "2001:db8::1".parse::<IpAddr>().unwrap()
        );
        headers.insert("x-real-ip", "garbage".parse().unwrap());
        assert_eq!(
            ClientAddress::resolve(Some(peer), &headers, "x-real-ip").0,
            peer.ip()
        );
    }

    fn config() -> OAuthLimitsConfig {
        use figment::providers::{Format, Toml};
        figment::Figment::from(Toml::string(crate::config::DEFAULT_TOML))
            .extract_inner("oauth.limits")
            .expect("the defaults hold [oauth.limits]")
    }

    #[test]
    fn a_rate_of_one_per_minute_allows_one_then_says_when() {
        let mut config = config();
        config.metadata_fetch_per_address_per_minute = 1;
        let limiters = Limiters::new(&config);
        let a = ClientAddress("192.0.2.1".parse().unwrap());
        let b = ClientAddress("192.0.2.2".parse().unwrap());
        assert!(limiters.metadata_fetch_from(a).is_ok());
        let refused = limiters.metadata_fetch_from(a).unwrap_err();
        assert_eq!(refused.what, LimitKind::MetadataFetch);
        assert!(
            (59..=60).contains(&refused.retry_after_seconds()),
            "{refused:?}"
        );
        assert!(
            limiters.metadata_fetch_from(b).is_ok(),
            "another address has its own"
        );
    }

    #[test]
    fn waits_are_said_in_words() {
        assert_eq!(human_wait(1), "1 second");
        assert_eq!(human_wait(42), "42 seconds");
        assert_eq!(human_wait(900), "15 minutes");
    }
}
