//! The `export_transcript` tool: a sandbox's or a conversation's transcript for the person who
//! takes over, as a resource link plus a download link.

use rmcp::model::{ContentBlock, Resource};

use super::McpServer;
use super::answer::{Answer, CallError};
use super::render::{rfc3339, structured};
use super::schema::{ExportTranscriptArgs, ExportTranscriptOutput};
use crate::sandboxes::{Caller, ServiceError};
use crate::transcripts::{Format, Subject};
use sandgate_service::links::LinkKind;

impl McpServer {
    pub(super) async fn export_transcript(
        &self,
        args: ExportTranscriptArgs,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Answer, CallError> {
        let format = match args.format.as_deref() {
            None => Format::Notebook,
            Some(f) => Format::parse(f).ok_or_else(|| {
                CallError::InvalidParams(format!("format {f:?} is not ipynb or html"))
            })?,
        };
        let subject = match (args.sandbox_id, args.conversation_id, conversation) {
            (Some(id), _, _) => Subject::Sandbox(id),
            (None, Some(c), _) => Subject::Conversation(c),
            // The MCP session is the conversation (2025-11-25 era): its sandbox, so that the
            // session id never ends up in a URI or a link.
            (None, None, Some(session)) => Subject::Sandbox(
                self.inner
                    .sandboxes
                    .conversation_sandbox(caller, session)
                    .await?,
            ),
            (None, None, None) => {
                return Err(CallError::InvalidParams(
                    "give the sandbox_id or conversation_id whose transcript to export".into(),
                ));
            }
        };
        // Its outline only: the export names the transcript and links it; nothing is loaded
        // or rendered here (the resource and the link do that when they are read).
        let outline = self
            .inner
            .transcripts
            .outline(caller.tenant, &subject)
            .await
            .map_err(ServiceError::from)?;
        let uri = super::resources::transcript_uri(&subject, format);
        let (download_url, expires) =
            self.inner
                .links
                .mint_transcript(caller, &subject, LinkKind::from(format));
        let parts = &outline.parts;
        let out = ExportTranscriptOutput {
            sandbox_id: parts
                .last()
                .map(|p| p.sandbox_id.clone())
                .unwrap_or_default(),
            sandbox_ids: parts.iter().map(|p| p.sandbox_id.clone()).collect(),
            conversation_id: outline.conversation_id.clone(),
            format: format.extension().to_owned(),
            uri: uri.clone(),
            mime_type: format.mime_type().to_owned(),
            size: parts.iter().map(|p| p.bytes).sum(),
            calls: parts.iter().map(|p| p.calls).sum(),
            dropped: parts.iter().map(|p| p.dropped).sum(),
            over_budget: parts.iter().map(|p| p.over_budget).sum(),
            omitted_sandboxes: u64::from(outline.omitted.parts),
            omitted_calls: outline.omitted.calls,
            download_url,
            download_expires_at: rfc3339(expires),
        };
        let text = export_text(&outline.title(), &out);
        let link = ContentBlock::resource_link(
            Resource::new(uri, format!("transcript.{}", out.format))
                .with_title(outline.title())
                .with_mime_type(format.mime_type())
                .with_size(out.size),
        );
        Ok(Answer {
            sandbox_id: Some(out.sandbox_id.clone()),
            result: structured(&out, text, false, vec![link]),
        })
    }
}

/// The answer's text: what the export holds, its link, and what it does not hold.
fn export_text(title: &str, out: &ExportTranscriptOutput) -> String {
    let mut text = format!(
        "Transcript of {} ({} calls, about {} bytes) as {}: {}. Give the person taking over this \
         link (valid until {}): {}",
        title.to_lowercase(),
        out.calls,
        out.size,
        out.format,
        out.uri,
        out.download_expires_at,
        out.download_url
    );
    if out.dropped > out.over_budget {
        text.push_str(&format!(
            "\n{} later calls were not kept (the transcript's bound per sandbox).",
            out.dropped - out.over_budget
        ));
    }
    if out.over_budget > 0 {
        text.push_str(&format!(
            "\n{} calls were not kept because your tenant's stored transcripts reached their \
             byte budget.",
            out.over_budget
        ));
    }
    if out.omitted_sandboxes > 0 {
        text.push_str(&format!(
            "\nThis export leaves out the conversation's {} oldest sandbox(es) ({} calls); \
             export one of them by its sandbox_id.",
            out.omitted_sandboxes, out.omitted_calls
        ));
    }
    text
}
