//! Host rules of an egress policy: `host[:port]`, the host a DNS name or a wildcard of one label
//! or more (`*.example.com`), never an address. Checked before they are stored, so the egress
//! component matches names only and refuses every address literal whatever the policy says.

use sandgate_store::egress::EgressRule;

/// The port a rule allows when none is written.
pub const DEFAULT_PORT: u16 = 443;

/// A rule or a host that is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// The host is not a DNS name this policy accepts.
    #[error(
        "{host:?} is not an allowed host: {why}. Write a DNS name (`api.example.com`) or a \
         wildcard of its subdomains (`*.example.com`), optionally with `:port` (default 443)"
    )]
    BadHost {
        /// The host as written.
        host: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The port is not 1–65535.
    #[error("{0:?} is not a port: write a number from 1 to 65535")]
    BadPort(String),
}

/// A checked host or wildcard, lower-case, without a trailing dot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern(String);

impl HostPattern {
    /// Checks `host` (a name, or `*.` and a name of at least two labels).
    pub fn parse(host: &str) -> Result<Self, RuleError> {
        let bad = |why| RuleError::BadHost {
            host: host.to_owned(),
            why,
        };
        let lower = host.trim().trim_end_matches('.').to_ascii_lowercase();
        if !lower.is_ascii() {
            return Err(bad(
                "it is not ASCII (write an international name in its xn-- form)",
            ));
        }
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        check_name(name).map_err(bad)?;
        if wildcard && name.split('.').count() < 2 {
            return Err(bad("a wildcard must name at least two labels after `*.`"));
        }
        Ok(Self(lower))
    }

    /// As stored and shown.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `host` (a name from a request, any case, maybe with a trailing dot) is this
    /// pattern's: the name itself, or for a wildcard any name of one label or more below it
    /// (not the name itself).
    pub fn matches(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        match self.0.strip_prefix("*.") {
            Some(parent) => host
                .strip_suffix(parent)
                .and_then(|head| head.strip_suffix('.'))
                .is_some_and(|head| !head.is_empty()),
            None => host == self.0,
        }
    }
}

/// Why `name` is not a DNS name of at least two labels that is not an address literal.
fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 253 {
        return Err("a name has 1 to 253 characters");
    }
    if name.contains(['[', ']', ':']) {
        return Err("an address is never allowed, only names");
    }
    let labels: Vec<&str> = name.split('.').collect();
    if labels.len() < 2 {
        return Err("a single-label name is not allowed (it may resolve inside the network)");
    }
    for label in &labels {
        if label.is_empty() || label.len() > 63 {
            return Err("each label has 1 to 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err("labels hold only letters, digits and hyphens");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label does not start or end with a hyphen");
        }
    }
    let last = labels[labels.len() - 1];
    // Every IPv4 form (dotted, short, octal, hex: `127.1`, `0177.0.0.1`, `0x7f.1`) ends in a
    // label of digits or a 0x number; no top-level domain does.
    if last.bytes().all(|b| b.is_ascii_digit()) || last.starts_with("0x") {
        return Err("an address is never allowed, only names");
    }
    Ok(())
}

/// Parses `host[:port]` into a rule with the given budgets.
pub fn parse_rule(
    text: &str,
    connections_per_minute: Option<i32>,
    bytes_per_day: Option<i64>,
) -> Result<EgressRule, RuleError> {
    let text = text.trim();
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => {
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| RuleError::BadPort(port.to_owned()))?;
            (host, port)
        }
        _ => (text, DEFAULT_PORT),
    };
    let host = HostPattern::parse(host)?;
    Ok(EgressRule {
        host: host.0,
        port: i32::from(port),
        connections_per_minute,
        bytes_per_day,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_wildcards_are_rules_with_their_port() {
        let rule = parse_rule("API.Shop.test.:8443", Some(5), None).unwrap();
        assert_eq!(
            (rule.host.as_str(), rule.port, rule.connections_per_minute),
            ("api.shop.test", 8443, Some(5))
        );
        assert_eq!(parse_rule("*.shop.test", None, None).unwrap().port, 443);
        assert!(parse_rule("shop.test:0", None, None).is_err());
        assert!(parse_rule("shop.test:65536", None, None).is_err());
        assert!(parse_rule("shop.test:https", None, None).is_err());
    }

    #[test]
    fn an_address_in_any_form_is_never_a_rule() {
        for literal in [
            "127.0.0.1",
            "127.1",
            "2130706433",
            "0x7f000001",
            "0x7f.1",
            "0177.0.0.1",
            "169.254.169.254",
            "[::1]",
            "::ffff:127.0.0.1",
            "[::ffff:7f00:1]:443",
            "[64:ff9b::a9fe:a9fe]",
            "*.0.0.127",
            "localhost",
            "metadata",
            "*.test",
            "*",
            "a..b",
            "-a.test",
            "exa mple.test",
            "bücher.test",
            "a_b.test",
        ] {
            assert!(
                parse_rule(literal, None, None).is_err(),
                "{literal:?} must be refused"
            );
        }
        let err = parse_rule("10.0.0.1", None, None).unwrap_err().to_string();
        assert!(err.contains("only names"), "the refusal says why: {err}");
    }

    #[test]
    fn a_wildcard_matches_names_below_it_and_not_its_parent_or_a_lookalike() {
        let wild = HostPattern::parse("*.shop.test").unwrap();
        assert!(wild.matches("api.shop.test"));
        assert!(wild.matches("a.b.Shop.Test."));
        assert!(!wild.matches("shop.test"), "not the parent itself");
        assert!(
            !wild.matches("evilshop.test"),
            "not a name that only ends alike"
        );
        assert!(!wild.matches(".shop.test"));
        assert!(!wild.matches("shop.test.evil.test"));
        let exact = HostPattern::parse("api.shop.test").unwrap();
        assert!(exact.matches("API.shop.test."));
        assert!(!exact.matches("x.api.shop.test"));
    }
}
