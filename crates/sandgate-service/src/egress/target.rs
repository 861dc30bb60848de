//! The egress target check (issue 29): whether a sandbox's `CONNECT host:port` may go out, and
//! to which addresses. In this order, each step before the next:
//!
//! 1. the authority is a DNS name and a port, and never an address in any spelling (dotted,
//!    decimal `2130706433`, hex `0x7f.1`, octal `0177.0.0.1`, short `127.1`, IPv6 with or
//!    without brackets, mapped, NAT64, zone ids);
//! 2. a rule of the tenant's policy admits the name and the port; a name no rule admits is
//!    refused here, so it never reaches a resolver (refused names do not leak through DNS);
//! 3. the name is resolved, and every address it resolves to must be global unicast: one
//!    private, loopback, link-local, CGNAT, multicast, unspecified, documentation, reserved or
//!    metadata address among the answers refuses the connection whatever the policy says;
//! 4. the checked addresses are returned: the caller connects to them and to nothing else (no
//!    second resolution that a rebinding name could answer differently).
//!
//! Tests reach servers on loopback through [`TestOverrides`], which can only be made on a
//! loopback-only deployment and only for loopback addresses.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use futures::future::BoxFuture;
use ipnet::{Ipv4Net, Ipv6Net};
use sandgate_store::egress::EgressRule;

use super::rules::HostPattern;

/// Why a target is refused.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The authority is not `name:port`.
    #[error(
        "{authority:?} is not a target: {why}; connect to `name:port`, e.g. api.example.com:443"
    )]
    BadAuthority {
        /// The authority as sent.
        authority: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The host is an address, in some spelling.
    #[error(
        "{host:?} is an address: egress goes to names an operator allowed, never to an address \
         (in any spelling); connect to the name instead"
    )]
    AddressLiteral {
        /// The host as sent.
        host: String,
    },
    /// No rule of the tenant's policy admits the name and port (nothing was resolved).
    #[error(
        "{host}:{port} is not in this tenant's egress policy (refused before any DNS lookup); an \
         operator can allow it with `sandgate admin tenant egress <tenant> --allow {host}:{port}`"
    )]
    NotAllowed {
        /// The name.
        host: String,
        /// The port.
        port: u16,
    },
    /// The name could not be resolved.
    #[error("{host} could not be resolved")]
    Resolve {
        /// The name.
        host: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The name resolved to no address.
    #[error("{host} resolves to no address")]
    NoAddress {
        /// The name.
        host: String,
    },
    /// The name resolves to an address no egress may reach.
    #[error(
        "{host} resolves to {addr}, {range} address: refused whatever the egress policy says \
         (egress reaches public addresses only)"
    )]
    Forbidden {
        /// The name.
        host: String,
        /// The address refused.
        addr: IpAddr,
        /// What kind of address it is.
        range: Range,
    },
    /// Test overrides asked for on a deployment others can reach.
    #[error(
        "egress test overrides are refused: the public URL or the listen address is not \
         loopback (they exist for tests on one machine only)"
    )]
    OverridesOffLoopback,
    /// A test override aimed at an address that is not loopback.
    #[error("an egress test override may reach loopback addresses only, not {0}")]
    OverrideNotLoopback(SocketAddr),
    /// Under the tests' overrides, an address that passed the checks but is not a listed test
    /// server: tests never dial anything else.
    #[error(
        "{host} resolves to {addr}, which is not one of the egress test servers (under the tests' \
         overrides nothing else is dialed)"
    )]
    NotATestServer {
        /// The name.
        host: String,
        /// The address it resolved to.
        addr: SocketAddr,
    },
}

/// A kind of address egress never reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// A cloud provider's instance metadata service.
    Metadata,
    /// `0.0.0.0/8`, `::`.
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// RFC 1918, unique local `fc00::/7`.
    Private,
    /// Shared address space `100.64.0.0/10` (carrier-grade NAT).
    Cgnat,
    /// `169.254.0.0/16`, `fe80::/10`.
    LinkLocal,
    /// `224.0.0.0/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// TEST-NET-1/2/3, `2001:db8::/32`, `3fff::/20`.
    Documentation,
    /// `198.18.0.0/15`.
    Benchmarking,
    /// Any other special-purpose block (IETF assignments, 6to4, Teredo, site-local, `240/4`,
    /// IPv4-compatible, outside global unicast `2000::/3`).
    Reserved,
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Range::Metadata => "a cloud metadata",
            Range::Unspecified => "an unspecified",
            Range::Loopback => "a loopback",
            Range::Private => "a private",
            Range::Cgnat => "a shared (carrier-grade NAT)",
            Range::LinkLocal => "a link-local",
            Range::Multicast => "a multicast",
            Range::Broadcast => "the broadcast",
            Range::Documentation => "a documentation",
            Range::Benchmarking => "a benchmarking",
            Range::Reserved => "a reserved or special-purpose",
        })
    }
}

/// Metadata services, named as such (each is also inside a wider refused block).
const METADATA: &[IpAddr] = &[
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
];

/// The IPv4 special-purpose blocks (IANA registry, RFC 6890 and successors).
const V4_BLOCKS: &[(&str, Range)] = &[
    ("0.0.0.0/8", Range::Unspecified),
    ("10.0.0.0/8", Range::Private),
    ("100.64.0.0/10", Range::Cgnat),
    ("127.0.0.0/8", Range::Loopback),
    ("169.254.0.0/16", Range::LinkLocal),
    ("172.16.0.0/12", Range::Private),
    ("192.0.0.0/24", Range::Reserved),
    ("192.0.2.0/24", Range::Documentation),
    ("192.88.99.0/24", Range::Reserved),
    ("192.168.0.0/16", Range::Private),
    ("198.18.0.0/15", Range::Benchmarking),
    ("198.51.100.0/24", Range::Documentation),
    ("203.0.113.0/24", Range::Documentation),
    ("224.0.0.0/4", Range::Multicast),
    ("255.255.255.255/32", Range::Broadcast),
    ("240.0.0.0/4", Range::Reserved),
];

/// The IPv6 blocks refused inside global unicast `2000::/3` (everything outside it is refused).
const V6_BLOCKS: &[(&str, Range)] = &[
    ("2001::/23", Range::Reserved),
    ("2001:db8::/32", Range::Documentation),
    ("2002::/16", Range::Reserved),
    ("3fff::/20", Range::Documentation),
];

/// What kind of forbidden address `addr` is; `None` for a global unicast address egress may
/// reach. An IPv4-mapped or NAT64 (`64:ff9b::/96`) address is judged by the IPv4 address in it.
pub fn forbidden(addr: IpAddr) -> Option<Range> {
    if METADATA.contains(&addr) {
        return Some(Range::Metadata);
    }
    match addr {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(addr: Ipv4Addr) -> Option<Range> {
    if METADATA.contains(&IpAddr::V4(addr)) {
        return Some(Range::Metadata);
    }
    // The first block that holds it: 255.255.255.255 is listed before 240/4 to be named.
    V4_BLOCKS.iter().find_map(|(net, range)| {
        let net: Ipv4Net = net.parse().expect("a valid block");
        net.contains(&addr).then_some(*range)
    })
}

fn forbidden_v6(addr: Ipv6Addr) -> Option<Range> {
    let in_net = |net: &str| {
        net.parse::<Ipv6Net>()
            .expect("a valid block")
            .contains(&addr)
    };
    let embedded = || {
        let o = addr.octets();
        Ipv4Addr::new(o[12], o[13], o[14], o[15])
    };
    if addr.is_unspecified() {
        return Some(Range::Unspecified);
    }
    if addr.is_loopback() {
        return Some(Range::Loopback);
    }
    if in_net("::ffff:0:0/96") || in_net("64:ff9b::/96") {
        // Mapped, or NAT64's well-known prefix: where it goes is the IPv4 address in it (a
        // public one through DNS64 is an ordinary destination in an IPv6-only network).
        return forbidden_v4(embedded());
    }
    let named = [
        ("fc00::/7", Range::Private),
        ("fe80::/10", Range::LinkLocal),
        ("ff00::/8", Range::Multicast),
    ];
    if let Some((_, range)) = named.iter().find(|(net, _)| in_net(net)) {
        return Some(*range);
    }
    if !in_net("2000::/3") {
        return Some(Range::Reserved);
    }
    V6_BLOCKS
        .iter()
        .filter(|(net, _)| in_net(net))
        // The most specific block names it (2001:db8::/32 inside 2001::/23 is documentation).
        .max_by_key(|(net, _)| net.parse::<Ipv6Net>().map_or(0, |n| n.prefix_len()))
        .map(|(_, range)| *range)
}

/// Resolves a name to addresses.
pub trait Resolver: Send + Sync {
    /// The addresses of `host` (a checked DNS name, never an address).
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>>;
}

/// The system's resolver (`getaddrinfo`, through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

/// How long the system's resolver may take for one name.
const RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl Resolver for SystemResolver {
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        Box::pin(async move {
            // An absolute name (trailing dot): the resolver's search list (Kubernetes'
            // `ndots:5` and its cluster domains) never turns it into a name no rule admits.
            let absolute = format!("{host}.");
            let found = tokio::time::timeout(
                RESOLVE_TIMEOUT,
                tokio::net::lookup_host((absolute.as_str(), 0)),
            )
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {} s", RESOLVE_TIMEOUT.as_secs()),
                )
            })??;
            Ok(found.map(|a| a.ip()).collect())
        })
    }
}

/// The resolver and address override of tests: names resolve from a table (never through the
/// system's resolver), and the loopback test servers listed may be reached although loopback
/// is refused otherwise. Only a loopback-only deployment can make one, and only for loopback
/// addresses, so no deployment others can reach ever has one.
#[derive(Debug, Clone)]
pub struct TestOverrides {
    names: HashMap<String, Vec<IpAddr>>,
    reachable: Vec<SocketAddr>,
}

impl TestOverrides {
    /// Empty overrides for this deployment; refused unless only this host can reach it
    /// ([`crate::Config::only_loopback`], the rule of the development secrets).
    pub fn for_config(config: &crate::Config) -> Result<Self, TargetError> {
        Self::new(config.only_loopback())
    }

    /// Empty overrides; refused unless `loopback_only` (only this host can reach the deployment).
    pub fn new(loopback_only: bool) -> Result<Self, TargetError> {
        if !loopback_only {
            return Err(TargetError::OverridesOffLoopback);
        }
        Ok(Self {
            names: HashMap::new(),
            reachable: Vec::new(),
        })
    }

    /// `host` resolves to `addrs` (which are still checked, unless listed by [`Self::reach`]):
    /// a test of a name that resolves to a private address gives one here.
    pub fn resolve(mut self, host: &str, addrs: &[IpAddr]) -> Self {
        self.names.insert(
            host.trim_end_matches('.').to_ascii_lowercase(),
            addrs.to_vec(),
        );
        self
    }

    /// A loopback test server that may be reached (that address and port only).
    pub fn reach(mut self, server: SocketAddr) -> Result<Self, TargetError> {
        if !server.ip().is_loopback() {
            return Err(TargetError::OverrideNotLoopback(server));
        }
        self.reachable.push(server);
        Ok(self)
    }
}

impl Resolver for TestOverrides {
    fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        let found = self.names.get(host).cloned().unwrap_or_default();
        Box::pin(async move { Ok(found) })
    }
}

/// A target that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedTarget {
    /// The name, lower-case, without a trailing dot (for TLS names and the Host header).
    pub host: String,
    /// The port.
    pub port: u16,
    /// The rule that admitted it (its budgets apply).
    pub rule: EgressRule,
    /// The checked addresses: connect to these and nothing else.
    pub addrs: Vec<SocketAddr>,
}

/// Decides where a sandbox's connections may go: the policy's names, resolved by one resolver,
/// to public addresses only.
pub struct TargetCheck {
    resolver: Box<dyn Resolver>,
    overrides: Option<TestOverrides>,
}

impl std::fmt::Debug for TargetCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetCheck")
            .field("test_overrides", &self.overrides.is_some())
            .finish_non_exhaustive()
    }
}

impl TargetCheck {
    /// Resolving through the system's resolver.
    pub fn system() -> Self {
        Self::with_resolver(SystemResolver)
    }

    /// Resolving through `resolver`; every address is still checked.
    pub fn with_resolver(resolver: impl Resolver + 'static) -> Self {
        Self {
            resolver: Box::new(resolver),
            overrides: None,
        }
    }

    /// Resolving through `overrides` only (never the system's resolver), its loopback servers
    /// reachable.
    pub fn test(overrides: TestOverrides) -> Self {
        Self {
            resolver: Box::new(overrides.clone()),
            overrides: Some(overrides),
        }
    }

    /// Checks `authority` (`host:port`, as in a CONNECT request) against the tenant's `rules`.
    #[tracing::instrument(skip_all)]
    pub async fn check(
        &self,
        authority: &str,
        rules: &[EgressRule],
    ) -> Result<CheckedTarget, TargetError> {
        let (host, port) = parse_authority(authority)?;
        // The most specific rule that admits the target is the one charged: the exact name
        // before any wildcard, a longer wildcard before a shorter one. Else a budget on
        // `zz.example.com` would be bypassed through a rule `*.example.com` without one.
        let rule = rules
            .iter()
            .filter(|r| {
                i32::from(port) == r.port
                    && HostPattern::parse(&r.host).is_ok_and(|p| p.matches(&host))
            })
            .max_by_key(|r| (!r.host.starts_with("*."), r.host.len()))
            .cloned()
            .ok_or_else(|| TargetError::NotAllowed {
                host: host.clone(),
                port,
            })?;
        let ips = self
            .resolver
            .lookup(&host)
            .await
            .map_err(|source| TargetError::Resolve {
                host: host.clone(),
                source,
            })?;
        if ips.is_empty() {
            return Err(TargetError::NoAddress { host });
        }
        let mut addrs = Vec::with_capacity(ips.len());
        for ip in ips {
            let addr = SocketAddr::new(ip, port);
            if let Some(range) = forbidden(ip).filter(|_| !self.reachable(addr)) {
                return Err(TargetError::Forbidden {
                    host,
                    addr: ip,
                    range,
                });
            }
            if self.overrides.is_some() && !self.reachable(addr) {
                return Err(TargetError::NotATestServer { host, addr });
            }
            if !addrs.contains(&addr) {
                addrs.push(addr);
            }
        }
        Ok(CheckedTarget {
            host,
            port,
            rule,
            addrs,
        })
    }

    fn reachable(&self, addr: SocketAddr) -> bool {
        self.overrides
            .as_ref()
            .is_some_and(|o| o.reachable.contains(&addr))
    }
}

/// Splits `host:port` into a checked DNS name (lower-case, no trailing dot) and a port.
fn parse_authority(authority: &str) -> Result<(String, u16), TargetError> {
    // The authority is the sandbox's: the refusal (and its audit row) quotes 300 characters of
    // it at most.
    let bad = |why| TargetError::BadAuthority {
        authority: authority.chars().take(300).collect(),
        why,
    };
    let literal = |host: &str| TargetError::AddressLiteral {
        host: host.to_owned(),
    };
    if authority.starts_with('[') || authority.matches(':').count() > 1 {
        // `[v6]:port`, or a bare IPv6 address: an address whatever follows.
        return Err(literal(
            authority.rsplit_once(':').map_or(authority, |(h, _)| h),
        ));
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("the port is not a number"));
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad("the port is not 1 to 65535"))?;
    if host.contains('%') {
        return Err(literal(host));
    }
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if !name.is_ascii() {
        return Err(bad(
            "the name is not ASCII (an international name goes in its xn-- form)",
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        return Err(bad("a name holds only letters, digits, dots and hyphens"));
    }
    if is_ipv4_form(&name) {
        return Err(literal(host));
    }
    if name.is_empty() || name.len() > 253 {
        return Err(bad("a name has 1 to 253 characters"));
    }
    let labels_ok = name.split('.').all(|label| {
        (1..=63).contains(&label.len()) && !label.starts_with('-') && !label.ends_with('-')
    });
    if !labels_ok {
        return Err(bad(
            "each label of a name has 1 to 63 characters and no hyphen at either end",
        ));
    }
    Ok((name, port))
}

/// Whether `name` (lower-case) is an IPv4 address in a spelling some resolver accepts
/// (`inet_aton`: one to four parts, each decimal, octal with a leading 0 or hex with 0x), or
/// ends like one (a last label of digits, or a 0x number: no top-level domain does).
fn is_ipv4_form(name: &str) -> bool {
    let number = |part: &str| {
        if let Some(hex) = part.strip_prefix("0x") {
            hex.bytes().all(|b| b.is_ascii_hexdigit())
        } else {
            !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
        }
    };
    let parts: Vec<&str> = name.split('.').collect();
    let last = parts.last().copied().unwrap_or_default();
    (parts.len() <= 4 && parts.iter().all(|p| number(p)))
        || (!last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()))
        || last.starts_with("0x")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A resolver that answers from a table and counts its lookups.
    #[derive(Clone, Default)]
    struct Table {
        names: HashMap<&'static str, Vec<IpAddr>>,
        lookups: Arc<AtomicUsize>,
    }

    impl Table {
        fn with(mut self, host: &'static str, addrs: &[&str]) -> Self {
            let addrs = addrs
                .iter()
                .map(|a| a.parse().expect("an address"))
                .collect();
            self.names.insert(host, addrs);
            self
        }
    }

    impl Resolver for Table {
        fn lookup<'a>(&'a self, host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            let found = self.names.get(host).cloned();
            Box::pin(async move {
                found.ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no such name")
                })
            })
        }
    }

    fn rules(specs: &[&str]) -> Vec<EgressRule> {
        specs
            .iter()
            .map(|s| super::super::parse_rule(s, None, None).expect("a rule"))
            .collect()
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(future)
    }

    #[test]
    fn an_address_in_any_spelling_is_refused_before_any_lookup() {
        let table = Table::default().with("api.shop.test", &["1.1.1.1"]);
        let lookups = table.lookups.clone();
        let check = TargetCheck::with_resolver(table);
        let policy = rules(&["api.shop.test", "*.shop.test", "*.shop.test:80"]);
        for authority in [
            "127.0.0.1:443",
            "127.0.0.1.:443",
            "2130706433:443",
            "0x7f000001:443",
            "0x7f.1:443",
            "0X7F.0.0.1:443",
            "0177.0.0.1:443",
            "017700000001:443",
            "127.1:443",
            "127.0.1:443",
            "0:443",
            "256.256.256.256:443",
            "1.2.3.4.5:443",
            "169.254.169.254:80",
            "[::1]:443",
            "::1:443",
            "[::ffff:127.0.0.1]:443",
            "[::ffff:7f00:1]:443",
            "[::127.0.0.1]:443",
            "[64:ff9b::a9fe:a9fe]:443",
            "[fd00:ec2::254]:80",
            "[fe80::1%25eth0]:443",
            "[fe80::1%eth0]:443",
            "fe80::1%eth0:443",
            "10.0.0.1%eth0:443",
            "x.0x7f:443",
            "a.shop.127:443",
        ] {
            let refused = block_on(check.check(authority, &policy));
            assert!(
                matches!(refused, Err(TargetError::AddressLiteral { .. })),
                "{authority}: {refused:?}"
            );
        }
        assert_eq!(lookups.load(Ordering::SeqCst), 0, "nothing was resolved");
    }

    #[test]
    fn the_most_specific_rule_admits_and_is_charged() {
        let table = Table::default()
            .with("zz.shop.test", &["1.1.1.1"])
            .with("x.a.shop.test", &["1.1.1.1"])
            .with("y.shop.test", &["1.1.1.1"]);
        let check = TargetCheck::with_resolver(table);
        // In the order the store may list them: the broad wildcard first.
        let policy = rules(&["*.shop.test", "*.a.shop.test", "zz.shop.test"]);
        for (authority, rule) in [
            ("zz.shop.test:443", "zz.shop.test"),
            ("x.a.shop.test:443", "*.a.shop.test"),
            ("y.shop.test:443", "*.shop.test"),
        ] {
            let target = block_on(check.check(authority, &policy)).expect("admitted");
            assert_eq!(target.rule.host, rule, "{authority}");
        }
    }

    #[test]
    fn a_name_no_rule_admits_is_never_resolved() {
        let table = Table::default()
            .with("evil.test", &["1.1.1.1"])
            .with("shop.test", &["1.1.1.1"])
            .with("api.shop.test", &["1.1.1.1"]);
        let lookups = table.lookups.clone();
        let check = TargetCheck::with_resolver(table);
        let policy = rules(&["api.shop.test", "*.cdn.shop.test:8443"]);
        for authority in [
            "evil.test:443",
            "api.shop.test:8443",
            "api.shop.test:80",
            "x.api.shop.test:443",
            "cdn.shop.test:8443",
            "a.cdn.shop.test:443",
            "evilapi.shop.test:443",
            "api.shop.test.evil.test:443",
        ] {
            let refused = block_on(check.check(authority, &policy));
            let Err(TargetError::NotAllowed { host, port }) = &refused else {
                panic!("{authority}: {refused:?}");
            };
            let message = refused.as_ref().unwrap_err().to_string();
            assert!(
                message.contains(&format!("--allow {host}:{port}")),
                "the refusal says how to ask: {message}"
            );
        }
        assert!(
            matches!(
                block_on(check.check("evil.test:443", &[])),
                Err(TargetError::NotAllowed { .. })
            ),
            "no policy: nothing goes out"
        );
        assert_eq!(
            lookups.load(Ordering::SeqCst),
            0,
            "no refused name was looked up"
        );
        let admitted = block_on(check.check("API.Shop.Test.:443", &policy)).expect("admitted");
        assert_eq!(admitted.host, "api.shop.test");
        assert_eq!(lookups.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn malformed_authorities_are_refused() {
        let check = TargetCheck::with_resolver(Table::default());
        let policy = rules(&["*.shop.test"]);
        for authority in [
            "api.shop.test",
            "api.shop.test:",
            ":443",
            "api.shop.test:0",
            "api.shop.test:+443",
            "api.shop.test:65536",
            "api.shop.test:https",
            "a..shop.test:443",
            ".shop.test:443",
            "-a.shop.test:443",
            "bücher.shop.test:443",
            "a_b.shop.test:443",
            "user@api.shop.test:443",
            "api.shop.test/x:443",
            " api.shop.test:443",
            "api.shop.test :443",
        ] {
            let refused = block_on(check.check(authority, &policy));
            assert!(
                matches!(refused, Err(TargetError::BadAuthority { .. })),
                "{authority}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_name_resolving_to_a_forbidden_address_is_refused_whatever_the_policy() {
        let cases = [
            ("10.1.2.3", Range::Private),
            ("172.16.0.1", Range::Private),
            ("172.31.255.255", Range::Private),
            ("192.168.1.1", Range::Private),
            ("127.0.0.1", Range::Loopback),
            ("127.255.0.9", Range::Loopback),
            ("0.0.0.0", Range::Unspecified),
            ("0.1.2.3", Range::Unspecified),
            ("169.254.169.254", Range::Metadata),
            ("169.254.1.1", Range::LinkLocal),
            ("100.64.0.1", Range::Cgnat),
            ("100.100.100.200", Range::Metadata),
            ("192.0.0.192", Range::Metadata),
            ("192.0.0.8", Range::Reserved),
            ("192.0.2.1", Range::Documentation),
            ("198.51.100.7", Range::Documentation),
            ("203.0.113.9", Range::Documentation),
            ("198.18.0.1", Range::Benchmarking),
            ("192.88.99.1", Range::Reserved),
            ("224.0.0.1", Range::Multicast),
            ("239.255.255.250", Range::Multicast),
            ("240.0.0.1", Range::Reserved),
            ("255.255.255.255", Range::Broadcast),
            ("::", Range::Unspecified),
            ("::1", Range::Loopback),
            ("fd00:ec2::254", Range::Metadata),
            ("fc00::1", Range::Private),
            ("fd12:3456::1", Range::Private),
            ("fe80::1", Range::LinkLocal),
            ("fec0::1", Range::Reserved),
            ("ff02::1", Range::Multicast),
            ("::ffff:10.0.0.1", Range::Private),
            ("::ffff:127.0.0.1", Range::Loopback),
            ("::ffff:169.254.169.254", Range::Metadata),
            ("::127.0.0.1", Range::Reserved),
            ("::8.8.8.8", Range::Reserved),
            ("64:ff9b::a9fe:a9fe", Range::Metadata),
            ("64:ff9b::7f00:1", Range::Loopback),
            ("64:ff9b::a00:1", Range::Private),
            ("64:ff9b:1::1", Range::Reserved),
            ("100::1", Range::Reserved),
            ("2001::1", Range::Reserved),
            ("2001:2::1", Range::Reserved),
            ("2001:db8::1", Range::Documentation),
            ("2002:7f00:1::1", Range::Reserved),
            ("3fff::1", Range::Documentation),
            ("5f00::1", Range::Reserved),
        ];
        let policy = rules(&["*.shop.test"]);
        for (addr, range) in cases {
            let table = Table::default().with("api.shop.test", &[addr]);
            let refused =
                block_on(TargetCheck::with_resolver(table).check("api.shop.test:443", &policy));
            match refused {
                Err(TargetError::Forbidden { range: got, .. }) => {
                    assert_eq!(got, range, "{addr} is refused as {range:?}, not {got:?}")
                }
                other => panic!("{addr} must be refused: {other:?}"),
            }
        }
    }

    #[test]
    fn one_forbidden_answer_among_public_ones_refuses_and_public_ones_are_pinned() {
        let policy = rules(&["api.shop.test"]);
        // A name answering a public and a private address (a rebinding attempt) is refused as a
        // whole: the connection could otherwise land on either.
        let mixed = Table::default().with("api.shop.test", &["1.1.1.1", "10.0.0.1"]);
        let refused =
            block_on(TargetCheck::with_resolver(mixed).check("api.shop.test:443", &policy));
        let message = refused.as_ref().unwrap_err().to_string();
        assert!(
            matches!(refused, Err(TargetError::Forbidden { addr, .. }) if addr.to_string() == "10.0.0.1"),
            "{message}"
        );
        assert!(
            message.contains("10.0.0.1") && message.contains("private"),
            "{message}"
        );

        let public = Table::default().with(
            "api.shop.test",
            &["1.1.1.1", "2606:4700::1111", "1.1.1.1", "64:ff9b::101:101"],
        );
        let target =
            block_on(TargetCheck::with_resolver(public).check("api.shop.test:443", &policy))
                .expect("public addresses pass");
        let pinned: Vec<String> = target.addrs.iter().map(ToString::to_string).collect();
        assert_eq!(
            pinned,
            [
                "1.1.1.1:443",
                "[2606:4700::1111]:443",
                "[64:ff9b::101:101]:443"
            ],
            "the checked addresses, once each, with the port"
        );
        assert_eq!(target.rule.host, "api.shop.test");

        let none = Table::default().with("api.shop.test", &[]);
        assert!(matches!(
            block_on(TargetCheck::with_resolver(none).check("api.shop.test:443", &policy)),
            Err(TargetError::NoAddress { .. })
        ));
        assert!(matches!(
            block_on(
                TargetCheck::with_resolver(Table::default()).check("api.shop.test:443", &policy)
            ),
            Err(TargetError::Resolve { .. })
        ));
    }

    /// A resolver whose answer changes after its first lookup (a rebinding name's DNS), counting
    /// the lookups it answers.
    struct Rebinding {
        first: Vec<IpAddr>,
        then: Vec<IpAddr>,
        lookups: AtomicUsize,
    }

    impl Resolver for Arc<Rebinding> {
        fn lookup<'a>(&'a self, _host: &'a str) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
            let n = self.lookups.fetch_add(1, Ordering::SeqCst);
            let answer = if n == 0 {
                self.first.clone()
            } else {
                self.then.clone()
            };
            Box::pin(async move { Ok(answer) })
        }
    }

    #[test]
    fn a_rebinding_name_is_pinned_to_its_checked_answer_and_a_refused_name_is_never_looked_up() {
        let dns = Arc::new(Rebinding {
            first: vec!["1.1.1.1".parse().unwrap()],
            then: vec!["169.254.169.254".parse().unwrap()],
            lookups: Default::default(),
        });
        let check = TargetCheck::with_resolver(dns.clone());
        let policy = rules(&["api.shop.test"]);
        let lookups = || dns.lookups.load(Ordering::SeqCst);

        // A name outside the policy: refused before any lookup (nothing leaks through DNS).
        for authority in [
            "evil.test:443",
            "api.shop.test.evil.test:443",
            "shop.test:443",
        ] {
            assert!(
                matches!(
                    block_on(check.check(authority, &policy)),
                    Err(TargetError::NotAllowed { .. })
                ),
                "{authority} is not in the policy"
            );
        }
        assert_eq!(lookups(), 0, "refused names are never resolved");

        // The first connection: one lookup, its public answer checked and pinned (the dial
        // takes these addresses, never the name).
        let first = block_on(check.check("api.shop.test:443", &policy)).expect("public");
        assert_eq!(lookups(), 1, "one lookup per connection");
        assert_eq!(first.addrs, ["1.1.1.1:443".parse::<SocketAddr>().unwrap()]);
        // The name rebinds to the metadata address: the next connection checks its new answer
        // and is refused; the pinned target of the first is unchanged.
        match block_on(check.check("api.shop.test:443", &policy)) {
            Err(TargetError::Forbidden { range, addr, .. }) => {
                assert_eq!(range, Range::Metadata);
                assert_eq!(addr.to_string(), "169.254.169.254");
            }
            other => panic!("the rebound answer must be refused: {other:?}"),
        }
        assert_eq!(lookups(), 2);
        assert_eq!(first.addrs, ["1.1.1.1:443".parse::<SocketAddr>().unwrap()]);
    }

    #[test]
    fn test_overrides_exist_only_on_loopback_and_reach_only_their_loopback_servers() {
        assert!(matches!(
            TestOverrides::new(false),
            Err(TargetError::OverridesOffLoopback)
        ));
        let server: SocketAddr = "127.0.0.1:40443".parse().unwrap();
        assert!(matches!(
            TestOverrides::new(true)
                .unwrap()
                .reach("10.0.0.1:443".parse().unwrap()),
            Err(TargetError::OverrideNotLoopback(_))
        ));
        let loopback = IpAddr::from([127, 0, 0, 1]);
        let overrides = TestOverrides::new(true)
            .unwrap()
            .resolve("api.shop.test", &[loopback])
            .resolve("rebind.shop.test", &[loopback])
            .resolve("inside.shop.test", &["10.0.0.1".parse().unwrap()])
            .reach(server)
            .unwrap();
        let check = TargetCheck::test(overrides);
        let policy = rules(&["*.shop.test:40443", "*.shop.test"]);
        let target =
            block_on(check.check("api.shop.test:40443", &policy)).expect("the test server");
        assert_eq!(target.addrs, [server]);
        for (authority, why) in [
            (
                "api.shop.test:443",
                "loopback on another port than the server's",
            ),
            (
                "inside.shop.test:40443",
                "a name resolving to a private address",
            ),
        ] {
            assert!(
                matches!(
                    block_on(check.check(authority, &policy)),
                    Err(TargetError::Forbidden { .. })
                ),
                "{why} is refused"
            );
        }
        assert!(
            matches!(
                block_on(check.check("unknown.shop.test:40443", &policy)),
                Err(TargetError::NoAddress { .. })
            ),
            "a name not in the table is not looked up anywhere else"
        );
        assert!(matches!(
            block_on(check.check("127.0.0.1:40443", &policy)),
            Err(TargetError::AddressLiteral { .. })
        ));
    }
}
