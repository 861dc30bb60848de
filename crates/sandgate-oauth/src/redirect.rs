//! Where a browser may be sent after login (`next=`): only back to this gateway.
//!
//! The value is parsed as a URL relative to the public URL, the way a browser would resolve a
//! `Location` header, and accepted only when it lands on the same origin. Anything a browser
//! could read another way is refused before parsing: control characters and whitespace (a
//! browser strips tabs and newlines, so `/\t/evil.example` becomes `//evil.example`) and
//! backslashes (read as slashes). What is followed is the normalised path and query, never
//! the raw input.

use url::Url;

/// Longest `next` value accepted, bytes (an authorization request with its PKCE challenge and
/// state fits with room to spare).
pub const MAX_NEXT_BYTES: usize = 4096;

/// The local path (with query) to send the browser to, or `fallback` when `next` is missing or
/// leads anywhere but `public_url`'s origin.
pub fn same_origin_path(public_url: &str, next: Option<&str>, fallback: &str) -> String {
    next.and_then(|n| checked(public_url, n))
        .unwrap_or_else(|| fallback.to_owned())
}

fn checked(public_url: &str, next: &str) -> Option<String> {
    if next.is_empty()
        || next.len() > MAX_NEXT_BYTES
        || !next.starts_with('/')
        || next.starts_with("//")
        || next
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '\\')
    {
        return None;
    }
    let base = Url::parse(public_url).ok()?;
    let target = base.join(next).ok()?;
    if target.origin() != base.origin() || !target.username().is_empty() {
        return None;
    }
    let mut local = target.path().to_owned();
    if let Some(query) = target.query() {
        local.push('?');
        local.push_str(query);
    }
    // A path the URL parser normalised into `//…` would again be scheme-relative.
    (!local.starts_with("//")).then_some(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "https://gate.example";

    fn next(n: &str) -> String {
        same_origin_path(BASE, Some(n), "/apps")
    }

    #[test]
    fn local_paths_with_queries_are_followed() {
        assert_eq!(
            next("/oauth/authorize?client_id=a&state=x%20y"),
            "/oauth/authorize?client_id=a&state=x%20y"
        );
        assert_eq!(next("/apps"), "/apps");
        assert_eq!(next("/a/../oauth/authorize"), "/oauth/authorize");
    }

    #[test]
    fn anything_that_could_leave_the_origin_falls_back() {
        for hostile in [
            "/\t/evil.example",
            "/\n/evil.example",
            "/\r\n/evil.example",
            "//evil.example",
            "///evil.example",
            "/\\evil.example",
            "\\\\evil.example",
            "https://evil.example/",
            "http://gate.example/",
            "https:evil.example",
            "javascript:alert(1)",
            "JaVaScRiPt:alert(1)",
            "data:text/html,x",
            " /apps",
            "/apps\u{0}",
            "",
            "evil.example",
        ] {
            assert_eq!(next(hostile), "/apps", "{hostile:?} must fall back");
        }
        assert_eq!(next(&format!("/{}", "a".repeat(MAX_NEXT_BYTES))), "/apps");
        assert_eq!(same_origin_path(BASE, None, "/apps"), "/apps");
    }
}
