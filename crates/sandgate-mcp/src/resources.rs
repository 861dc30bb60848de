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

use std::time::Instant;

use chrono::Utc;
use sandgate_service::audit::{AuditEvent, ErrorKind as AuditKind, Outcome};
use sandgate_service::{BoundedRead, ErrorKind};

use super::errors::{ResourceFailure, quota_limit};
use super::render::{mime_type, rfc3339};
use super::{McpServer, claims_of, session_conversation};
pub use crate::resource_uri::{POLICY_URI, file_uri, transcript_uri};
use crate::resource_uri::{Target, file_name, parse};
use crate::sandboxes::{Caller, ServiceError};
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

async fn caller_of(server: &McpServer, claims: &AccessClaims) -> Result<Caller, ServiceError> {
    let service = &server.inner.sandboxes;
    Ok(Caller {
        tenant: claims.tenant,
        subject: claims.sub.clone(),
        token_id: claims.jti.clone(),
        grant: claims.grant,
        limits: service.limits(claims.tenant).await?,
        read_at_admission: None,
        person: None,
    })
}

/// What a resource request is, for its admission and its audit record.
struct Request<'a> {
    /// `resources/list` or `resources/read` (the audit trail's `tool`).
    op: &'static str,
    /// The URI read (`""` for a list).
    uri: &'a str,
    /// The sandbox it names, read in the admission's statement.
    sandbox_id: Option<String>,
    /// The conversation it names or the session stands for.
    conversation: Option<String>,
}

/// Runs a resource request exactly like a tool call: refused retryably when the token's grant
/// could not be verified, admitted under the tenant's calls per minute and in flight (the same
/// refusal, with the same fields, as a tool call's), counted, and audited whatever its end.
async fn admitted<T>(
    server: &McpServer,
    ctx: &RequestContext<RoleServer>,
    request: Request<'_>,
    body: impl AsyncFnOnce(&Caller) -> Result<T, ResourceFailure>,
) -> Result<T, ErrorData> {
    let claims = authorized(ctx)?;
    let started = Instant::now();
    let uri = request.uri;
    let outcome = async {
        if super::grant_unverified(ctx) {
            return Err(ResourceFailure::service(uri, ServiceError::DatabaseAway));
        }
        let fail = |e| ResourceFailure::service(uri, e);
        let mut caller = caller_of(server, &claims).await.map_err(fail)?;
        let service = &server.inner.sandboxes;
        let permit = match &request.sandbox_id {
            Some(id) => service.admit_naming(&mut caller, id).await,
            None => service.admit(&caller).await,
        }
        .map_err(fail)?;
        let answer = body(&caller).await;
        permit.release();
        answer
    }
    .await;
    let elapsed = started.elapsed();
    let (outcome, kind, answer) = match outcome {
        Ok(value) => (Outcome::Ok, None, Ok(value)),
        Err(failure) => (failure.outcome, failure.kind, Err(failure.error)),
    };
    if let Some(limit) = kind.and_then(quota_limit) {
        server.inner.metrics.record_quota_refusal(limit);
    }
    server.inner.audit.record(AuditEvent {
        at: Utc::now(),
        tenant_id: claims.tenant,
        token_id: Some(claims.jti.clone()),
        subject: Some(claims.sub.clone()),
        conversation_id: request.conversation,
        sandbox_id: request.sandbox_id,
        tool: request.op.to_owned(),
        outcome,
        error_kind: kind,
        duration_ms: i32::try_from(elapsed.as_millis()).unwrap_or(i32::MAX),
    });
    answer
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
    let conversation = session_conversation(ctx);
    let audited = Request {
        op: "resources/list",
        uri: "",
        sandbox_id: None,
        conversation: conversation.clone(),
    };
    admitted(server, ctx, audited, async |caller| {
        let offset = match request.and_then(|r| r.cursor) {
            None => 0,
            Some(cursor) => cursor.parse::<usize>().map_err(|_| {
                ResourceFailure::invalid(ErrorData::invalid_params(
                    "invalid cursor; pass the nextCursor of the previous page",
                    None,
                ))
            })?,
        };
        let mut all = vec![policy_resource()];
        if let Some(conversation) = &conversation {
            all.extend(session_sandbox(server, caller, conversation).await?);
        }
        let page: Vec<Resource> = all.iter().skip(offset).take(PAGE_SIZE).cloned().collect();
        let mut result = ListResourcesResult::with_all_items(page);
        if offset + PAGE_SIZE < all.len() {
            result.next_cursor = Some((offset + PAGE_SIZE).to_string());
        }
        Ok(result.with_ttl_ms(0).with_cache_scope(CacheScope::Private))
    })
    .await
}

/// The session's live sandbox, if it has one: its transcript and its files.
async fn session_sandbox(
    server: &McpServer,
    caller: &Caller,
    conversation: &str,
) -> Result<Vec<Resource>, ResourceFailure> {
    let service = &server.inner.sandboxes;
    let Some(id) = service
        .find_conversation(caller, conversation)
        .await
        .map_err(|e| ResourceFailure::service("", e))?
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
    let target = parse(uri);
    let (sandbox_id, conversation) = match &target {
        Some(Target::File { sandbox_id, .. }) => (Some(sandbox_id.clone()), None),
        Some(Target::Transcript { subject, .. }) => match subject {
            Subject::Sandbox(id) => (Some(id.clone()), None),
            Subject::Conversation(c) => (None, Some(c.clone())),
        },
        Some(Target::Policy) | None => (None, None),
    };
    let audited = Request {
        op: "resources/read",
        uri,
        // A transcript outlives its sandbox: only a file read needs the live sandbox's row.
        sandbox_id: sandbox_id.clone(),
        conversation,
    };
    admitted(server, ctx, audited, async |caller| {
        let target = target.ok_or_else(|| {
            ResourceFailure::not_found(
                uri,
                format!(
                    "unknown resource {uri:?}; resources are sandbox://{{sandbox_id}}/files/{{path}}, \
                     sandbox://{{sandbox_id}}/transcript.ipynb|html or \
                     conversation://{{conversation_id}}/transcript.ipynb|html"
                ),
            )
        })?;
        let contents = match target {
            Target::Policy => ResourceContents::text(policy_text(server, caller).await?, uri)
                .with_mime_type("text/markdown"),
            Target::File { sandbox_id, path } => {
                read_file(server, caller, uri, &sandbox_id, &path).await?
            }
            Target::Transcript { subject, format } => {
                let rendered = server
                    .inner
                    .transcripts
                    .render(caller.tenant, &subject, format)
                    .await
                    .map_err(|err| match err {
                        TranscriptError::NotFound { .. } => {
                            ResourceFailure::not_found(uri, err.to_string())
                        }
                        other => ResourceFailure::service(uri, other.into()),
                    })?;
                ResourceContents::text(rendered, uri).with_mime_type(format.mime_type())
            }
        };
        Ok(ReadResourceResult::new(vec![contents])
            .with_ttl_ms(0)
            .with_cache_scope(CacheScope::Private))
    })
    .await
}

/// A file of a live sandbox, inline up to `limits.inline_resource_bytes`; a bigger one is a
/// refusal of kind `limit` that carries its download link (streamed, never held whole here).
async fn read_file(
    server: &McpServer,
    caller: &Caller,
    uri: &str,
    sandbox_id: &str,
    path: &str,
) -> Result<ResourceContents, ResourceFailure> {
    let service = &server.inner.sandboxes;
    let fail = |e| ResourceFailure::service(uri, e);
    let resolved = service
        .resolve(caller, Some(sandbox_id), None, None)
        .await
        .map_err(fail)?;
    let limits = &server.inner.limits;
    let inline_max = limits.inline_resource_bytes.min(limits.max_file_bytes);
    let (data, info) = match service
        .read_file_bounded(&resolved, path, inline_max)
        .await
        .map_err(fail)?
    {
        BoundedRead::Read(data, info) => (data, info),
        BoundedRead::TooLarge { size } => {
            let link = Oversized {
                sandbox_id,
                path,
                size,
                inline_max,
            };
            return Err(link.refusal(server, caller, uri));
        }
    };
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

/// A file over the inline bound of `resources/read`.
struct Oversized<'a> {
    sandbox_id: &'a str,
    path: &'a str,
    size: Option<u64>,
    inline_max: u64,
}

impl Oversized<'_> {
    /// The refusal: the file's download link instead of its bytes.
    fn refusal(&self, server: &McpServer, caller: &Caller, uri: &str) -> ResourceFailure {
        let absolute = if self.path.starts_with('/') {
            self.path.to_owned()
        } else {
            format!("/home/user/{}", self.path)
        };
        let (download_url, expires) = server.inner.links.mint(caller, self.sandbox_id, &absolute);
        let expires = rfc3339(expires);
        let size = self
            .size
            .map_or_else(|| "larger".to_owned(), |s| format!("{s} bytes"));
        let message = format!(
            "{absolute} is {size}, more than the {} bytes resources/read returns inline; \
             download it with this link (valid until {expires}): {download_url}",
            self.inline_max
        );
        let data = serde_json::json!({
            "error": ErrorKind::Limit.as_str(),
            "retryable": false,
            "uri": uri,
            "size": self.size,
            "inline_resource_bytes": self.inline_max,
            "download_url": download_url,
            "download_expires_at": expires,
        });
        ResourceFailure {
            error: ErrorData::invalid_request(message, Some(data)),
            outcome: Outcome::Refused,
            kind: Some(AuditKind::Limit),
        }
    }
}

async fn policy_text(server: &McpServer, caller: &Caller) -> Result<String, ResourceFailure> {
    server
        .inner
        .transcripts
        .policy_markdown(caller.tenant)
        .await
        .map_err(|e| ResourceFailure::service(POLICY_URI, ServiceError::Store(e)))
}
