//! The MCP endpoint: rmcp's Streamable HTTP service at `/mcp`, serving both protocol eras
//! (2025-11-25 with sessions, 2026-07-28 stateless), behind bearer-token authentication.
//!
//! - [`tools`]: the seven tools' arguments, outputs and descriptions.
//! - [`auth`]: the bearer-token middleware and the protected-resource metadata (RFC 9728).
//! - [`resources`]: the sandboxes' files and transcripts as MCP resources.
//! - `export`: the `export_transcript` tool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, SecondsFormat, Utc};
use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock,
    Implementation, JsonObject, ListResourceTemplatesResult, ListResourcesResult, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ProgressToken, ReadResourceRequestParams,
    ReadResourceResponse, ResourceContents, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{Peer, RequestContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use sandgate_auth::AccessClaims;
use sandgate_sandbox::{CommandOptions, ExecOptions, OutputEvent};
use sandgate_store::audit::AuditEvent;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::audit::AuditLog;
use crate::config::{Config, LimitsConfig};
use crate::sandboxes::{Caller, Resolved, SandboxService, ServiceError};

pub mod auth;
mod export;
pub mod resources;
pub mod tools;

use tools::*;

/// How often output chunks of a running cell or command are sent as progress notifications.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);
/// Most characters of output one progress notification carries.
const PROGRESS_CHUNK_CHARS: usize = 8192;

/// The MCP server: one instance per legacy session or per stateless request (cheap clones).
#[derive(Debug, Clone)]
pub struct McpServer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    sandboxes: SandboxService,
    audit: AuditLog,
    metrics: crate::metrics::Metrics,
    links: crate::files::DownloadLinks,
    transcripts: crate::transcripts::Transcripts,
    limits: LimitsConfig,
}

/// Builds the Streamable HTTP service for `/mcp`.
pub fn service(
    config: &Config,
    sandboxes: SandboxService,
    audit: AuditLog,
    metrics: crate::metrics::Metrics,
    links: crate::files::DownloadLinks,
    transcripts: crate::transcripts::Transcripts,
    shutdown: CancellationToken,
) -> StreamableHttpService<McpServer, LocalSessionManager> {
    let server = McpServer {
        inner: Arc::new(Inner {
            sandboxes,
            audit,
            metrics,
            links,
            transcripts,
            limits: config.limits.clone(),
        }),
    };
    let public = url::Url::parse(&config.public_url()).expect("validated public URL");
    let host = public.host_str().unwrap_or("localhost").to_owned();
    let host_port = match public.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.clone(),
    };
    let mut origins = vec![public.origin().ascii_serialization()];
    origins.extend(
        config
            .mcp
            .allowed_origins
            .iter()
            .map(|o| o.trim_end_matches('/').to_owned()),
    );
    let http_config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(true)
        .with_sse_keep_alive(Some(Duration::from_secs(
            config.mcp.sse_keep_alive_seconds.max(1),
        )))
        // DNS-rebinding protection: only the public host is accepted, and browsers only from
        // the public origin (plus the configured extra origins).
        .with_allowed_hosts(dedup(vec![host_port, host]))
        .with_allowed_origins(origins)
        .with_max_request_body_bytes(config.mcp.max_request_bytes)
        .with_cancellation_token(shutdown);
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(Duration::from_secs(3600));
    StreamableHttpService::new(move || Ok(server.clone()), Arc::new(sessions), http_config)
}

/// Answers a successful session-ending `DELETE /mcp` with 204 No Content instead of rmcp's 202
/// Accepted. The session is closed by the time rmcp answers, and RFC 9110 §9.3.5 keeps 202 for a
/// deletion that has not been enacted yet; the official Python SDK logs "Session termination
/// failed: 202" on every disconnect otherwise (it accepts 200 and 204).
pub async fn session_deleted_is_no_content(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let is_delete = request.method() == axum::http::Method::DELETE;
    let mut response = next.run(request).await;
    if is_delete && response.status() == axum::http::StatusCode::ACCEPTED {
        *response.status_mut() = axum::http::StatusCode::NO_CONTENT;
    }
    response
}

fn dedup(mut v: Vec<String>) -> Vec<String> {
    v.dedup();
    v
}

/// Why a tool call produced no normal result.
#[derive(Debug)]
enum CallError {
    /// The call itself is malformed: a JSON-RPC invalid-params error.
    InvalidParams(String),
    /// The call was fine but could not be done: a tool result with `isError: true`.
    Service(ServiceError),
    /// The client cancelled it.
    Cancelled,
}

impl From<ServiceError> for CallError {
    fn from(err: ServiceError) -> Self {
        CallError::Service(err)
    }
}

/// A tool's answer plus what the audit trail needs.
struct Answer {
    result: CallToolResult,
    sandbox_id: Option<String>,
}

fn parse_args<T: DeserializeOwned>(args: Option<JsonObject>) -> Result<T, CallError> {
    serde_json::from_value(serde_json::Value::Object(args.unwrap_or_default()))
        .map_err(|e| CallError::InvalidParams(format!("invalid arguments: {e}")))
}

fn claims_of(ctx: &RequestContext<RoleServer>) -> Option<AccessClaims> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<AccessClaims>())
        .cloned()
}

/// The legacy era's MCP session, used as the conversation key when none is given.
fn session_conversation(ctx: &RequestContext<RoleServer>) -> Option<String> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.headers.get("mcp-session-id"))
        .and_then(|v| v.to_str().ok())
        .map(|id| format!("mcp-session:{id}"))
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn structured<T: Serialize>(
    value: &T,
    text: String,
    is_error: bool,
    extra: Vec<ContentBlock>,
) -> CallToolResult {
    let json = serde_json::to_value(value).expect("tool outputs serialize");
    let mut result = CallToolResult::structured(json);
    result.content = std::iter::once(ContentBlock::text(text))
        .chain(extra)
        .collect();
    result.is_error = Some(is_error);
    result
}

impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("sandgate", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "sandgate gives each conversation an isolated Python sandbox. Call create_sandbox \
                 (with a conversation_id) and pass the returned sandbox_id to execute_code, \
                 run_terminal_command, upload_file, get_file and list_files. Files live in \
                 /home/user. Close the sandbox with close_sandbox when the conversation ends. \
                 To hand the conversation to a person, call export_transcript. A sandbox's \
                 files and transcript are also resources (sandbox://{sandbox_id}/files/{path}, \
                 sandbox://{sandbox_id}/transcript.ipynb).",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let claims = claims_of(&ctx);
        let tools: Vec<Tool> = ToolName::ALL
            .into_iter()
            .filter(|t| claims.as_ref().is_some_and(|c| c.has_scope(t.scope())))
            .map(|t| t.definition().clone())
            .collect();
        // The list depends on the caller's scopes: never cacheable across callers.
        Ok(ListToolsResult::with_all_items(tools).with_cache_scope(CacheScope::Private))
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        resources::list(self, request, &ctx).await
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(resources::templates())
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        resources::read(self, &request.uri, &ctx)
            .await
            .map(Into::into)
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        ToolName::parse(name).map(|t| t.definition().clone())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let claims =
            claims_of(&ctx).ok_or_else(|| ErrorData::invalid_request("not authenticated", None))?;
        let tool = ToolName::parse(&request.name)
            .filter(|t| claims.has_scope(t.scope()))
            .ok_or_else(|| {
                ErrorData::invalid_params(format!("unknown tool: {}", request.name), None)
            })?;
        let started = Instant::now();
        let conversation_arg = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("conversation_id"))
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        let conversation = conversation_arg.or_else(|| session_conversation(&ctx));
        let span = tracing::info_span!("tool", tool = tool.as_str(), tenant_id = %claims.tenant, sandbox_id = tracing::field::Empty);
        let unverified = ctx
            .extensions
            .get::<axum::http::request::Parts>()
            .is_some_and(|parts| parts.extensions.get::<auth::GrantUnverified>().is_some());
        let outcome = async {
            if unverified {
                return Err(CallError::Service(ServiceError::DatabaseAway));
            }
            let service = &self.inner.sandboxes;
            let caller = Caller {
                tenant: claims.tenant,
                subject: claims.sub.clone(),
                token_id: claims.jti.clone(),
                grant: claims.grant,
                limits: service.limits(claims.tenant).await?,
            };
            service.check_rate(&caller).await?;
            self.dispatch(
                tool,
                request.arguments,
                &caller,
                conversation.as_deref(),
                &ctx,
            )
            .await
        }
        .instrument(span)
        .await;
        let elapsed = started.elapsed();
        let (response, sandbox_id, audit_outcome, error_kind) = match outcome {
            Ok(answer) => {
                let failed = answer.result.is_error == Some(true);
                let outcome = if failed { "user_error" } else { "ok" };
                (Ok(answer.result.into()), answer.sandbox_id, outcome, None)
            }
            Err(CallError::InvalidParams(message)) => (
                Err(ErrorData::invalid_params(message, None)),
                None,
                "refused",
                Some("invalid_params".to_owned()),
            ),
            Err(CallError::Cancelled) => (
                Err(ErrorData::internal_error("the call was cancelled", None)),
                None,
                "cancelled",
                Some("cancelled".to_owned()),
            ),
            Err(CallError::Service(err)) => {
                let (kind, outcome) = error_kind_of(&err);
                if outcome == "failed" {
                    tracing::error!(error = ?err, tool = tool.as_str(), "tool call failed");
                }
                let result = CallToolResult::error(vec![ContentBlock::text(public_message(&err))]);
                (
                    Ok(result.into()),
                    sandbox_of(&err),
                    outcome,
                    Some(kind.to_owned()),
                )
            }
        };
        self.inner
            .metrics
            .record_call(tool.as_str(), audit_outcome, elapsed);
        let event = AuditEvent {
            at: Utc::now(),
            tenant_id: claims.tenant,
            token_id: Some(claims.jti.clone()),
            subject: Some(claims.sub.clone()),
            conversation_id: conversation,
            sandbox_id,
            tool: tool.as_str().to_owned(),
            outcome: audit_outcome.to_owned(),
            error_kind,
            duration_ms: i32::try_from(elapsed.as_millis()).unwrap_or(i32::MAX),
        };
        let db_down = event.error_kind.as_deref() == Some("unavailable");
        self.inner.audit.record(event, db_down).await;
        response
    }
}

/// The text the model sees for a failed call: specific, with what to do next; never internals.
fn public_message(err: &ServiceError) -> String {
    match err {
        ServiceError::Store(_) => {
            "sandgate hit an internal error; retry the call, and if it persists, tell the user"
                .into()
        }
        ServiceError::Sandbox(inner) => match inner {
            sandgate_sandbox::SandboxError::Channel(ch) => ch.to_string(),
            sandgate_sandbox::SandboxError::Died { .. } => inner.to_string(),
            sandgate_sandbox::SandboxError::Launch(_)
            | sandgate_sandbox::SandboxError::AgentStart { .. } => {
                "starting a sandbox failed; retry in a few seconds".into()
            }
            _ => "the sandbox could not do that; retry, or call create_sandbox for a fresh one"
                .into(),
        },
        other => other.to_string(),
    }
}

fn error_kind_of(err: &ServiceError) -> (&'static str, &'static str) {
    match err {
        ServiceError::NotFound(_) => ("not_found", "refused"),
        ServiceError::Ended(_) => ("ended", "refused"),
        ServiceError::Lost { .. } => ("lost", "refused"),
        ServiceError::Limit { .. } => ("limit", "refused"),
        ServiceError::RateLimited { .. } => ("rate_limited", "refused"),
        ServiceError::Unavailable(_) | ServiceError::DatabaseAway => ("unavailable", "failed"),
        ServiceError::Store(_) => ("internal", "failed"),
        ServiceError::Sandbox(sandgate_sandbox::SandboxError::Channel(
            sandgate_sandbox::ChannelError::Agent(_),
        )) => ("sandbox_refused", "refused"),
        ServiceError::Sandbox(_) => ("sandbox", "failed"),
    }
}

fn sandbox_of(err: &ServiceError) -> Option<String> {
    match err {
        ServiceError::NotFound(id) => Some(id.clone()),
        ServiceError::Lost { sandbox_id, .. } => Some(sandbox_id.clone()),
        _ => None,
    }
}

impl McpServer {
    fn call_timeout(&self, asked: Option<u32>) -> Result<Duration, CallError> {
        let limits = &self.inner.limits;
        match asked {
            None => Ok(Duration::from_secs(
                limits.default_call_timeout_seconds.into(),
            )),
            Some(0) => Err(CallError::InvalidParams(
                "timeout_seconds must be at least 1".into(),
            )),
            Some(s) if s > limits.max_call_timeout_seconds => {
                Err(CallError::InvalidParams(format!(
                    "timeout_seconds {s} exceeds the maximum of {}",
                    limits.max_call_timeout_seconds
                )))
            }
            Some(s) => Ok(Duration::from_secs(s.into())),
        }
    }

    async fn dispatch(
        &self,
        tool: ToolName,
        args: Option<JsonObject>,
        caller: &Caller,
        conversation: Option<&str>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let service = &self.inner.sandboxes;
        match tool {
            ToolName::CreateSandbox => {
                let args: CreateSandboxArgs = parse_args(args)?;
                let resolved = service
                    .create(caller, conversation, args.keep_alive_seconds)
                    .await?;
                let row = &resolved.row;
                let out = CreateSandboxOutput {
                    sandbox_id: row.id.clone(),
                    created: resolved.created,
                    conversation_id: row.conversation_id.clone(),
                    expires_at: row.expires_at.map(rfc3339).unwrap_or_default(),
                    idle_timeout_seconds: row.idle_timeout_seconds.unwrap_or_default().max(0)
                        as u32,
                };
                let text = format!(
                    "{} sandbox {} (idle timeout {} s, expires {}). Pass sandbox_id \"{}\" to the other tools.",
                    if out.created {
                        "Created"
                    } else {
                        "Reusing the conversation's"
                    },
                    out.sandbox_id,
                    out.idle_timeout_seconds,
                    out.expires_at,
                    out.sandbox_id
                );
                Ok(Answer {
                    sandbox_id: Some(out.sandbox_id.clone()),
                    result: structured(&out, text, false, vec![]),
                })
            }
            ToolName::ExecuteCode => {
                let args: ExecuteCodeArgs = parse_args(args)?;
                let timeout = self.call_timeout(args.timeout_seconds)?;
                let resolved = service
                    .resolve(
                        caller,
                        args.sandbox_id.as_deref(),
                        conversation,
                        args.keep_alive_seconds,
                    )
                    .await?;
                self.execute_code(&resolved, &args.code, timeout, ctx).await
            }
            ToolName::RunTerminalCommand => {
                let args: RunTerminalCommandArgs = parse_args(args)?;
                let timeout = self.call_timeout(args.timeout_seconds)?;
                let resolved = service
                    .resolve(
                        caller,
                        args.sandbox_id.as_deref(),
                        conversation,
                        args.keep_alive_seconds,
                    )
                    .await?;
                self.run_command(&resolved, &args.command, args.cwd, timeout, ctx)
                    .await
            }
            ToolName::UploadFile => {
                let args: UploadFileArgs = parse_args(args)?;
                let data = match (args.content_base64, args.content_text) {
                    (Some(b64), None) => BASE64.decode(b64.trim()).map_err(|e| {
                        CallError::InvalidParams(format!("content_base64 is not valid base64: {e}"))
                    })?,
                    (None, Some(text)) => text.into_bytes(),
                    _ => {
                        return Err(CallError::InvalidParams(
                            "give exactly one of content_base64 and content_text".into(),
                        ));
                    }
                };
                if data.len() as u64 > self.inner.limits.max_file_bytes {
                    return Err(ServiceError::Limit {
                        limit: "max file size",
                        value: format!(
                            "{} bytes; this file has {}",
                            self.inner.limits.max_file_bytes,
                            data.len()
                        ),
                        hint: "upload a smaller file (e.g. compress it or split it)",
                    }
                    .into());
                }
                let resolved = service
                    .resolve(
                        caller,
                        args.sandbox_id.as_deref(),
                        conversation,
                        args.keep_alive_seconds,
                    )
                    .await?;
                let info = resolved
                    .sandbox
                    .write_file(&args.path, &data, args.overwrite.unwrap_or(false))
                    .await;
                let info = service.checked(&resolved, info).await?;
                let entry = crate::transcripts::file_entry(&info, false);
                self.inner.transcripts.record(&resolved.row, &entry).await;
                let out = UploadFileOutput {
                    sandbox_id: resolved.row.id.clone(),
                    path: info.path,
                    size: info.size,
                    sha256: info.sha256,
                };
                let text = format!(
                    "Wrote {} ({} bytes, sha256 {}) in sandbox {}.",
                    out.path, out.size, out.sha256, out.sandbox_id
                );
                Ok(Answer {
                    sandbox_id: Some(out.sandbox_id.clone()),
                    result: structured(&out, text, false, vec![]),
                })
            }
            ToolName::GetFile => {
                let args: GetFileArgs = parse_args(args)?;
                let resolved = service
                    .resolve(
                        caller,
                        args.sandbox_id.as_deref(),
                        conversation,
                        args.keep_alive_seconds,
                    )
                    .await?;
                let file = resolved
                    .sandbox
                    .read_file(&args.path, self.inner.limits.max_file_bytes)
                    .await;
                let (data, info) = service.checked(&resolved, file).await?;
                let entry = crate::transcripts::file_entry(&info, true);
                self.inner.transcripts.record(&resolved.row, &entry).await;
                let mime = mime_type(&info.path, &data[..data.len().min(512)]);
                let (download_url, expires) = self.inner.links.mint(
                    caller.tenant,
                    caller.grant,
                    &resolved.row.id,
                    &info.path,
                );
                let out = GetFileOutput {
                    sandbox_id: resolved.row.id.clone(),
                    path: info.path.clone(),
                    size: info.size,
                    mime_type: mime.clone(),
                    sha256: info.sha256,
                    download_url,
                    download_expires_at: rfc3339(expires),
                };
                let summary = format!(
                    "{} ({} bytes, {}) from sandbox {}. Download link for a person (valid until {}): {}",
                    out.path,
                    out.size,
                    out.mime_type,
                    out.sandbox_id,
                    out.download_expires_at,
                    out.download_url
                );
                let summary = if info.size > self.inner.limits.inline_file_bytes {
                    format!(
                        "{summary}\nThe file is over {} bytes, so it is not inlined: read the \
                         resource link with resources/read, or give the person the download link.",
                        self.inner.limits.inline_file_bytes
                    )
                } else {
                    summary
                };
                let content = if info.size > self.inner.limits.inline_file_bytes {
                    resources::file_link(&out.sandbox_id, &info.path, &mime, info.size)
                } else if mime.starts_with("image/") && mime != "image/svg+xml" {
                    ContentBlock::image(BASE64.encode(&data), mime)
                } else if let Ok(text) = std::str::from_utf8(&data) {
                    ContentBlock::text(text.to_owned())
                } else {
                    ContentBlock::resource(
                        ResourceContents::blob(
                            BASE64.encode(&data),
                            format!("sandbox://{}{}", out.sandbox_id, info.path),
                        )
                        .with_mime_type(mime),
                    )
                };
                Ok(Answer {
                    sandbox_id: Some(out.sandbox_id.clone()),
                    result: structured(&out, summary, false, vec![content]),
                })
            }
            ToolName::ListFiles => {
                let args: ListFilesArgs = parse_args(args)?;
                let resolved = service
                    .resolve(
                        caller,
                        args.sandbox_id.as_deref(),
                        conversation,
                        args.keep_alive_seconds,
                    )
                    .await?;
                let path = args.path.unwrap_or_else(|| ".".into());
                let listing = resolved.sandbox.list_dir(&path).await;
                let entries = service.checked(&resolved, listing).await?;
                let out = ListFilesOutput {
                    sandbox_id: resolved.row.id.clone(),
                    path: absolute(&path),
                    entries: entries
                        .into_iter()
                        .map(|e| FileEntry {
                            name: e.name,
                            kind: format!("{:?}", e.kind).to_lowercase(),
                            size: e.size,
                            modified: DateTime::from_timestamp(e.modified as i64, 0)
                                .map(rfc3339)
                                .unwrap_or_default(),
                        })
                        .collect(),
                };
                let mut text = format!("{} in sandbox {}:\n", out.path, out.sandbox_id);
                for e in &out.entries {
                    text.push_str(&format!(
                        "{:<7} {:>10}  {}  {}\n",
                        e.kind, e.size, e.modified, e.name
                    ));
                }
                if out.entries.is_empty() {
                    text.push_str("(empty)\n");
                }
                Ok(Answer {
                    sandbox_id: Some(out.sandbox_id.clone()),
                    result: structured(&out, text, false, vec![]),
                })
            }
            ToolName::ExportTranscript => {
                self.export_transcript(parse_args(args)?, caller, conversation)
                    .await
            }
            ToolName::CloseSandbox => {
                let args: CloseSandboxArgs = parse_args(args)?;
                let id = match (args.sandbox_id, conversation) {
                    (Some(id), _) => id,
                    (None, Some(conversation)) => {
                        service.conversation_sandbox(caller, conversation).await?
                    }
                    (None, None) => {
                        return Err(CallError::InvalidParams(
                            "give the sandbox_id to close".into(),
                        ));
                    }
                };
                let row = service.close(caller, &id).await?;
                let out = CloseSandboxOutput {
                    sandbox_id: row.id.clone(),
                    closed: true,
                };
                let text = format!(
                    "Closed sandbox {}; its files and variables are gone.",
                    out.sandbox_id
                );
                Ok(Answer {
                    sandbox_id: Some(out.sandbox_id.clone()),
                    result: structured(&out, text, false, vec![]),
                })
            }
        }
    }

    /// Runs a cell or command: its output streams as progress when the client asked for it, a
    /// cancelled request stops it (dropping the call interrupts the cell or kills the command),
    /// and a sandbox that died underneath is recorded and explained.
    async fn run_streaming<T, Fut>(
        &self,
        resolved: &Resolved,
        ctx: &RequestContext<RoleServer>,
        start: impl FnOnce(Option<mpsc::Sender<OutputEvent>>) -> Fut,
    ) -> Result<T, CallError>
    where
        Fut: Future<Output = Result<T, sandgate_sandbox::SandboxError>>,
    {
        let (events, progress) = progress_forwarder(ctx);
        let outcome = tokio::select! {
            outcome = start(events) => outcome,
            () = ctx.ct.cancelled() => return Err(CallError::Cancelled),
        };
        // All output notifications go out before the result.
        if let Some(progress) = progress {
            let _ = progress.await;
        }
        Ok(self.inner.sandboxes.checked(resolved, outcome).await?)
    }

    async fn execute_code(
        &self,
        resolved: &Resolved,
        code: &str,
        timeout: Duration,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let options = ExecOptions {
            timeout,
            output_limit: self.inner.limits.output_limit_bytes,
            ..ExecOptions::default()
        };
        let outcome = self
            .run_streaming(resolved, ctx, |events| {
                resolved.sandbox.exec(code, options, events)
            })
            .await?;
        let entry = crate::transcripts::cell_entry(code, &outcome);
        self.inner.transcripts.record(&resolved.row, &entry).await;
        let sandbox_id = resolved.row.id.clone();
        let mut images = Vec::new();
        let mut blocks = Vec::new();
        for display in &outcome.displays {
            if let Some(png) = &display.png {
                images.push(ImageOutput {
                    path: display.path.clone(),
                    mime_type: "image/png".into(),
                    size: png.len() as u64,
                });
                blocks.push(ContentBlock::image(BASE64.encode(png), "image/png"));
            }
        }
        let out = ExecuteCodeOutput {
            sandbox_id: sandbox_id.clone(),
            stdout: outcome.stdout,
            stderr: outcome.stderr,
            result: outcome.result.map(|bundle| CellResult {
                text_plain: bundle.get("text/plain").cloned(),
                text_html: bundle.get("text/html").cloned(),
            }),
            error: outcome.error.map(|e| CellErrorOutput {
                name: e.name,
                value: e.value,
                traceback: e.traceback,
            }),
            execution_count: outcome.execution_count,
            images,
            truncated: outcome.truncated,
            timed_out: outcome.timed_out,
            state_lost: outcome.state_lost,
            duration_ms: outcome.duration.as_millis() as u64,
        };
        let is_error = out.error.is_some() || out.timed_out;
        let text = render_cell(&out, timeout);
        Ok(Answer {
            sandbox_id: Some(sandbox_id),
            result: structured(&out, text, is_error, blocks),
        })
    }

    async fn run_command(
        &self,
        resolved: &Resolved,
        command: &str,
        cwd: Option<String>,
        timeout: Duration,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Answer, CallError> {
        let options = CommandOptions {
            timeout,
            output_limit: self.inner.limits.output_limit_bytes,
            cwd: cwd.clone(),
        };
        let outcome = self
            .run_streaming(resolved, ctx, |events| {
                resolved.sandbox.command(command, options, events)
            })
            .await?;
        let entry = crate::transcripts::command_entry(command, cwd.as_deref(), &outcome);
        self.inner.transcripts.record(&resolved.row, &entry).await;
        let out = RunTerminalCommandOutput {
            sandbox_id: resolved.row.id.clone(),
            stdout: outcome.stdout,
            stderr: outcome.stderr,
            exit_code: outcome.exit_code,
            signal: outcome.signal,
            timed_out: outcome.timed_out,
            truncated: outcome.truncated,
            duration_ms: outcome.duration.as_millis() as u64,
        };
        let is_error = out.timed_out || out.exit_code != Some(0);
        let mut text = render_streams(&out.stdout, &out.stderr);
        if out.timed_out {
            text.push_str(&format!(
                "[timed out after {} s; the command and its children were killed]\n",
                timeout.as_secs()
            ));
        }
        match (out.exit_code, out.signal) {
            (Some(code), _) => text.push_str(&format!("[exit code {code}]")),
            (None, Some(sig)) => text.push_str(&format!("[killed by signal {sig}]")),
            (None, None) => text.push_str("[no exit code]"),
        }
        Ok(Answer {
            sandbox_id: Some(out.sandbox_id.clone()),
            result: structured(&out, text, is_error, vec![]),
        })
    }
}

impl SandboxService {
    /// The live sandbox of a tenant's conversation, by id; `NotFound` when it has none.
    pub async fn conversation_sandbox(
        &self,
        caller: &Caller,
        conversation: &str,
    ) -> Result<String, ServiceError> {
        self.find_conversation(caller, conversation)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("for conversation {conversation:?}")))
    }
}

fn absolute(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    if trimmed.is_empty() || trimmed == "." {
        "/home/user".into()
    } else if trimmed.starts_with('/') {
        trimmed.into()
    } else {
        format!("/home/user/{}", trimmed.trim_start_matches("./"))
    }
}

/// stdout as it was printed, then stderr under a marker, each ending in a newline.
fn render_streams(stdout: &str, stderr: &str) -> String {
    let mut text = String::new();
    for (marker, stream) in [("", stdout), ("[stderr]\n", stderr)] {
        if !stream.is_empty() {
            text.push_str(marker);
            text.push_str(stream);
            if !stream.ends_with('\n') {
                text.push('\n');
            }
        }
    }
    text
}

/// A notebook-like rendering of a cell's outcome for the text block.
fn render_cell(out: &ExecuteCodeOutput, timeout: Duration) -> String {
    let mut text = render_streams(&out.stdout, &out.stderr);
    if let Some(plain) = out.result.as_ref().and_then(|r| r.text_plain.as_ref()) {
        match out.execution_count {
            Some(n) => text.push_str(&format!("Out[{n}]: {plain}\n")),
            None => text.push_str(&format!("Out: {plain}\n")),
        }
    }
    for image in &out.images {
        match &image.path {
            Some(path) => text.push_str(&format!("[chart: {path}]\n")),
            None => text.push_str("[chart]\n"),
        }
    }
    if let Some(error) = &out.error {
        let summary = format!("{}: {}", error.name, error.value);
        let traceback = error.traceback.join("\n");
        text.push_str(&traceback);
        if !traceback.is_empty() {
            text.push('\n');
        }
        // IPython's traceback already ends with "Name: value"; the plain kernel's may not.
        if !traceback.trim_end().ends_with(summary.trim_end()) {
            text.push_str(&summary);
            text.push('\n');
        }
    }
    if out.timed_out {
        text.push_str(&format!(
            "[interrupted after the {} s timeout]\n",
            timeout.as_secs()
        ));
    }
    if out.state_lost {
        text.push_str("[the cell did not stop, so the Python kernel was restarted: variables are gone, files in /home/user are kept]\n");
    }
    if out.truncated {
        text.push_str("[output truncated]\n");
    }
    if text.is_empty() {
        text.push_str("(no output)\n");
    }
    text.push_str(&format!("[sandbox {}]", out.sandbox_id));
    text
}

/// When the client sent a progress token, a sender for output events and the task that turns
/// them into rate-limited `notifications/progress` (ended when the sender is dropped).
fn progress_forwarder(
    ctx: &RequestContext<RoleServer>,
) -> (
    Option<mpsc::Sender<OutputEvent>>,
    Option<tokio::task::JoinHandle<()>>,
) {
    let Some(token) = ctx.meta.get_progress_token() else {
        return (None, None);
    };
    let (tx, rx) = mpsc::channel(256);
    let peer = ctx.peer.clone();
    let task = tokio::spawn(forward_progress(rx, peer, token));
    (Some(tx), Some(task))
}

async fn forward_progress(
    mut rx: mpsc::Receiver<OutputEvent>,
    peer: Peer<RoleServer>,
    token: ProgressToken,
) {
    let mut pending = String::new();
    let mut step = 0u64;
    let mut ticker = tokio::time::interval(PROGRESS_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(OutputEvent::Stdout(s)) => pending.push_str(&s),
                Some(OutputEvent::Stderr(s)) => pending.push_str(&s),
                Some(OutputEvent::Display(d)) => {
                    pending.push_str(&format!("[chart{}]\n", d.path.map(|p| format!(": {p}")).unwrap_or_default()));
                }
                None => break,
            },
            _ = ticker.tick() => {
                if !pending.is_empty() {
                    step += 1;
                    send_progress(&peer, &token, step, std::mem::take(&mut pending)).await;
                }
            }
        }
    }
    if !pending.is_empty() {
        step += 1;
        send_progress(&peer, &token, step, pending).await;
    }
}

async fn send_progress(
    peer: &Peer<RoleServer>,
    token: &ProgressToken,
    step: u64,
    mut message: String,
) {
    if message.len() > PROGRESS_CHUNK_CHARS {
        let mut cut = PROGRESS_CHUNK_CHARS;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    let param = ProgressNotificationParam::new(token.clone(), step as f64).with_message(message);
    if let Err(err) = peer.notify_progress(param).await {
        tracing::debug!(error = %err, "sending a progress notification failed");
    }
}
