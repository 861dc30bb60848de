//! A sandbox's files and transcripts as MCP resources, scoped to the caller's tenant exactly like
//! the tools (another tenant's resource answers like a missing one).
//!
//! - Templates: `sandbox://{sandbox_id}/files/{path}` (a live sandbox's file, path relative to
//!   /home/user), `sandbox://{sandbox_id}/transcript.ipynb|html` and
//!   `conversation://{conversation_id}/transcript.ipynb|html` (kept after the sandbox ends).
//! - `resources/list` shows the tenant's data policy and, in the 2025-11-25 era, the current
//!   MCP session's sandbox (its files and transcript); never another conversation's files. In
//!   the stateless era there is no current conversation: callers name what they want through
//!   the templates.
//! - Caching hints (2026-07-28): lists and contents are private and fresh for 0 ms (files
//!   change under running code); the templates are the same for everyone.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use rmcp::model::{
    CacheScope, ContentBlock, ListResourceTemplatesResult, ListResourcesResult,
    PaginatedRequestParams, ReadResourceResult, Resource, ResourceContents, ResourceTemplate,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use sandgate_auth::{AccessClaims, Scope};

use super::errors::{resource_error, resource_not_found};
use super::render::mime_type;
use super::{McpServer, claims_of, session_conversation};
pub use crate::resource_uri::{POLICY_URI, file_uri, transcript_uri};
use crate::resource_uri::{Target, file_name, parse};
use crate::sandboxes::Caller;
use crate::transcripts::{Format, Subject, TranscriptError};

/// Resources per `resources/list` page.
const PAGE_SIZE: usize = 50;
/// Most files listed from one sandbox (a walk of /home/user, a few levels deep).
const MAX_LISTED_FILES: usize = 500;
const MAX_DEPTH: usize = 4;
/// How long clients may keep the templates.
const TEMPLATES_TTL_MS: u64 = 3_600_000;

/// A `resource_link` content block for a file too big to inline.
pub fn file_link(sandbox_id: &str, path: &str, mime: &str, size: u64) -> ContentBlock {
    ContentBlock::resource_link(
        Resource::new(file_uri(sandbox_id, path), file_name(path))
            .with_mime_type(mime)
            .with_size(size),
    )
}

/// `resources/templates/list`.
pub fn templates() -> ListResourceTemplatesResult {
    let t = |uri: &str, name: &str, title: &str, description: &str, mime: Option<&str>| {
        let template = ResourceTemplate::new(uri, name)
            .with_title(title)
            .with_description(description);
        match mime {
            Some(m) => template.with_mime_type(m),
            None => template,
        }
    };
    ListResourceTemplatesResult::with_all_items(vec![
        t(
            "sandbox://{sandbox_id}/files/{path}",
            "sandbox-file",
            "A file in a sandbox",
            "A file in a live sandbox; path is relative to /home/user (e.g. outputs/figure-1-1.png).",
            None,
        ),
        t(
            "sandbox://{sandbox_id}/transcript.ipynb",
            "sandbox-transcript-notebook",
            "A sandbox's transcript as a Jupyter notebook",
            "Every cell (with outputs and charts), command and file transfer of the sandbox, as nbformat 4; kept after the sandbox ends.",
            Some(Format::Notebook.mime_type()),
        ),
        t(
            "sandbox://{sandbox_id}/transcript.html",
            "sandbox-transcript-html",
            "A sandbox's transcript as a web page",
            "The same transcript as a self-contained HTML page.",
            Some(Format::Html.mime_type()),
        ),
        t(
            "conversation://{conversation_id}/transcript.ipynb",
            "conversation-transcript-notebook",
            "A conversation's transcript as a Jupyter notebook",
            "Every sandbox the conversation had, oldest first.",
            Some(Format::Notebook.mime_type()),
        ),
        t(
            "conversation://{conversation_id}/transcript.html",
            "conversation-transcript-html",
            "A conversation's transcript as a web page",
            "Every sandbox the conversation had, as a self-contained HTML page.",
            Some(Format::Html.mime_type()),
        ),
    ])
    .with_ttl_ms(TEMPLATES_TTL_MS)
    .with_cache_scope(CacheScope::Public)
}

async fn caller_of(server: &McpServer, claims: &AccessClaims) -> Result<Caller, ErrorData> {
    let service = &server.inner.sandboxes;
    let limits = service
        .limits(claims.tenant)
        .await
        .map_err(|e| resource_error("", e))?;
    Ok(Caller {
        tenant: claims.tenant,
        subject: claims.sub.clone(),
        token_id: claims.jti.clone(),
        grant: claims.grant,
        limits,
        read_at_admission: None,
    })
}

fn authorized(ctx: &RequestContext<RoleServer>) -> Result<AccessClaims, ErrorData> {
    let claims =
        claims_of(ctx).ok_or_else(|| ErrorData::invalid_request("not authenticated", None))?;
    if !claims.has_scope(Scope::FilesRead) {
        return Err(ErrorData::invalid_request(
            "reading resources needs the files:read scope; reconnect the app with it",
            None,
        ));
    }
    Ok(claims)
}

fn policy_resource() -> Resource {
    Resource::new(POLICY_URI, "data-policy")
        .with_title("What sandgate keeps for you")
        .with_description("What is kept after a sandbox ends, for how long, and who can read it.")
        .with_mime_type("text/markdown")
}

/// `resources/list`: the data policy, then (legacy era) the session's sandbox.
pub async fn list(
    server: &McpServer,
    request: Option<PaginatedRequestParams>,
    ctx: &RequestContext<RoleServer>,
) -> Result<ListResourcesResult, ErrorData> {
    let claims = authorized(ctx)?;
    let offset = match request.and_then(|r| r.cursor) {
        None => 0,
        Some(cursor) => cursor.parse::<usize>().map_err(|_| {
            ErrorData::invalid_params(
                "invalid cursor; pass the nextCursor of the previous page",
                None,
            )
        })?,
    };
    let mut all = vec![policy_resource()];
    if let Some(conversation) = session_conversation(ctx) {
        let caller = caller_of(server, &claims).await?;
        all.extend(session_sandbox(server, &caller, &conversation).await?);
    }
    let page: Vec<Resource> = all.iter().skip(offset).take(PAGE_SIZE).cloned().collect();
    let mut result = ListResourcesResult::with_all_items(page);
    if offset + PAGE_SIZE < all.len() {
        result.next_cursor = Some((offset + PAGE_SIZE).to_string());
    }
    Ok(result.with_ttl_ms(0).with_cache_scope(CacheScope::Private))
}

/// The session's live sandbox, if it has one: its transcript and its files.
async fn session_sandbox(
    server: &McpServer,
    caller: &Caller,
    conversation: &str,
) -> Result<Vec<Resource>, ErrorData> {
    let service = &server.inner.sandboxes;
    let Some(id) = service
        .find_conversation(caller, conversation)
        .await
        .map_err(|e| resource_error("", e))?
    else {
        return Ok(Vec::new());
    };
    let subject = Subject::Sandbox(id.clone());
    let mut out = vec![
        Resource::new(
            transcript_uri(&subject, Format::Notebook),
            "transcript.ipynb",
        )
        .with_title(format!("Transcript of sandbox {id}"))
        .with_mime_type(Format::Notebook.mime_type()),
    ];
    let Ok(resolved) = service.resolve(caller, Some(&id), None, None).await else {
        return Ok(out);
    };
    for (path, size) in service
        .walk_files(&resolved, MAX_LISTED_FILES, MAX_DEPTH)
        .await
    {
        let relative = path.trim_start_matches("/home/user/").to_owned();
        out.push(
            Resource::new(file_uri(&id, &path), relative)
                .with_mime_type(mime_type(&path, &[]))
                .with_size(size),
        );
    }
    Ok(out)
}

/// `resources/read`.
pub async fn read(
    server: &McpServer,
    uri: &str,
    ctx: &RequestContext<RoleServer>,
) -> Result<ReadResourceResult, ErrorData> {
    let claims = authorized(ctx)?;
    let target = parse(uri).ok_or_else(|| {
        resource_not_found(
            uri,
            format!(
                "unknown resource {uri:?}; resources are sandbox://{{sandbox_id}}/files/{{path}}, \
                 sandbox://{{sandbox_id}}/transcript.ipynb|html or \
                 conversation://{{conversation_id}}/transcript.ipynb|html"
            ),
        )
    })?;
    let contents = match target {
        Target::Policy => ResourceContents::text(policy_text(server, &claims).await?, uri)
            .with_mime_type("text/markdown"),
        Target::File { sandbox_id, path } => {
            read_file(server, &claims, uri, &sandbox_id, &path).await?
        }
        Target::Transcript { subject, format } => {
            let transcript = server
                .inner
                .transcripts
                .load(claims.tenant, &subject)
                .await
                .map_err(|err| match err {
                    TranscriptError::NotFound { .. } => resource_not_found(uri, err.to_string()),
                    TranscriptError::Store(_) => ErrorData::internal_error(err.to_string(), None),
                })?;
            ResourceContents::text(format.render(&transcript), uri)
                .with_mime_type(format.mime_type())
        }
    };
    Ok(ReadResourceResult::new(vec![contents])
        .with_ttl_ms(0)
        .with_cache_scope(CacheScope::Private))
}

async fn read_file(
    server: &McpServer,
    claims: &AccessClaims,
    uri: &str,
    sandbox_id: &str,
    path: &str,
) -> Result<ResourceContents, ErrorData> {
    let caller = caller_of(server, claims).await?;
    let service = &server.inner.sandboxes;
    let resolved = service
        .resolve(&caller, Some(sandbox_id), None, None)
        .await
        .map_err(|e| resource_error(uri, e))?;
    let file = resolved
        .sandbox
        .read_file(path, server.inner.limits.max_file_bytes)
        .await;
    let (data, info) = service
        .checked(&resolved, file)
        .await
        .map_err(|e| resource_error(uri, e))?;
    let mime = mime_type(&info.path, &data[..data.len().min(512)]);
    let texty = mime.starts_with("text/") || mime.ends_with("json") || mime.ends_with("xml");
    Ok(match String::from_utf8(data) {
        Ok(text) if texty => ResourceContents::text(text, uri).with_mime_type(mime),
        Ok(text) => {
            ResourceContents::blob(BASE64.encode(text.as_bytes()), uri).with_mime_type(mime)
        }
        Err(err) => ResourceContents::blob(BASE64.encode(err.as_bytes()), uri).with_mime_type(mime),
    })
}

async fn policy_text(server: &McpServer, claims: &AccessClaims) -> Result<String, ErrorData> {
    server
        .inner
        .transcripts
        .policy_markdown(claims.tenant)
        .await
        .map_err(|_| ErrorData::internal_error("temporarily unavailable; retry in a moment", None))
}
