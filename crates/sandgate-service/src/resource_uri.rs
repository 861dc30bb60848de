//! The URIs of MCP resources (DESIGN: a sandbox's files and transcripts as resources):
//! `sandbox://{sandbox_id}/files/{path}`, `sandbox://{sandbox_id}/transcript.ipynb|html`,
//! `conversation://{conversation_id}/transcript.ipynb|html` and the tenant's data policy.
//! Path segments are percent-encoded.

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

use crate::transcripts::{Format, Subject};

/// The tenant's data policy.
pub const POLICY_URI: &str = "sandgate://data-policy";
/// What a path segment keeps unescaped.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// The URI of a file (absolute path under /home/user) in a sandbox.
pub fn file_uri(sandbox_id: &str, path: &str) -> String {
    let relative = path
        .strip_prefix("/home/user/")
        .unwrap_or(path.trim_start_matches('/'));
    let encoded: Vec<String> = relative
        .split('/')
        .map(|seg| utf8_percent_encode(seg, SEGMENT).to_string())
        .collect();
    format!("sandbox://{sandbox_id}/files/{}", encoded.join("/"))
}

/// The URI of a transcript.
pub fn transcript_uri(subject: &Subject, format: Format) -> String {
    match subject {
        Subject::Sandbox(id) => format!("sandbox://{id}/transcript.{}", format.extension()),
        Subject::Conversation(id) => format!(
            "conversation://{}/transcript.{}",
            utf8_percent_encode(id, SEGMENT),
            format.extension()
        ),
    }
}

/// The last segment of a path.
pub fn file_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

/// What a URI names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The tenant's data policy.
    Policy,
    /// A file in a live sandbox (path relative to /home/user).
    File {
        /// The sandbox.
        sandbox_id: String,
        /// The path, relative to /home/user.
        path: String,
    },
    /// A sandbox's or a conversation's transcript.
    Transcript {
        /// Whose transcript.
        subject: Subject,
        /// In which format.
        format: Format,
    },
}

/// What `uri` names, or `None` when it is not one of ours.
pub fn parse(uri: &str) -> Option<Target> {
    if uri == POLICY_URI {
        return Some(Target::Policy);
    }
    let transcript = |rest: &str| {
        let format = rest.strip_prefix("transcript.").and_then(Format::parse)?;
        Some(format)
    };
    if let Some(rest) = uri.strip_prefix("sandbox://") {
        let (sandbox_id, rest) = rest.split_once('/')?;
        if sandbox_id.is_empty() {
            return None;
        }
        if let Some(path) = rest.strip_prefix("files/") {
            let path = percent_decode_str(path).decode_utf8().ok()?;
            if path.is_empty() {
                return None;
            }
            return Some(Target::File {
                sandbox_id: sandbox_id.to_owned(),
                path: path.into_owned(),
            });
        }
        return Some(Target::Transcript {
            subject: Subject::Sandbox(sandbox_id.to_owned()),
            format: transcript(rest)?,
        });
    }
    let rest = uri.strip_prefix("conversation://")?;
    let (conversation, rest) = rest.split_once('/')?;
    let conversation = percent_decode_str(conversation).decode_utf8().ok()?;
    if conversation.is_empty() {
        return None;
    }
    Some(Target::Transcript {
        subject: Subject::Conversation(conversation.into_owned()),
        format: transcript(rest)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip() {
        let uri = file_uri("sbx_1", "/home/user/out put/a#b.csv");
        assert_eq!(uri, "sandbox://sbx_1/files/out%20put/a%23b.csv");
        assert_eq!(
            parse(&uri),
            Some(Target::File {
                sandbox_id: "sbx_1".into(),
                path: "out put/a#b.csv".into()
            })
        );
        let subject = Subject::Conversation("ticket/42".into());
        let uri = transcript_uri(&subject, Format::Html);
        assert_eq!(uri, "conversation://ticket%2F42/transcript.html");
        assert_eq!(
            parse(&uri),
            Some(Target::Transcript {
                subject,
                format: Format::Html
            })
        );
        assert_eq!(parse("sandbox://sbx_1/transcript.pdf"), None);
        assert_eq!(parse("sandbox:///files/a"), None);
        assert_eq!(parse("file:///etc/passwd"), None);
    }
}
