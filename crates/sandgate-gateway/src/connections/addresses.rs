//! What one client address may hold: its connections (directly reachable), or its requests in
//! flight (behind a reverse proxy, the address from the proxy's header), capped at
//! `http.max_connections_per_address`. An IPv6 address counts for its /64: one host is
//! commonly handed a whole /64, so counting single addresses would give it millions of shares.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use axum::http::HeaderMap;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use sandgate_oauth::ratelimit::ClientAddress;

/// Open things (connections, or requests in flight) per client address, capped; `cap` 0: no cap.
#[derive(Clone)]
pub(super) struct PerAddress {
    cap: usize,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One open thing counted against its address; uncounted when dropped.
pub(super) struct AddressSlot {
    owner: PerAddress,
    key: IpAddr,
}

/// The address a share is counted for: an IPv4 address itself (also when IPv4-mapped), an IPv6
/// address's /64.
pub(super) fn share_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(Ipv6Addr::from(bits))
            }
        },
    }
}

impl PerAddress {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap,
            open: Arc::default(),
        }
    }

    fn counts(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one more for `ip`'s share; `None` when that share is at the cap.
    pub(super) fn admit(&self, ip: IpAddr) -> Option<AddressSlot> {
        let key = share_of(ip);
        if self.cap > 0 {
            let mut open = self.counts();
            let count = open.entry(key).or_default();
            if *count >= self.cap {
                return None;
            }
            *count += 1;
        }
        Some(AddressSlot {
            owner: self.clone(),
            key,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        if self.owner.cap == 0 {
            return;
        }
        let mut open = self.owner.counts();
        if let Some(count) = open.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// Behind a reverse proxy: requests in flight per client address, read from the proxy's header
/// by the same rule as the OAuth server's rate limits ([`ClientAddress`]).
pub(super) struct ClientLimit {
    pub(super) header: String,
    pub(super) open: PerAddress,
}

/// The client's share is full.
#[derive(Debug)]
pub(super) struct ShareFull;

impl ClientLimit {
    /// Counts a request; `Ok(None)` when no such cap applies (not behind a proxy).
    pub(super) fn admit(
        &self,
        peer: SocketAddr,
        headers: &HeaderMap,
    ) -> Result<Option<AddressSlot>, ShareFull> {
        if self.open.cap == 0 {
            return Ok(None);
        }
        let client = ClientAddress::resolve(Some(peer), headers, &self.header).0;
        self.open.admit(client).map(Some).ok_or(ShareFull)
    }
}

/// A response body that holds its request's [`AddressSlot`] until it ends (an SSE stream, a
/// download).
pub(super) struct Holding<B> {
    inner: B,
    _slot: AddressSlot,
}

impl<B> Holding<B> {
    pub(super) fn new(inner: B, slot: AddressSlot) -> Self {
        Self { inner, _slot: slot }
    }
}

impl<B: HttpBody + Unpin> HttpBody for Holding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_counts_for_its_slash_64_and_ipv4_for_itself() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:ffff:ffff:ffff".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(share_of(a), share_of(b));
        assert_ne!(share_of(a), share_of(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(share_of(mapped), "10.0.0.1".parse::<IpAddr>().unwrap());
        let limit = PerAddress::new(2);
        let held = (limit.admit(a).unwrap(), limit.admit(b).unwrap());
        assert!(limit.admit(b).is_none(), "the /64 is at its cap");
        assert!(limit.admit(other).is_some(), "another /64 is not");
        drop(held);
        assert!(limit.admit(a).is_some(), "uncounted when dropped");
    }

    #[test]
    fn behind_a_proxy_the_header_names_the_share() {
        let limit = ClientLimit {
            header: "x-forwarded-for".into(),
            open: PerAddress::new(1),
        };
        let proxy: SocketAddr = "10.0.0.2:4000".parse().unwrap();
        let from = |client: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-forwarded-for", client.parse().unwrap());
            headers
        };
        let first = limit.admit(proxy, &from("203.0.113.7")).unwrap();
        assert!(first.is_some());
        assert!(limit.admit(proxy, &from("203.0.113.7")).is_err());
        assert!(
            limit.admit(proxy, &from("203.0.113.8")).unwrap().is_some(),
            "another client through the same proxy"
        );
    }
}
