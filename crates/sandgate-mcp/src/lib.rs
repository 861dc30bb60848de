//! The MCP endpoint: rmcp's Streamable HTTP service at `/mcp`, serving both protocol eras
//! (2025-11-25 with sessions, 2026-07-28 stateless), behind bearer-token authentication.
//!
//! - [`routes`]: `/mcp` behind its bearer guard, and the protected-resource metadata.
//! - [`AppState`]: what the endpoint needs from the gateway's state.
//! - [`tools`]: the tools' names, scopes, descriptions and declared schemas.
//! - [`schema`]: the tools' arguments and structured outputs, and the error shape.
//! - `answer`: a call's answer, or why there is none (what `errors` maps).
//! - [`auth`]: the bearer-token middleware and the protected-resource metadata (RFC 9728).
//! - `calls`: what each tool does, as MCP (arguments in, service call, answer out).
//! - `errors`: the one mapping from a failed call to its answer, audit record and metric.
//! - `render`: the text blocks beside the structured content, MIME types.
//! - `progress`: output of running cells and commands as progress notifications.
//! - [`resources`]: the sandboxes' files and transcripts as MCP resources.
//! - `export`: the `export_transcript` tool.
//! - [`limits`]: length limits on attacker-chosen strings in tool arguments.
//! - [`refusal`]: HTTP refusals of `/mcp` requests (RFC 6750 bodies and challenges).
//! - [`metrics`]: tool calls by tool and outcome, and their durations.
//! - [`sessions`]: MCP sessions bound to their principal (the middleware in front of rmcp).
//! - [`session_store`]: MCP sessions any replica can take over (rmcp's session store on Postgres).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, Implementation,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
pub use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use sandgate_auth::AccessClaims;
use sandgate_service::audit::AuditEvent;
use sandgate_service::sessions::SessionHash;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::audit::AuditLog;
use crate::config::{Config, LimitsConfig};
use crate::sandboxes::{Caller, SandboxService, ServiceError};
// The service layer's modules under `crate::`, as the endpoint's modules name them.
use sandgate_service::{audit, config, resource_uri, sandboxes, transcripts};

pub use crate::state::AppState;

mod answer;
pub mod auth;
mod calls;
mod errors;
mod export;
pub mod limits;
pub mod metrics;
mod packages;
mod progress;
pub mod refusal;
mod render;
pub mod resources;
pub mod routes;
pub mod schema;
pub mod session_store;
pub mod sessions;
mod state;
pub mod tools;

use answer::CallError;

use tools::*;

/// The MCP server: one instance per legacy session or per stateless request (cheap clones).
#[derive(Debug, Clone)]
pub struct McpServer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    sandboxes: SandboxService,
    audit: AuditLog,
    metrics: crate::metrics::ToolMetrics,
    links: sandgate_service::links::DownloadLinks,
    transcripts: crate::transcripts::Transcripts,
    limits: LimitsConfig,
}

/// Builds the Streamable HTTP service for `/mcp`.
#[allow(clippy::too_many_arguments)] // each is one part of `AppState` the MCP server uses
pub fn service(
    config: &Config,
    sandboxes: SandboxService,
    audit: AuditLog,
    metrics: crate::metrics::ToolMetrics,
    links: sandgate_service::links::DownloadLinks,
    transcripts: crate::transcripts::Transcripts,
    sessions: Arc<LocalSessionManager>,
    bindings: sandgate_service::sessions::SessionBindings,
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
    let mut http_config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(true)
        .with_sse_keep_alive(Some(Duration::from_secs(
            config.mcp.sse_keep_alive_seconds.max(1),
        )))
        // DNS-rebinding protection: only the public host is accepted, and browsers only from
        // the public origin (plus the configured extra origins).
        .with_allowed_hosts(dedup(vec![host_port, host]))
        .with_allowed_origins(origins)
        .with_max_request_body_bytes(config.mcp.max_request_bytes)
        // A 2026-07-28 request whose first message is its answer (no progress notifications
        // went before it) gets that answer as one `application/json` body, not an SSE stream
        // held open until the handler's task ends. A client that disconnects before the answer
        // still cancels the call; a call that streams progress still gets SSE.
        .with_json_response(true)
        .with_cancellation_token(shutdown);
    // A session opened on another replica (or before a restart) is taken over, not refused.
    http_config.session_store = Some(Arc::new(session_store::PgSessionStore::new(bindings)));
    StreamableHttpService::new(move || Ok(server.clone()), sessions, http_config)
}

/// The legacy era's sessions of this process; one unused for `mcp.session_idle_seconds` ends.
pub fn session_manager(config: &Config) -> Arc<LocalSessionManager> {
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(Duration::from_secs(config.mcp.session_idle_seconds));
    Arc::new(sessions)
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

/// The `sandbox_id` a tool call's arguments name, if any.
fn named_sandbox(arguments: Option<&rmcp::model::JsonObject>) -> Option<String> {
    arguments?.get("sandbox_id")?.as_str().map(str::to_owned)
}

fn claims_of(ctx: &RequestContext<RoleServer>) -> Option<AccessClaims> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<AccessClaims>())
        .cloned()
}

/// Whether the request's token could not be checked against its grant (Postgres away): its
/// tool calls and resource reads are refused retryably.
fn grant_unverified(ctx: &RequestContext<RoleServer>) -> bool {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .is_some_and(|parts| parts.extensions.get::<auth::GrantUnverified>().is_some())
}

/// The legacy era's MCP session, used as the conversation key when none is given: its keyed
/// hash (put there by the session-binding middleware), never the id itself.
fn session_conversation(ctx: &RequestContext<RoleServer>) -> Option<String> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<SessionHash>())
        .map(SessionHash::conversation_key)
}

impl McpServer {
    /// Who is calling, with the tenant's limits.
    async fn caller(&self, claims: &AccessClaims) -> Result<Caller, ServiceError> {
        let service = &self.inner.sandboxes;
        let caller = Caller {
            tenant: claims.tenant,
            subject: claims.sub.clone(),
            token_id: claims.jti.clone(),
            grant: claims.grant,
            limits: service.limits(claims.tenant).await?,
            read_at_admission: None,
            person: None,
        };
        Ok(caller)
    }
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
                 /home/user. A process that must keep running between calls is started with \
                 run_terminal_command and background: true, then list_jobs and kill_job reach \
                 it. A package the sandbox lacks: install_packages (or pip install in a \
                 command); the sandbox stays without network. \
                 Close the sandbox with close_sandbox when the conversation ends. \
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
        crate::limits::check_tool_arguments(request.arguments.as_ref())
            .map_err(|message| ErrorData::invalid_params(message, None))?;
        let started = Instant::now();
        let conversation_arg = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("conversation_id"))
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        let conversation = conversation_arg.or_else(|| session_conversation(&ctx));
        let span = tracing::info_span!("tool", tool = tool.as_str(), tenant_id = %claims.tenant, sandbox_id = tracing::field::Empty);
        let unverified = grant_unverified(&ctx);
        let outcome = async {
            if unverified {
                return Err(CallError::Service(ServiceError::DatabaseAway));
            }
            let mut caller = self.caller(&claims).await?;
            // The tenant's calls per minute and in flight: one statement now, one behind the
            // answer. A call naming its sandbox reads it in that same statement.
            let service = &self.inner.sandboxes;
            let permit = match named_sandbox(request.arguments.as_ref()) {
                Some(id) => service.admit_naming(&mut caller, &id).await?,
                None => service.admit(&caller).await?,
            };
            let answer = self
                .dispatch(
                    tool,
                    request.arguments,
                    &caller,
                    conversation.as_deref(),
                    &ctx,
                )
                .await;
            permit.release();
            answer
        }
        .instrument(span)
        .await;
        let elapsed = started.elapsed();
        let settled = errors::settle(outcome, tool.as_str());
        self.inner
            .metrics
            .record_call(tool, settled.outcome, elapsed);
        if let Some(limit) = settled.kind.and_then(errors::quota_limit) {
            self.inner.metrics.record_quota_refusal(limit);
        }
        let event = AuditEvent {
            at: Utc::now(),
            tenant_id: claims.tenant,
            token_id: Some(claims.jti.clone()),
            subject: Some(claims.sub.clone()),
            conversation_id: conversation,
            sandbox_id: settled.sandbox_id,
            tool: tool.as_str().to_owned(),
            outcome: settled.outcome,
            error_kind: settled.kind,
            duration_ms: i32::try_from(elapsed.as_millis()).unwrap_or(i32::MAX),
        };
        self.inner.audit.record(event);
        settled.response
    }
}
