//! Scopes: what a token lets its holder do. Each MCP tool needs exactly one scope.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A permission a grant can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Scope {
    /// Create, list and close sandboxes.
    #[serde(rename = "sandbox")]
    Sandbox,
    /// Run code and terminal commands.
    #[serde(rename = "execute")]
    Execute,
    /// Read and list files.
    #[serde(rename = "files:read")]
    FilesRead,
    /// Upload files.
    #[serde(rename = "files:write")]
    FilesWrite,
}

impl Scope {
    /// Every scope, in the order they are shown to people.
    pub const ALL: [Scope; 4] = [
        Scope::Sandbox,
        Scope::Execute,
        Scope::FilesRead,
        Scope::FilesWrite,
    ];

    /// The scope's wire name (as in a token's `scope` claim).
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Sandbox => "sandbox",
            Scope::Execute => "execute",
            Scope::FilesRead => "files:read",
            Scope::FilesWrite => "files:write",
        }
    }

    /// What the scope allows, in plain words for a consent screen.
    pub fn describe(self) -> &'static str {
        match self {
            Scope::Sandbox => "create and close sandboxes",
            Scope::Execute => "run Python code and shell commands in them",
            Scope::FilesRead => "read and list files in them",
            Scope::FilesWrite => "upload files into them",
        }
    }

    /// Parses a space-separated scope string (RFC 6749 §3.3).
    pub fn parse_list(s: &str) -> Result<Vec<Scope>, UnknownScope> {
        let mut scopes: Vec<Scope> = s
            .split_ascii_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        scopes.sort();
        scopes.dedup();
        Ok(scopes)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A scope name sandgate does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scope {0:?}; known scopes are sandbox, execute, files:read, files:write")]
pub struct UnknownScope(pub String);

impl FromStr for Scope {
    type Err = UnknownScope;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scope::ALL
            .into_iter()
            .find(|scope| scope.as_str() == s)
            .ok_or_else(|| UnknownScope(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorted_deduplicated_lists() {
        assert_eq!(
            Scope::parse_list("files:read sandbox  files:read").unwrap(),
            vec![Scope::Sandbox, Scope::FilesRead]
        );
    }

    #[test]
    fn rejects_unknown_scopes_by_name() {
        let err = Scope::parse_list("sandbox admin").unwrap_err();
        assert_eq!(err, UnknownScope("admin".into()));
    }
}
